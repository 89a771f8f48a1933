"""The fp8 Gluon GEMMs skipping padding by halves (``Fp8GluonTile.skip``, the kernel's SKIP) on the CPU: a 128-row
block's second 64-row half whose rows are all padding is neither multiplied nor stored (the layout's sorted_ids
say which, checked here against row counts per expert), every real row as the default tiles compute it; the option
reaches the plain and the lean launches; no plan takes it. The GEMMs are the torch stand-ins
(``_gluon_fakes.fp8_gemm``); the kernel itself (Gluon, sm_90 only): ``benchmarks/f8r32_device_check.py`` on the
H200, compiled offline by ``benchmarks/gluon_fp8_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import emulation_f64, quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    DOWN_TILE, PIPELINED_DOWN_TILE, SKIP_DOWN_TILE, SKIP_UP_TILE, UP_TILE, launch_gemm_fp8, plan_gluon_fp8,
)

E, N, K = 4, 256, 256
ROWS = (70, 30, 130, 10)  # assignments per expert: a live second half, a dead one, a block of 2 rows, a dead one


def _problem(seed=0):
    """x [M, K], the quantized weights, ids [M, 2] with ROWS[e] assignments of expert e, weights [M, 2]."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(ROWS)])
    flat = flat[torch.randperm(flat.numel(), generator=g)]
    ids = flat.view(-1, 2)
    ids = torch.where(ids[:, :1] == ids[:, 1:], ids.roll(1, 0), ids)  # no token on one expert twice
    m = ids.shape[0]
    x = torch.randn(m, K, generator=g).bfloat16()
    q13 = quantize_weight(torch.randn(E, 2 * N, K, generator=g) / K**0.5, (128, 128))
    q2 = quantize_weight(torch.randn(E, K, N, generator=g) / N**0.5, (128, 128))
    return x, (*q13, *q2), ids, torch.rand(m, 2, generator=g)


def _dead_halves(ids: torch.Tensor) -> list[int]:
    """First rows of the second halves that hold no assignment, from the row counts (each expert's segment starts on
    a 128-row block, its rows first)."""
    counts = torch.bincount(ids.flatten().long(), minlength=E).tolist()
    dead, start = [], 0
    for n in counts:
        blocks = -(-n // 128)
        dead += [start + 128 * b + 64 for b in range(blocks) if 128 * b + 64 >= n]
        start += 128 * blocks
    return dead


def test_skip_leaves_the_padding_halves_and_computes_every_real_row(fake_gemms):
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.layouts.block_aligned import align_block

    x, (w13_q, w13_s, w2_q, w2_s), ids, _ = _problem()
    lay = gluon_fp8_layout(x, ids, E, align=align_block)
    used, num_assignments = int(lay.rows_used[0]), ids.numel()
    dead = _dead_halves(ids)
    assert dead and len(dead) < used // 128  # both kinds of block in the problem
    outs = {}
    for tile in (UP_TILE, SKIP_UP_TILE):
        h_q, h_s = torch.full((lay.x_q.shape[0], N), float("nan")), torch.full((lay.x_q.shape[0], N // 128), -1.0)
        launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts, lay.rows_used, tile, True, N,
                        sorted_ids=lay.sorted_ids, num_assignments=num_assignments)
        outs[tile.skip] = h_q, h_s
    skipped = torch.zeros(lay.x_q.shape[0], dtype=torch.bool)
    for row in dead:
        skipped[row:row + 64] = True
    written = ~outs[True][0].isnan().all(dim=1)
    assert torch.equal(written[:used], ~skipped[:used])
    real = lay.sorted_ids < num_assignments  # [R]
    assert not (real & skipped).any()
    assert torch.equal(outs[True][0][real], outs[False][0][real])
    assert torch.equal(outs[True][1][real], outs[False][1][real])


@pytest.mark.parametrize("up, down", [(SKIP_UP_TILE, SKIP_DOWN_TILE), (UP_TILE, SKIP_DOWN_TILE),
                                      (SKIP_UP_TILE, PIPELINED_DOWN_TILE)])
def test_skip_tiles_reach_both_launches_and_equal_the_recipe(fake_gemms, up, down):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _problem(1)
    default = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=False)
    plain = experts_gluon_fp8(x, *q, ids, weights, up=up, down=down, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, up=up, down=down)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, default) and torch.equal(lean, default)
    assert rel_l2(plain, emulation_f64(x, *q, ids, weights, (128, 128))) < 2e-2
    launches = [bound for _, bound, _ in fake_gemms["fp8"].log]
    assert [b["SKIP"] for b in launches if b["GATED"]] == [False, up.skip, up.skip]  # default, plain, lean
    assert [b["SKIP"] for b in launches if not b["GATED"]] == [False, down.skip, down.skip]
    assert all(b["num_assignments"] == ids.numel() for b in launches)


def test_skip_needs_the_sorted_ids():
    t = torch.zeros(256, 256)
    with pytest.raises(ValueError, match="a skip tile reads the layout's sorted_ids"):
        launch_gemm_fp8(t, t, t, t, torch.zeros(256, 256), None, t, t, tile=SKIP_DOWN_TILE, gated=False)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden", [
    (512, 2, 8, 4096), (1024, 2, 8, 4096), (4096, 8, 256, 7168), (16384, 2, 8, 4096),
])
def test_no_plan_takes_the_skip_tile(num_tokens, top_k, num_experts, hidden):
    plan = plan_gluon_fp8(num_tokens, top_k, num_experts, hidden)
    assert not plan.up.skip and not plan.down.skip
