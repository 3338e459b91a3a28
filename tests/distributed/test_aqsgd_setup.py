"""AQ-SGD's buffer-fit decision is taken by every rank together (gloo, 2 ranks).

Each rank checks its own free memory; ranks can disagree. If one stopped alone the others
would wait in their next collective until the timeout, so the decision is one MIN
all-reduce of the fit flag: here rank 1 sees almost no free memory and *both* ranks must
raise the same error, naming the flags, the rank and the sizes.
"""

from tests.helpers.dist import run_ranks


def _allocate(rank, world):
    from types import SimpleNamespace

    import psutil
    import torch

    from megatron_ext.collectives.aqsgd import AQSGDCodec
    from megatron_ext.config import ConfigError
    from megatron_ext.methods.aqsgd import AQSGDConfig
    from tests.helpers.aqsgd_samples import fixed_samples

    torch.distributed.init_process_group("gloo")
    if rank == 1:  # this rank's host has 1 MB available
        psutil.virtual_memory = lambda: SimpleNamespace(available=1_000_000)
    samples = fixed_samples(64, 1, 1, 64)
    codec = AQSGDCodec(AQSGDConfig(), None)
    try:
        codec.allocate(
            samples,
            64,
            64,
            stage=rank,
            num_stages=world,
            device=torch.device("cpu"),
            group=torch.distributed.group.WORLD,
        )
    except ConfigError as exc:
        return str(exc)
    return None


def test_every_rank_refuses_when_one_rank_lacks_memory():
    messages = run_ranks(_allocate, 2)
    assert all(m is not None for m in messages), messages  # nobody goes on alone
    assert messages[0] == messages[1]
    # 64 samples x 64 tokens x 64 x 4 B (fp32 activations: fp32 buffers) = 1.05 MB.
    assert "--aqsgd-buffer" in messages[0] and "rank 1" in messages[0]
    assert "1.05 MB" in messages[0] and "rank 0" not in messages[0]
