"""The bf16 Gluon gate-up GEMM on 256-row tiles (``triton_gluon_blk256``, ``GluonTile.blk256``; issue 19) on the CPU:
the tile list (which 128-row blocks start a tile, how many 64-row sub-tiles it computes) against one built from the
experts' row counts, the torch twin against a float64 loop (rows it skips untouched), the tile's fit, the down GEMM
refused on such tiles, and the plain and lean launches (a torch stand-in in the kernel's place,
``_gluon_fakes.blk256_gemm``) against a float64 loop of the layer.
The kernel's sm_90 SASS: ``benchmarks/gluon_sass_diff_cpu.py`` (``blk256_up``); session 28 compiled it in
``blk256_compile_cpu.py`` and ran it on the H200 in ``blk256_device_check.py`` (both removed: ``git show
87f368f6:benchmarks/blk256_device_check.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moekit.experts.triton_gluon_blk256 import blk256_gemm_twin, live_subtiles
from moekit.experts.triton_gluon_launch import (
    BLK256_UP_TILE, SHARED_BYTES, UP_TILE, GluonTile, check_tile, down_tile,
)

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import experts_loop, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from test_gluon_tail import layout_from_counts
from test_triton_gluon_lean import _bf16_problem

DOWN_256 = GluonTile(block_n=128, block_k=64, stages=3, group_m=1, blk256=True)  # the removed down tile's shape
COUNTS = [
    [130, 0, 128, 200, 7, 0, 384 + 64, 384 + 65, 256 + 1],  # 1-4 blocks, empty experts, 64-row edges
    [0, 0, 1000, 0],  # one expert: 8 blocks, 4 tiles, the last with 104 rows (two sub-tiles)
    [64, 65, 192, 193, 256, 257],
    [0, 0],
]


def expected_live(counts: list[int]) -> list[int]:
    """Per used block: 0 for the odd blocks of an expert, else its sub-tiles with a real first row (at most 4)."""
    out = []
    for n in counts:
        for j in range(-(-n // 128)):
            out.append(0 if j % 2 else min(4, -(-(n - 128 * j) // 64)))
    return out


@pytest.mark.parametrize("counts", COUNTS)
def test_live_subtiles_follow_the_counts(counts):
    experts, ids, used, a = layout_from_counts(counts)
    got = live_subtiles(experts, ids, used, a)
    want = expected_live(counts)
    assert got[:len(want)].tolist() == want
    assert not got[len(want):].any()  # blocks past rows_used start no tile
    assert int(got.sum()) * 64 >= sum(counts)  # every real row multiplied


def test_twin_writes_the_real_rows_and_leaves_skipped_ones():
    counts = COUNTS[0]
    experts, ids, used, a = layout_from_counts(counts)
    g = torch.Generator().manual_seed(3)
    num_experts, rows, k, n = len(counts), ids.numel(), 64, 128
    w = torch.randn(num_experts * 2 * n, k, generator=g).bfloat16()  # [E * 2N, K]: gate rows, then up rows
    x = torch.randn(rows, k, generator=g).bfloat16()
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    blk256_gemm_twin(x, w, out, experts, ids, torch.tensor([used]), a, 2 * n, n)
    for r in range(rows):
        if int(ids[r]) >= a:
            continue
        e = int(experts[r // 128])
        gate = w[e * 2 * n:e * 2 * n + n].double() @ x[r].double()
        want = torch.nn.functional.silu(gate) * (w[e * 2 * n + n:(e + 1) * 2 * n].double() @ x[r].double())
        torch.testing.assert_close(out[r].double(), want, rtol=2e-2, atol=2e-2)
    written = ~out.isnan().all(dim=1)
    live = live_subtiles(experts, ids, used, a)
    assert int(written.sum()) == int(live.sum()) * 64  # exactly the live sub-tiles' rows


def test_blk256_tile_fits_sm90_and_refuses_what_it_cannot_run():
    tile = BLK256_UP_TILE
    check_tile(tile, True)
    ring = tile.stages * (256 + 128) * tile.block_k * 2
    assert tile.shared_bytes(True) == ring + 2 * 128 * 64 * 2 <= SHARED_BYTES  # two [128, 64] output buffers
    assert tile.accumulator_registers(True) == 128
    with pytest.raises(ValueError, match="SMEM"):
        check_tile(replace(tile, stages=tile.stages + 1), True)
    with pytest.raises(ValueError, match="gate-up GEMM only"):
        check_tile(DOWN_256, False)
    for bad in (dict(block_n=64), dict(tail=64)):
        with pytest.raises(ValueError, match="blk256"):
            GluonTile(blk256=True, **bad)


def test_plain_launch_on_blk256_gate_up_tiles(fake_gemms):
    """The layer through ``launch_gemm``, the gate-up GEMM on 256-row tiles, against a float64 loop; the kernel gets
    its 4-warp partition, 64-row blocks and the layout's sorted_ids; the down GEMM on them is refused."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum, launch_gemm

    x, w13, w2, ids, weights = _bf16_problem(300, 2)  # 150 rows an expert: tiles of 3 sub-tiles
    num_experts, hidden, inter = w2.shape
    want = experts_loop(x, w13, w2, ids, weights)
    lay = gluon_layout(x, ids, num_experts)
    rows, a = lay.sorted_ids.numel(), ids.numel()
    h, y = x.new_full((rows, inter), float("nan")), x.new_full((rows, hidden), float("nan"))
    launch_gemm(lay.x_perm, w13.view(-1, hidden), h, lay.block_experts, lay.rows_used, BLK256_UP_TILE, True,
                2 * inter, inter, lay.sorted_ids, a)
    launch_gemm(h, w2.view(-1, inter), y, lay.block_experts, lay.rows_used, down_tile(inter), False, hidden)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, lay.src_to_dst, weights.contiguous(), out)
    assert rel_l2(out, want) < 1e-2
    (_, bound, options), = fake_gemms["blk256"].log
    assert options == {"num_warps": 4, "maxnreg": 160, "enable_fp_fusion": True} and bound["SEARCH_STEPS"] >= 1
    assert bound["sorted_ptr"] is lay.sorted_ids and bound["num_assignments"] == ids.numel()
    assert bound["c_desc"].block_shape == [64, 64] and bound["w_desc"].block_shape == [64, 64]
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm(lay.x_perm, w13.view(-1, hidden), h, lay.block_experts, lay.rows_used, BLK256_UP_TILE, True,
                    2 * inter, inter)
    with pytest.raises(ValueError, match="gate-up"):
        launch_gemm(h, w2.view(-1, inter), y, lay.block_experts, lay.rows_used, DOWN_256, False, hidden, 0,
                    lay.sorted_ids, a)


@pytest.mark.parametrize("m", [100, 600])
def test_lean_launch_on_blk256_gate_up_tiles(fake_gemms, m):
    """``run_lean`` with the 256-row gate-up tile: the gather kernel (not the in-loader gather: the tiles read
    x_perm), the gate-up GEMM the 256-row kernel, the down GEMM the route's, the output the float64 loop's; again
    from the kept launches. The down GEMM on 256-row tiles is refused."""
    from moekit.experts import triton_gluon_lean

    x, w13, w2, ids, weights = _bf16_problem(m, 2)
    want = experts_loop(x, w13, w2, ids, weights)
    down = down_tile(w2.shape[2])
    for _ in range(2):
        out = triton_gluon_lean.run_lean(x, w13, w2, ids, weights, None, BLK256_UP_TILE, down)
        assert rel_l2(out, want) < 1e-2
    (_, up_bound, up_options), (_, down_bound, _) = fake_gemms["blk256"].log[0], fake_gemms["bf16"].log[0]
    assert up_bound["c_desc"].block_shape == [64, 64] and up_bound["sorted_ptr"] is not None
    assert up_options == {"num_warps": 4, "maxnreg": 160, "enable_fp_fusion": True}  # constexprs by name
    assert not down_bound["GATED"] and down_bound["c_desc"].block_shape == [128, down.block_n]
    assert not fake_gemms["gather"].log
    with pytest.raises(ValueError, match="x_perm"):
        triton_gluon_lean.run_lean(x, w13, w2, ids, weights, None, BLK256_UP_TILE, down, in_loader=True)
    with pytest.raises(ValueError, match="gate-up"):
        triton_gluon_lean.run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_256)


def test_the_route_takes_the_256_row_gate_up_tile_at_mixtral_512_only():
    """M*k/E in [112, 160] for experts at least 8192 wide (Mixtral-8x7B: E = 8, k = 2, N = 14336): M = 512 only."""
    from moekit.experts.triton_gluon_launch import plan_gluon, up_tile

    assert up_tile(512, 2, 8, 14336) == BLK256_UP_TILE == plan_gluon(512, 2, 8, 14336).up
    for m, k, e, n in ((1024, 2, 8, 14336), (256, 2, 8, 14336), (4096, 8, 256, 2048), (4096, 8, 128, 768)):
        assert up_tile(m, k, e, n) == UP_TILE == plan_gluon(m, k, e, n).up


@pytest.mark.parametrize("lean", [True, False])
def test_experts_gluon_on_the_route_with_256_row_gate_up_tiles(fake_gemms, monkeypatch, lean):
    """Where ``up_tile`` picks the 256-row tile (its width bound lowered to this problem's N = 128, 128 rows an
    expert), both launches run the gate-up GEMM on it, the down GEMM on the route's tile, and match the float64
    loop."""
    from moekit.experts import triton_gluon_launch
    from moekit.experts.triton_gluon import experts_gluon

    monkeypatch.setattr(triton_gluon_launch, "BLK256_UP_MIN_INTER", 128)
    x, w13, w2, ids, weights = _bf16_problem(256, 2)
    want = experts_loop(x, w13, w2, ids, weights)
    out = experts_gluon(x, w13, w2, ids, weights, lean=lean)
    assert rel_l2(out, want) < 1e-2
    (_, bound, _), = fake_gemms["blk256"].log
    assert bound["GATE_OFFSET"] == w2.shape[2] and fake_gemms["bf16"].log  # the down GEMM: the route's kernel
