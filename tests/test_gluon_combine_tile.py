"""The k-slot combine's program tile (``SumTile``) on the Gluon paths' lean launch, on the CPU: the tile reaches the
combine's launch (grid and constexprs) and a call's kind (its own plan), and any tile gives the default's output bit
for bit, equal to a float64 loop (the alignment, in-loader gather stand-in and combine interpreted; the GEMMs as torch
stand-ins, ``_gluon_fakes``)."""

from __future__ import annotations

import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_launch import SUM_TILE, UP_TILE, SumTile, down_tile

E, N, K, M, TOP_K = 4, 128, 256, 50, 2


def _problem():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    ids = torch.rand(M, E, generator=g).topk(TOP_K, dim=1).indices.int()
    return x, w13, w2, ids, torch.softmax(torch.rand(M, TOP_K, generator=g), dim=1)


def _f64(x, w13, w2, ids, weights):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate_up[:N]) * gate_up[N:]))
    return out


def test_lean_launch_takes_the_combine_tile(fake_gemms):
    from moekit.experts.triton_gluon_lean import plan_for, run_lean

    x, w13, w2, ids, weights = _problem()
    old = SumTile(16, 256, 4)  # session 25's combine tile, the A/B's other side
    assert old != SUM_TILE
    outs = {}
    for tile in (SUM_TILE, old, SumTile(8, 64, 2)):
        for _ in range(2):  # the compiling call, then the kept launches
            outs.setdefault(tile, []).append(run_lean(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N),
                                                      combine=tile))
        plan = plan_for(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N), in_loader=True, combine=tile)
        assert plan.combine.grid == (-(-M // tile.block_t), -(-K // tile.block_k), 1)
        assert plan.combine.options["num_warps"] == tile.num_warps
        assert (tile.block_t, tile.block_k) in [plan.combine.tail[i:i + 2] for i in range(len(plan.combine.tail))]
    first = outs[SUM_TILE][0]
    assert all(torch.equal(o, first) for runs in outs.values() for o in runs)
    assert rel_l2(first.double(), _f64(x, w13, w2, ids, weights)) < 1e-2
    default = plan_for(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N), in_loader=True)
    assert default is plan_for(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N), in_loader=True, combine=SUM_TILE)
    assert default is not plan_for(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N), in_loader=True, combine=old)
