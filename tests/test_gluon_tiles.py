"""The bf16 Gluon GEMM's tile knobs on the CPU (issue 19's ridge variants): the fields' checks, shared memory and
register fit, the MMA partition's warp split, and a whole call at 64-row tiles through the launchers with the
torch stand-in kernels (``_gluon_fakes``: Gluon does not run in the interpreter; the kernels themselves are
checked on the H200 by ``benchmarks/ridge_device_check.py`` and compiled for sm_90 by ``ridge_compile_cpu.py``)."""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon import gluon_layout
from moekit.experts.triton_gluon_launch import (
    DOWN_TILE, NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile, launch_contiguous_sum, launch_gemm,
)
from moekit.layouts.block_aligned import align_block

E, N, K = 4, 128, 256
SM90_SHARED = 232448  # bytes of dynamic shared memory one program may take on sm_90 (227 KB)


@pytest.mark.parametrize("fields, named", [
    (dict(block_m=32), "block_m"), (dict(block_m=256), "block_m"), (dict(num_warps=2), "num_warps"),
    (dict(block_n=96), "block_n"), (dict(block_k=256), "block_k"), (dict(stages=1), "stages"),
    (dict(group_m=0), "group_m"),
])
def test_tile_fields_are_checked(fields, named):
    with pytest.raises(ValueError, match=named):
        GluonTile(**fields)


def _smem(block_m, block_n, block_k, stages, weight_tiles):
    """bf16 bytes: per stage a [block_m, block_k] activation tile and weight_tiles [block_n, block_k] tiles; one
    [block_m, block_n] output tile."""
    return 2 * (stages * block_k * (block_m + weight_tiles * block_n) + block_m * block_n)


@pytest.mark.parametrize("tile", [UP_TILE, DOWN_TILE, NARROW_DOWN_TILE, GluonTile(block_m=64, stages=5),
                                  GluonTile(block_m=64, block_n=256, block_k=32, stages=5)])
def test_shared_bytes_counts_every_tile(tile):
    for gated, weight_tiles in ((True, 2), (False, 1)):
        want = _smem(tile.block_m, tile.block_n, tile.block_k, tile.stages, weight_tiles)
        assert tile.shared_bytes(gated) == want


def test_the_shipped_tiles_fit_and_too_deep_or_too_wide_ones_raise():
    check_tile(UP_TILE, gated=True)
    check_tile(DOWN_TILE, gated=False)
    deep = GluonTile(stages=5)  # gate-up: 5 x 48 KB + 32 KB
    assert _smem(128, 128, 64, 5, 2) > SM90_SHARED
    with pytest.raises(ValueError, match="SMEM"):
        check_tile(deep, gated=True)
    wide = GluonTile(block_n=256, stages=2)  # gate-up: two [128, 256] float32 accumulators on 256 threads
    assert 2 * 128 * 256 // 256 > 128
    with pytest.raises(ValueError, match="accumulator registers"):
        check_tile(wide, gated=True)
    check_tile(wide, gated=False)  # one accumulator: 128 a thread


@pytest.mark.parametrize("block_m, num_warps, want", [(128, 8, (8, 1)), (64, 8, (4, 2)), (64, 4, (4, 1)),
                                                      (128, 4, (4, 1))])
def test_warp_split_keeps_whole_warpgroups_along_the_rows(block_m, num_warps, want):
    """A wgmma warpgroup (4 warps) covers 64 rows in 16-row slices: warps along the rows = min(warps, rows / 16)."""
    assert GluonTile(block_m=block_m, num_warps=num_warps).warps_mn() == want


def _experts_f64(x, w13, w2, ids, weights):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate_up[:N]) * gate_up[N:]))
    return out


@pytest.mark.parametrize("block_m, num_warps", [(64, 4), (64, 8), (128, 8)])
def test_a_call_at_these_tiles_matches_a_float64_loop(fake_gemms, block_m, num_warps):
    """Layout aligned to block_m, both GEMMs launched with 64- or 128-row tiles, the combine: the output of a
    float64 loop, and each launch compiled with the tile's warps and registers."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    m, k = 40, 2
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    x = torch.randn(m, K, generator=g).bfloat16()
    tile = GluonTile(block_m=block_m, num_warps=num_warps, max_registers=240 if num_warps == 4 else 168)
    lay = gluon_layout(x, ids, E, align=align_block, block_m=block_m)
    assert int(lay.rows_used) % block_m == 0
    h = x.new_empty(lay.x_perm.shape[0], N)
    launch_gemm(lay.x_perm, w13.view(E * 2 * N, K), h, lay.block_experts, lay.rows_used, tile, True, 2 * N, N)
    y = x.new_empty(lay.x_perm.shape[0], K)
    launch_gemm(h, w2.view(E * K, N), y, lay.block_experts, lay.rows_used, tile, False, K)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, lay.src_to_dst, weights, out)
    ref = _experts_f64(x, w13, w2, ids, weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    for _grid, bound, options in fake_gemms["bf16"].log:
        assert bound["a_desc"].block_shape == [block_m, tile.block_k]
        assert options == dict(num_warps=num_warps, maxnreg=tile.max_registers)


@pytest.fixture
def launched(monkeypatch):
    """Counts the calls that went through a recorded sequence."""
    from moekit.experts.triton_lean import LaunchSequence

    count, real = [0], LaunchSequence.launch

    def launch(self, values):
        count[0] += 1
        return real(self, values)

    monkeypatch.setattr(LaunchSequence, "launch", launch)
    return count


LEAN_TILES = {"64-row": (GluonTile(block_m=64, stages=5), GluonTile(block_m=64, block_n=256, stages=4))}


@pytest.mark.parametrize("name", list(LEAN_TILES))
@pytest.mark.parametrize("m, k", [(40, 2), (1100, 4)])  # one alignment launch; hist + scan + scatter (A > 4096)
def test_the_lean_launch_at_these_tiles_equals_the_plain_one(fake_gemms, launched, monkeypatch, m, k, name):
    """The route's tiles (``gluon_tiles``) at block_m 64: the lean launch aligns, grids, describes and binds them,
    bit-equal to the plain launch and a float64 loop."""
    import moekit.experts.triton_gluon as tg
    import moekit.experts.triton_gluon_launch as tgl
    from moekit.experts.triton import clear_launch_caches

    tiles = LEAN_TILES[name]
    monkeypatch.setattr(tg, "gluon_tiles", lambda num_tokens, inter: tiles)
    monkeypatch.setattr(tgl, "gluon_tiles", lambda num_tokens, inter: tiles)
    clear_launch_caches()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    plain = tg.experts_gluon(x, w13, w2, ids, weights, lean=False)
    first = tg.experts_gluon(x, w13, w2, ids, weights)
    again = tg.experts_gluon(x, w13, w2, ids, weights)
    assert launched[0] == 1 and torch.equal(first, plain) and torch.equal(again, plain)
    ref = _experts_f64(x, w13, w2, ids, weights)
    assert ((again.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert all(bound["a_desc"].block_shape[0] == 64 for _grid, bound, _o in fake_gemms["bf16"].log)
    clear_launch_caches()


def test_the_lean_launch_refuses_tiles_of_two_heights(fake_gemms, monkeypatch):
    import moekit.experts.triton_gluon as tg

    monkeypatch.setattr(tg, "gluon_tiles", lambda num_tokens, inter: (GluonTile(block_m=64), GluonTile()))
    x = torch.randn(8, K).bfloat16()
    w13, w2 = torch.randn(E, 2 * N, K).bfloat16(), torch.randn(E, K, N).bfloat16()
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(8)]).int()
    with pytest.raises(ValueError, match="block_m"):
        tg.experts_gluon(x, w13, w2, ids, torch.rand(8, 2))
