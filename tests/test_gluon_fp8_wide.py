"""The fp8 Gluon down GEMM on [128, 256] tiles (``Fp8GluonTile.wide``) on the CPU: the plain and lean launches with
the GEMMs as torch stand-ins that address the weights tile by tile as the kernel does (``_gluon_fakes.fp8_gemm``:
a wrong column-block count or second-tile offset leaves NaN or wrong columns), against the [128, 128] tiles bit for
bit and a float64 loop; and the refusals. The kernel itself: ``benchmarks/f8pre_device_check.py`` on the H200."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    DOWN_TILE, UP_TILE, WIDE_DOWN_TILE, Fp8GluonTile, launch_gemm_fp8,
)

E, N, K = 4, 128, 512  # K = two 256-wide column blocks of the down GEMM


def _problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    q13 = quantize_weight(torch.randn(E, 2 * N, K, generator=g) / K**0.5, (128, 128))
    q2 = quantize_weight(torch.randn(E, K, N, generator=g) / N**0.5, (128, 128))
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    return x, (*q13, *q2), ids, torch.rand(m, k, generator=g)


def _e4m3_groups(v: torch.Tensor) -> torch.Tensor:
    """v [C] through e4m3 per 128 values (scale amax / 448, 1 for zeros), in float64."""
    v = v.double().view(-1, 128)
    amax = v.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((v / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double() * s).view(-1)


def _f64(x, q, ids, weights):
    """Slot by slot: x and h through e4m3 per 128 columns, dequantized weights, y rounded to bf16, weighted sum."""
    w13 = q[0].double() * q[1].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    w2 = q[2].double() * q[3].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = _e4m3_groups(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ xq
            h = _e4m3_groups(torch.nn.functional.silu(gate_up[:N]) * gate_up[N:])
            out[t] += float(weights[t, j]) * (w2[e] @ h).bfloat16().double()
    return out


def test_wide_tiles_equal_the_narrow_ones_and_a_float64_loop(fake_gemms):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _problem(40)
    narrow = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=False)
    plain = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=WIDE_DOWN_TILE, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=WIDE_DOWN_TILE)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, narrow) and torch.equal(lean, narrow)
    assert rel_l2(plain, _f64(x, q, ids, weights)) < 2e-2
    down_launches = [bound for _, bound, _ in fake_gemms["fp8"].log if not bound["GATED"]]
    assert {b["WIDE"] for b in down_launches} == {False, True}
    wide = [b for b in down_launches if b["WIDE"]]
    assert all(b["num_col_blocks"] == K // 256 and b["gate_offset"] == 128 for b in wide)


def _dummies(cols: int):
    t = torch.zeros(256, 256)
    return t, t, t, t, torch.zeros(256, cols), None, t, t


@pytest.mark.parametrize("tile, gated, cols, what", [
    (WIDE_DOWN_TILE, True, 256, "gated=True"),
    (WIDE_DOWN_TILE, False, 384, "got 384"),
    (Fp8GluonTile(wide=True, pingpong=True), False, 256, "got 256"),
    (Fp8GluonTile(wide=True, stagger=True), False, 256, "got 256"),
])
def test_wide_tiles_are_refused_where_they_do_not_fit(tile, gated, cols, what):
    with pytest.raises(ValueError, match=f"wide tiles are for the down GEMM alone.*{what}"):
        launch_gemm_fp8(*_dummies(cols), tile=tile, gated=gated, gate_offset=128)


def test_wide_tile_fits_shared_memory():
    """3 stages of two 64-row A halves (e4m3) and two weight tiles, four [64, 128] bf16 output buffers."""
    stage = 2 * 64 * 128 + 2 * 128 * 128
    assert WIDE_DOWN_TILE.stages * stage + 4 * 64 * 128 * 2 <= 227 * 1024
    assert WIDE_DOWN_TILE.block_n == 256 and DOWN_TILE.block_n == 128
