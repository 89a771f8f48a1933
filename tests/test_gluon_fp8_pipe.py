"""The fp8 Gluon down GEMM with the pipelined promotion (``Fp8GluonTile.pipelined``, the kernel's PIPE) on the CPU: the
tile reaches the plain and the lean launches, with the GEMMs as torch stand-ins
(``_gluon_fakes.fp8_gemm``) equal to the default tiles bit for bit and to the recipe in float64; the wide tile's
and the gate-up's refusals; the plan takes the pipelined down tile from 256 rows an expert (below the wide tile).
The kernel itself (Gluon, sm_90 only): ``benchmarks/f8pp_device_check.py`` / ``f8r32_device_check.py`` on the H200,
compiled offline by ``benchmarks/gluon_fp8_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import emulation_f64, quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    DOWN_TILE, PIPELINED_DOWN_TILE, UP_TILE, Fp8GluonTile, launch_gemm_fp8, plan_gluon_fp8,
)

E, N, K = 4, 384, 256  # the down GEMM: 3 K-steps of 128 (a pair and an odd last step in the kernel)


def _problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    q13 = quantize_weight(torch.randn(E, 2 * N, K, generator=g) / K**0.5, (128, 128))
    q2 = quantize_weight(torch.randn(E, K, N, generator=g) / N**0.5, (128, 128))
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    return x, (*q13, *q2), ids, torch.rand(m, k, generator=g)


def test_pipelined_down_tile_reaches_both_launches_and_equals_the_recipe(fake_gemms):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _problem(40)
    default = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=False)
    plain = experts_gluon_fp8(x, *q, ids, weights, down=PIPELINED_DOWN_TILE, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, down=PIPELINED_DOWN_TILE)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, default) and torch.equal(lean, default)
    assert rel_l2(plain, emulation_f64(x, *q, ids, weights, (128, 128))) < 2e-2
    launches = [bound for _, bound, _ in fake_gemms["fp8"].log]
    assert [b["PIPE"] for b in launches if b["GATED"]] == [False, False, False]  # default, plain, lean
    assert [b["PIPE"] for b in launches if not b["GATED"]] == [False, True, True]


def _dummies(cols: int):
    t = torch.zeros(256, 256)
    return t, t, t, t, torch.zeros(256, cols), None, t, t


@pytest.mark.parametrize("tile, gated", [(Fp8GluonTile(stages=3, wide=True, pipelined=True), False),
                                         (Fp8GluonTile(stages=3, pipelined=True), True)])
def test_pipelined_wide_or_gate_up_tile_is_refused(tile, gated):
    with pytest.raises(ValueError, match="pipelined promotion is for the narrow down GEMM alone"):
        launch_gemm_fp8(*_dummies(256), tile=tile, gated=gated)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden, down_pipelined", [
    (512, 2, 8, 4096, False), (1024, 2, 8, 4096, True), (4096, 8, 256, 7168, False), (8192, 2, 8, 4096, True),
    (16384, 2, 8, 4096, False),  # 128 rows an expert: no; 256 and 2048: yes; 4096: the wide down tile
])
def test_the_plan_pipelines_the_down_gemm_from_256_rows_an_expert(num_tokens, top_k, num_experts, hidden,
                                                                    down_pipelined):
    plan = plan_gluon_fp8(num_tokens, top_k, num_experts, hidden)
    assert plan.down.pipelined == down_pipelined and not plan.up.pipelined
    assert plan.down.wide == (num_tokens * top_k >= 4096 * num_experts)
    given = plan_gluon_fp8(num_tokens, top_k, num_experts, hidden, down=DOWN_TILE)  # a given tile replaces alone
    assert given.down == DOWN_TILE and given.up == plan.up
