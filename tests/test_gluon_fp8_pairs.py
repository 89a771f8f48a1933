"""The fp8 Gluon gate-up GEMM in two pipelined passes (``Fp8GluonTile.pairs``, the kernel's PAIRS) on the CPU: the
option reaches the plain and the lean launches with its [64, 128] weight boxes, with the GEMMs as torch stand-ins
(``_gluon_fakes.fp8_gemm``) equal to the default tiles bit for bit and to the recipe in float64; the tiles it refuses;
no plan takes it. The kernel itself (Gluon, sm_90 only): ``benchmarks/f8r32_device_check.py`` on the H200, compiled
offline by ``benchmarks/gluon_fp8_compile_cpu.py`` (no spills, 48 wgmmas: none merged)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _fp8_cases import emulation_f64, quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    DOWN_TILE, PAIRS_UP_TILE, PIPELINED_DOWN_TILE, UP_TILE, launch_gemm_fp8, plan_gluon_fp8,
)

E, N, K = 4, 256, 384  # 3 K-steps of 128: a pair and an odd last step in each pass


def _problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    q13 = quantize_weight(torch.randn(E, 2 * N, K, generator=g) / K**0.5, (128, 128))
    q2 = quantize_weight(torch.randn(E, K, N, generator=g) / N**0.5, (128, 128))
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    return x, (*q13, *q2), ids, torch.rand(m, k, generator=g)


@pytest.mark.parametrize("up, down", [(PAIRS_UP_TILE, DOWN_TILE), (PAIRS_UP_TILE, PIPELINED_DOWN_TILE),
                                      (replace(PAIRS_UP_TILE, skip=True), DOWN_TILE)])
def test_pairs_tile_reaches_both_launches_and_equals_the_recipe(fake_gemms, up, down):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _problem(40)
    default = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=False)
    plain = experts_gluon_fp8(x, *q, ids, weights, up=up, down=down, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, up=up, down=down)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, default) and torch.equal(lean, default)
    assert rel_l2(plain, emulation_f64(x, *q, ids, weights, (128, 128))) < 2e-2
    ups = [b for _, b, _ in fake_gemms["fp8"].log if b["GATED"]]
    assert [b["PAIRS"] for b in ups] == [False, True, True]  # default, plain, lean
    assert [list(b["w_desc"].block_shape) for b in ups] == [[128, 128], [64, 128], [64, 128]]
    assert all(list(b["w_desc"].block_shape) == [128, 128] for _, b, _ in fake_gemms["fp8"].log if not b["GATED"])


def _dummies():
    t = torch.zeros(256, 256)
    return t, t, t, t, torch.zeros(256, 256), None, t, t


@pytest.mark.parametrize("tile, gated", [(PAIRS_UP_TILE, False), (replace(PAIRS_UP_TILE, pipelined=True), True),
                                         (replace(PAIRS_UP_TILE, wide=True), True)])
def test_pairs_is_the_gate_up_tile_alone(tile, gated):
    with pytest.raises(ValueError, match="pairs is the gate-up GEMM's own pipeline"):
        launch_gemm_fp8(*_dummies(), tile=tile, gated=gated)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden", [
    (512, 2, 8, 4096), (1024, 2, 8, 4096), (4096, 8, 256, 7168), (16384, 2, 8, 4096),
])
def test_no_plan_takes_the_pairs_tile(num_tokens, top_k, num_experts, hidden):
    assert not plan_gluon_fp8(num_tokens, top_k, num_experts, hidden).up.pairs
