"""Grass's linear backward under sequence parallelism, on gloo with 2 tensor-parallel ranks.

megatron-core's column-parallel layer with ``--sequence-parallel`` hands its linear function
this rank's sequence chunk of the input; the function all-gathers it along the sequence for
the matmul and reduce-scatters the input gradient back to chunks. Grass's backward
re-implements that communication (``megatron_ext.autograd.grass``); the driver has no
``--sequence-parallel`` flag, so it is checked here against dense float64 algebra: each
rank's input-gradient chunk equals the chunk of ``dY W`` summed over the weight shards, and
the virtual parameter's gradient equals the selected rows (or columns) of this shard's full
weight gradient ``dY_shard^T X``, for a row-projected and a column-projected shard.
"""

import pytest
import torch

from tests.helpers.dist import run_ranks


def _sp_column_parallel(rank, world, m_local, n, r):
    import torch.distributed as dist

    from megatron_ext.autograd.grass import GrassLayer, grass_linear, projected_dim

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same full tensors on both ranks
        seq, batch = 6, 2
        w_full = torch.randn(world * m_local, n, dtype=torch.float64)
        x_full = torch.randn(seq, batch, n, dtype=torch.float64)
        g_full = torch.randn(seq, batch, world * m_local, dtype=torch.float64)
        rows = slice(rank * m_local, (rank + 1) * m_local)
        chunk = slice(rank * seq // world, (rank + 1) * seq // world)
        weight = w_full[rows].clone()
        mode, size = projected_dim(tuple(weight.shape))
        shape = (r, n) if mode == "row" else (m_local, r)
        param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        layer = GrassLayer(
            fqn="layer", weight=weight, param=param, mode=mode, rank=r, method="topr",
            sketch_size=0, seed=0,
        )  # fmt: skip
        index = torch.randperm(size, generator=torch.Generator().manual_seed(rank))[:r]
        rho = torch.rand(r, generator=torch.Generator().manual_seed(10 + rank)) + 0.5
        layer.set_selection(index, rho, param.data)

        x = x_full[chunk].clone().requires_grad_(True)
        out = grass_linear(x, weight, None, layer, sequence_parallel=True, group=dist.group.WORLD)
        out.backward(g_full[..., rows])

        # Dense references.
        assert torch.allclose(out, x_full @ weight.t())
        dx_ref = (g_full @ w_full)[chunk]
        dw = g_full[..., rows].reshape(-1, m_local).t() @ x_full.reshape(-1, n)
        if mode == "row":
            gc_ref = dw[index] * rho[:, None]
        else:
            gc_ref = dw[:, index] * rho[None, :]
        return {
            "mode": mode,
            "dx_err": (x.grad - dx_ref).abs().max().item(),
            "gc_err": (param.grad - gc_ref).abs().max().item(),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("m_local, n, mode", [(8, 12, "row"), (12, 8, "col")])
def test_sequence_parallel_column_layer_matches_dense_algebra(m_local, n, mode):
    for out in run_ranks(_sp_column_parallel, 2, m_local, n, 4):
        assert out["mode"] == mode
        assert out["dx_err"] < 1e-12, out
        assert out["gc_err"] < 1e-12, out
