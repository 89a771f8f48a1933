"""The fp8 Gluon GEMM's SKIP_PADDING on the CPU (issue 15/19's ridge): the gather-quantize kernel marks padding rows
with a zero scale (interpreted), the tile refuses it with the consumers' turn-taking, and a whole call with it
through the plain launches and the torch stand-in kernels (``_gluon_fakes``, which skip what the kernel skips)
equals the call without it and a float64 loop. The Gluon kernel itself: compiled for sm_90 by
``benchmarks/gluon_fp8_compile_cpu.py``, checked on the H200 by ``benchmarks/ridge_device_check.py``."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, gluon_fp8_layout
from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, Fp8GluonTile
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


def test_padding_rows_get_a_zero_scale_and_real_rows_a_positive_one():
    x, _, ids, _ = _problem(m=37, seed=4)
    x[5] = 0  # a zero row: its scale is 1, not 0
    lay = gluon_fp8_layout(x, ids, E, align=align_block)
    real = torch.zeros(lay.x_q.shape[0], dtype=torch.bool)
    real[lay.src_to_dst.reshape(-1).long()] = True
    used = int(lay.rows_used)
    assert (lay.x_s[:used][real[:used]] > 0).all()
    assert (lay.x_s[:used][~real[:used]] == 0).all()
    assert (~real[:used]).any()  # the routing leaves padding to skip


def test_skip_padding_is_refused_with_turn_taking():
    with pytest.raises(ValueError, match="skip_padding"):
        Fp8GluonTile(skip_padding=True, pingpong=True)
    with pytest.raises(ValueError, match="skip_padding"):
        Fp8GluonTile(skip_padding=True, stagger=True)


@pytest.mark.parametrize("m", [20, 70])
def test_a_call_that_skips_padding_halves_equals_one_that_does_not(fake_gemms, m):
    """m = 20: every expert's block is 10 real rows (its second half all padding); 70: 35 a block."""
    x, q, ids, weights = _problem(m)
    up, down = UP_TILE, DOWN_TILE
    plain = experts_gluon_fp8(x, *q, ids, weights, up=up, down=down, lean=False)
    skip = experts_gluon_fp8(x, *q, ids, weights, up=Fp8GluonTile(stages=up.stages, skip_padding=True),
                             down=Fp8GluonTile(stages=down.stages, skip_padding=True), lean=False)
    assert torch.equal(skip, plain)
    ref = _reference_f64(x, q, ids, weights)
    assert ((skip.double() - ref).norm() / ref.norm()).item() < 5e-2
    flags = [bound.get("SKIP_PADDING") for _grid, bound, _options in fake_gemms["fp8"].log]
    assert flags == [False, False, True, True]
