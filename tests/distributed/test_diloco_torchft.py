"""DiLoCo against torchft's (``torchft.local_sgd.DiLoCo``, PyTorch's reference) on the same inputs.

One launch of 4 gloo ranks covers G = 4 sites (the whole world) and G = 2 (the pairs {0, 1}
and {2, 3}). Every rank builds the same small model from the same start and trains it with
torch AdamW on its own data (a different regression batch per rank and step), twice:

* ours: :class:`~megatron_ext.optim.diloco.DiLoCoHook` on a view of the model's parameters
  (the fp32 main parameter is the model parameter, as the megatron adapter gives it without
  mixed precision), ``pre_step`` / ``post_step`` around the inner step;
* torchft's: ``DiLoCo(manager, fragments, inner, outer, sync_every, ...)`` with torch SGD as
  the outer optimizer. Its ``Manager`` is torchft's fault-tolerance control plane (quorum,
  commit, checkpoint registration against a lighthouse server); a stand-in runs it in-process:
  quorum and state-dict registration do nothing, every commit succeeds (advancing the step as
  ``Manager.should_commit`` does), and ``allreduce`` is the real gloo all-reduce over the same
  group, averaged as ``Manager.allreduce`` averages. The algorithm is torchft's own code.

Compared: every parameter on every rank after every step; they agree to float32 rounding,
the sites' weights differ between synchronizations and agree after one (so the comparison is
not between two idle runs). Settings: the DiLoCo paper's outer optimizer (lr 0.7, Nesterov
0.9), plain momentum 0.5 without Nesterov, and streaming with 3 fragments.

Fragment order: torchft syncs fragment ``j`` after step ``(j + 1) H / F`` of each cycle of H;
ours syncs fragment ``i`` after the steps ``t`` with ``t % H == i H / F``; the same slots when
torchft is given our fragments rotated by one (``ours[1:] + ours[:1]``). Not compared here:
an overlapped exchange (``--outer-delay`` tau > 0): torchft starts a fragment's exchange tau
steps before its slot and applies it at the slot, ours starts at the slot and applies it tau
steps later (the same algorithm on a schedule shifted by tau, so the first cycle differs);
test_outer_exchange.py checks it against a float64 statement. torchft's ``should_quantize``
is its own codec, not ours.
"""

import pytest

from tests.helpers.dist import run_ranks

STEPS = 13
SETTINGS = {
    # label: (H, F, outer lr, momentum, nesterov)
    "paper-h4": (4, 1, 0.7, 0.9, True),
    "momentum-h3": (3, 1, 0.7, 0.5, False),
    "streaming-h6-f3": (6, 3, 0.7, 0.9, True),
}


def _model():
    import torch

    torch.manual_seed(11)  # the same start on every site
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8), torch.nn.Tanh()
    )


def _loss(model, member, step):
    import torch

    gen = torch.Generator().manual_seed(1_000 * step + member)
    x = torch.randn(8, 16, generator=gen)
    y = torch.randn(8, 8, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def _inner(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _ours(member, group, setting):
    from megatron_ext.optim.diloco import DiLoCoHook
    from tests.helpers.outer_options import outer_options
    from tests.helpers.views import ParamsView

    interval, fragments, lr, momentum, nesterov = SETTINGS[setting]
    model = _model()
    params = dict(model.named_parameters())
    inner = _inner(model)
    clock = {"step": 0}

    opts = outer_options(
        interval=interval, lr=lr, momentum=momentum, nesterov=nesterov, fragments=fragments
    )
    hook = DiLoCoHook(opts, group)
    view = ParamsView(params, clock)
    hook.setup(view)
    history = []
    for step in range(STEPS):
        clock["step"] = step
        inner.zero_grad()
        _loss(model, member, step).backward()
        hook.pre_step(view)
        inner.step()
        hook.post_step(view, True)
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history, hook.fragments


class _Done:
    """A finished collective, as torchft's ``Work`` is used by DiLoCo (``wait``)."""

    def wait(self, timeout=None):
        return True


class _InProcessManager:
    """torchft's ``Manager`` seen from DiLoCo, without its lighthouse: every quorum is the
    whole group and every commit succeeds; ``allreduce`` averages over the gloo group."""

    _use_async_quorum = False

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        self.step = 0
        self.allreduces = 0

    def disallow_state_dict_read(self):
        pass

    def allow_state_dict_read(self):
        pass

    def register_state_dict_fn(self, key, load_fn, save_fn):
        pass

    def start_quorum(self, *args, **kwargs):
        pass

    def current_step(self):
        return self.step

    def should_commit(self, *args, **kwargs):
        self.step += 1
        return True

    def allreduce(self, tensor, should_quantize=False, **kwargs):
        import torch.distributed as dist

        assert not should_quantize
        dist.all_reduce(tensor, group=self.group)
        tensor.div_(self.size)
        self.allreduces += 1
        return _Done()


def _torchft(member, group, setting, our_fragments):
    import torch
    from torchft.local_sgd import DiLoCo

    interval, fragments, lr, momentum, nesterov = SETTINGS[setting]
    model = _model()
    params = dict(model.named_parameters())
    inner = _inner(model)

    def holder(fqns):
        m = torch.nn.Module()
        for fqn in fqns:
            m.register_parameter(fqn.replace(".", "_"), params[fqn])
        return m

    rotated = our_fragments[1:] + our_fragments[:1]
    modules = [holder(f) for f in rotated]
    outer = [
        torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)
        for m in modules
    ]
    manager = _InProcessManager(group)
    history = []
    with DiLoCo(manager, modules, inner, outer, sync_every=interval, pin_memory=False):
        for step in range(STEPS):
            inner.zero_grad()
            _loss(model, member, step).backward()
            inner.step()  # DiLoCo's optimizer hooks sync after it
            history.append({n: p.detach().clone() for n, p in params.items()})
    return history, manager.allreduces


def _all(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for sites, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        for setting in SETTINGS:
            ours, fragments = _ours(rank, group, setting)
            theirs, allreduces = _torchft(rank, group, setting, fragments)
            out[sites, setting] = {
                "ours": ours,
                "torchft": theirs,
                "fragments": fragments,
                "allreduces": allreduces,
            }
    return out


@pytest.fixture(scope="module")
def results():
    # torchft is a test dependency (setup.py's "test" extra): fail here, loudly, without it.
    import torchft.local_sgd  # noqa: F401

    return run_ranks(_all, 4)


@pytest.mark.parametrize("sites", [4, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_diloco_equals_torchft_diloco_on_the_same_inputs(results, sites, setting):
    import torch

    interval, fragments, _, _, _ = SETTINGS[setting]
    for rank, out in enumerate(results):
        run = out[sites, setting]
        ours, theirs = run["ours"], run["torchft"]
        # Every parameter in exactly one fragment, none empty: the rotation is meaningful.
        names = [n for f in run["fragments"] for n in f]
        assert sorted(names) == sorted(ours[0]) and len(names) == len(set(names))
        assert len(run["fragments"]) == fragments and all(run["fragments"])
        # torchft synced (one all-reduce per parameter per fragment sync).
        syncs = STEPS // (interval // fragments)
        assert run["allreduces"] == sum(
            len(run["fragments"][(k + 1) % fragments]) for k in range(syncs)
        )
        for step, (a, b) in enumerate(zip(ours, theirs)):
            for name in a:
                diff = (a[name] - b[name]).abs().max().item()
                assert diff <= 2e-6 * max(1.0, b[name].abs().max().item()), (
                    f"rank {rank}, {sites} sites, {setting}: {name} after step {step + 1} "
                    f"differs from torchft's by {diff:.3g}"
                )
    # The sites drift apart between syncs and agree right after one (per site group).
    groups = [[0, 1, 2, 3]] if sites == 4 else [[0, 1], [2, 3]]
    for g in groups:
        hist = [results[r][sites, setting]["ours"] for r in g]
        t_sync = interval  # every fragment synced by then (fragment 0 last, at t = H)
        before = hist[0][t_sync - 2]
        assert any(
            not torch.equal(before[n], hist[1][t_sync - 2][n]) for n in before
        ), "the sites did not drift apart between syncs: nothing was compared"
        frag0 = results[g[0]][sites, setting]["fragments"][0]
        for n in frag0:
            for r in range(1, len(g)):
                assert torch.equal(hist[0][t_sync - 1][n], hist[r][t_sync - 1][n])
