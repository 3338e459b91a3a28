"""QuantizedAdam's parameter update reads Adam's step count where the optimizer keeps it.

torch's Adam counts per parameter (``state["step"]``), Apex's and Transformer Engine's
FusedAdam per param group (``group["step"]``, advanced once per step for the whole group).
Both must give the authors' update with the same bias correction.
"""

import math


def test_update_with_per_parameter_and_per_group_step_counts():
    import torch

    from megatron_ext.collectives.quantized_adam import _apply
    from megatron_ext.protocols import ParamOptimState

    lr, wd, betas, eps = 0.1, 0.01, (0.9, 0.95), 1e-8
    m, v = torch.full((3,), 0.5), torch.full((3,), 0.25)
    results = []
    for where in ("param", "group"):
        p = torch.ones(3)
        group = {"lr": lr, "weight_decay": wd, "betas": betas, "eps": eps}
        state = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        if where == "param":
            state["step"] = torch.tensor(4.0)
        else:
            group["step"] = 5  # QuantizedAdamHook.update advances the group's count first
        _apply(ParamOptimState(fqn="w", model_param=p, main_param=p, state=state, group=group))
        count = state["step"] if where == "param" else group["step"]
        results.append((p.clone(), float(count)))
    size = lr * math.sqrt(1 - betas[1] ** 5) / (1 - betas[0] ** 5)
    expected = (1 - size * 0.5 / (0.5 + eps)) * (1 - lr * wd)
    for p, count in results:
        assert count == 5.0
        assert torch.allclose(p, torch.full((3,), expected), rtol=0, atol=1e-6), (p, expected)
