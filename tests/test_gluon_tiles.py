"""The bf16 Gluon GEMM's tile knobs on the CPU (issue 19's ridge variants): the fields' checks, shared memory and
register fit (the kernels themselves were checked on the H200 by ``ridge_device_check.py`` and compiled for
sm_90 by ``ridge_compile_cpu.py``, both removed: ``git show 87f368f6:benchmarks/ridge_device_check.py``)."""

from __future__ import annotations

import pytest

from moekit.experts.triton_gluon_launch import DOWN_TILE, NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile

SM90_SHARED = 232448  # bytes of dynamic shared memory one program may take on sm_90 (227 KB)


@pytest.mark.parametrize("fields, named", [
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


@pytest.mark.parametrize("tile", [UP_TILE, DOWN_TILE, NARROW_DOWN_TILE, GluonTile(block_n=256, block_k=32, stages=3)])
def test_shared_bytes_counts_every_tile(tile):
    for gated, weight_tiles in ((True, 2), (False, 1)):
        want = _smem(128, tile.block_n, tile.block_k, tile.stages, weight_tiles)
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
