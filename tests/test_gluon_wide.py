"""The gate-up Gluon GEMM with one wgmma for gate and up (``GluonTile.wide``, ``_kernels/gluon_gemm_wide.py``, issue 19
at the ridge) on the CPU: the tile's checks, and that both launches (plain and lean) take the wide kernel (a torch
stand-in in its place) and compute what a float64 loop does. The kernel runs on the H200
(``benchmarks/mid7_device_check.py``) and compiles for sm_90 in ``benchmarks/mid7_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.triton_gluon_launch import DOWN_TILE, UP_TILE, GluonTile, check_tile, launch_gemm

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from test_gluon_tail import layout_from_counts

WIDE = GluonTile(UP_TILE.block_n, UP_TILE.block_k, UP_TILE.stages, UP_TILE.group_m, wide=True)


def test_wide_is_the_plain_gate_up_tile_only():
    check_tile(WIDE, gated=True)
    assert WIDE.shared_bytes(True) == UP_TILE.shared_bytes(True)  # the same ring: gate and up side by side
    with pytest.raises(ValueError, match="gate-up GEMM only"):
        check_tile(GluonTile(stages=6, wide=True), gated=False)
    for bad in (dict(halves=True), dict(block_n=256)):
        with pytest.raises(ValueError, match="wide"):
            GluonTile(stages=3, wide=True, **bad)


def test_wide_launch_matches_a_float64_loop(fake_gemms):  # noqa: F811
    torch.manual_seed(2)
    counts = [130, 0, 200, 1]
    experts, ids, used, a = layout_from_counts(counts)
    rows, k, n = ids.numel(), 64, 128
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(len(counts) * 2 * n, k) * k ** -0.5).to(torch.bfloat16)
    out = torch.zeros(rows, n, dtype=torch.bfloat16)
    launch_gemm(x, w, out, experts, torch.tensor([used], dtype=torch.int32), WIDE, True, 2 * n, n)
    (_, bound, options), = fake_gemms["wide"].log
    assert not fake_gemms["bf16"].log and bound["GATED"] and bound["GATE_OFFSET"] == n
    for r in range(used):
        if int(ids[r]) >= a:
            continue
        first = int(experts[r // 128]) * 2 * n
        gate = w[first:first + n].double() @ x[r].double()
        up = w[first + n:first + 2 * n].double() @ x[r].double()
        torch.testing.assert_close(out[r].double(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_lean_launch_with_wide_equals_the_plain_tiles(fake_gemms):  # noqa: F811
    from moekit.experts.triton_gluon_lean import run_lean

    g = torch.Generator().manual_seed(6)
    e, n, k, m, top_k = 4, 128, 128, 300, 2
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k ** -0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n ** -0.5).bfloat16()
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    plain = run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_TILE, in_loader=False)
    first = run_lean(x, w13, w2, ids, weights, None, WIDE, DOWN_TILE, in_loader=False)
    again = run_lean(x, w13, w2, ids, weights, None, WIDE, DOWN_TILE, in_loader=False)
    assert torch.equal(first, plain) and torch.equal(again, plain)
    assert len(fake_gemms["wide"].log) == 2 and all(c[1]["GATED"] for c in fake_gemms["wide"].log)
    with pytest.raises(ValueError, match="wide for the gate-up GEMM only"):
        run_lean(x, w13, w2, ids, weights, None, UP_TILE, GluonTile(stages=6, wide=True), in_loader=False)
    with pytest.raises(ValueError, match="in-loader"):
        run_lean(x, w13, w2, ids, weights, None, WIDE, DOWN_TILE, in_loader=True)


def test_wide_tail_launch_matches_a_float64_loop_and_skips_folded_rows(fake_gemms):  # noqa: F811
    from test_gluon_tail import expected_folds

    torch.manual_seed(3)
    counts = [130, 0, 200, 64, 257, 1]
    experts, ids, used, a = layout_from_counts(counts)
    rows, k, n = ids.numel(), 64, 128
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(len(counts) * 2 * n, k) * k ** -0.5).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    tile = GluonTile(UP_TILE.block_n, UP_TILE.block_k, 3, UP_TILE.group_m, tail=64, wide=True)
    check_tile(tile, gated=True)  # 192 accumulator registers: the wide tail's limit
    launch_gemm(x, w, out, experts, torch.tensor([used], dtype=torch.int32), tile, True, 2 * n, n, ids, a)
    (_, bound, _), = fake_gemms["wide tail"].log
    assert bound["STAGES"] == 3 and bound["t_desc"].block_shape == [64, 64] and bound["GATE_OFFSET"] == n
    for r in range(used):
        if int(ids[r]) >= a:
            continue
        first = int(experts[r // 128]) * 2 * n
        gate = w[first:first + n].double() @ x[r].double()
        up = w[first + n:first + 2 * n].double() @ x[r].double()
        torch.testing.assert_close(out[r].double(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)
    for b, f in enumerate(expected_folds(counts)):  # rows past a folded tail: never written
        if f:
            assert torch.isnan(out[(b + 1) * 128 + 64:(b + 2) * 128].float()).all()
    with pytest.raises(ValueError, match="down GEMM only"):
        check_tile(GluonTile(stages=3, tail=64), gated=True)  # the plain gate-up GEMM: no tail


def test_lean_launch_with_the_wide_tail_equals_the_plain_tiles(fake_gemms):  # noqa: F811
    """The lean launch binds the wide gate-up GEMM folding tails (T over x_perm, CT over h, sorted_ids), with and
    without the down GEMM's tail; equal to the plain tiles bit for bit, first call and recorded sequence."""
    from moekit.experts.triton_gluon_launch import with_tail
    from moekit.experts.triton_gluon_lean import run_lean

    g = torch.Generator().manual_seed(8)
    e, n, k, m, top_k = 4, 128, 128, 300, 2  # ~150 rows an expert: a 128-row block and a mostly empty one each
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k ** -0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n ** -0.5).bfloat16()
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    up = GluonTile(UP_TILE.block_n, UP_TILE.block_k, 3, UP_TILE.group_m, tail=64, wide=True)
    plain = run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_TILE, in_loader=False)
    for down in (DOWN_TILE, with_tail(DOWN_TILE)):
        first = run_lean(x, w13, w2, ids, weights, None, up, down, in_loader=False)
        again = run_lean(x, w13, w2, ids, weights, None, up, down, in_loader=False)
        assert torch.equal(first, plain) and torch.equal(again, plain)
    calls = fake_gemms["wide tail"].log
    assert len(calls) == 4 and len(fake_gemms["tail"].log) == 2
    _, bound, _ = calls[0]
    assert bound["t_desc"].block_shape == [64, 64] and bound["ct_desc"].block_shape == [64, 128]
    assert bound["t_desc"].base.shape[1] == k and bound["ct_desc"].base.shape[1] == n  # x_perm and h
    with pytest.raises(ValueError, match="in-loader"):
        run_lean(x, w13, w2, ids, weights, None, up, DOWN_TILE, in_loader=True)
