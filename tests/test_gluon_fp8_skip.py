"""The fp8 Gluon down GEMM's SKIP_PADDING on the CPU (issues 15 / 19 at prefill): the gather-quantize kernel marks
padding rows with a 0 x scale (interpreted), the gate-up GEMM passes the mark on as 0 h scales, the tile refuses the
skip with the consumers' turn-taking and on the gate-up GEMM, and a whole call whose down GEMM skips (plain and lean
launches, through the torch stand-in kernels ``_gluon_fakes``, which skip what the kernel skips) equals the call
without it and a float64 loop. The Gluon kernel itself: compiled for sm_90 by ``benchmarks/gluon_fp8_compile_cpu.py``
(``test_triton_gluon_fp8.test_gemm_compiles_for_sm90``), checked on the H200 by ``benchmarks/prefill_device_check.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _fp8_cases import quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, gluon_fp8_layout
from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, Fp8GluonTile, launch_gemm_fp8
from moekit.layouts.block_aligned import align_block

E, N, K = 4, 128, 256


def _problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    w13 = torch.randn(E, 2 * N, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, N, generator=g) / N**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).int()
    weights = torch.rand(m, k, generator=g)
    return x, (*quantize_weight(w13, (128, 128)), *quantize_weight(w2, (128, 128))), ids, weights


def _reference_f64(x, q, ids, weights):
    """Slot by slot in float64 on the dequantized weights (the activations unquantized: a looser bound)."""
    w13 = q[0].double() * q[1].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    w2 = q[2].double() * q[3].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate_up = w13[int(ids[t, j])] @ x[t].double()
            h = torch.nn.functional.silu(gate_up[:N]) * gate_up[N:]
            out[t] += float(weights[t, j]) * (w2[int(ids[t, j])] @ h)
    return out


def _real_rows(lay) -> torch.Tensor:
    """[R] bool: the layout's rows that hold an assignment."""
    real = torch.zeros(lay.x_q.shape[0], dtype=torch.bool)
    real[lay.src_to_dst.reshape(-1).long()] = True
    return real


def test_padding_rows_get_a_zero_scale_and_real_rows_a_positive_one():
    x, _, ids, _ = _problem(m=37, seed=4)
    x[5] = 0  # a zero row: its scale is 1, not 0
    lay = gluon_fp8_layout(x, ids, E, align=align_block)
    real, used = _real_rows(lay), int(lay.rows_used)
    assert (lay.x_s[:used][real[:used]] > 0).all()
    assert (lay.x_s[:used][~real[:used]] == 0).all()
    assert (~real[:used]).any()  # the routing leaves padding to skip


def test_the_gate_up_gemm_writes_zero_h_scales_on_padding_rows_only(fake_gemms):
    x, q, ids, _ = _problem(m=37, seed=4)
    lay = gluon_fp8_layout(x, ids, E, align=align_block)
    rows, used = lay.x_q.shape[0], int(lay.rows_used)
    h_q = torch.zeros(rows, N, dtype=torch.float8_e4m3fn)
    h_s = torch.full((rows, N // 128), -1.0)  # [R, N/128]; -1: not written
    launch_gemm_fp8(lay.x_q, lay.x_s, q[0], q[1], h_q, h_s, lay.block_experts, lay.rows_used, UP_TILE, True, N)
    real = _real_rows(lay)[:used]
    assert (h_s[:used][real] > 0).all()
    assert (h_s[:used][~real] == 0).all()


def test_skip_padding_is_refused_with_turn_taking_and_on_the_gate_up_gemm(fake_gemms):
    with pytest.raises(ValueError, match="skip_padding"):
        Fp8GluonTile(skip_padding=True, pingpong=True)
    with pytest.raises(ValueError, match="skip_padding"):
        Fp8GluonTile(skip_padding=True, stagger=True)
    x, q, ids, weights = _problem(8)
    with pytest.raises(ValueError, match="for the down GEMM only"):
        experts_gluon_fp8(x, *q, ids, weights, up=replace(UP_TILE, skip_padding=True), lean=False)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("m", [20, 70])
def test_a_call_whose_down_gemm_skips_padding_halves_equals_one_that_does_not(fake_gemms, m, lean):
    """m = 20: every expert's block is 10 real rows (its second half all padding); 70: 35 a block."""
    x, q, ids, weights = _problem(m)
    plain = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=lean)
    skip = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=replace(DOWN_TILE, skip_padding=True), lean=lean)
    assert torch.equal(skip, plain)
    ref = _reference_f64(x, q, ids, weights)
    assert ((skip.double() - ref).norm() / ref.norm()).item() < 5e-2
    flags = [bound.get("SKIP_PADDING", options.get("SKIP_PADDING"))
             for _grid, bound, options in fake_gemms["fp8"].log]
    assert flags[-2:] == [False, True]  # the skip call's gate-up and down GEMMs
