"""The fp8 Gluon down GEMM with the pipelined promotion (``Fp8GluonTile.pipelined``, the kernel's PIPE) on the CPU: the
tile reaches the plain and the lean launches, with the GEMMs as torch stand-ins
(``_gluon_fakes.fp8_gemm``) equal to the default tiles bit for bit and to the recipe in float64; the wide tile's
and the gate-up's refusals; the plan takes the pipelined down tile at the measured shape and rows, never for an
odd count of down K-steps (the route falls back to the waited loop).
The kernel itself (Gluon, sm_90 only): compiled offline by ``benchmarks/gluon_fp8_compile_cpu.py``; sessions 31 / 32 ran
it on the H200 in ``f8pp_device_check.py`` / ``f8r32_device_check.py`` (removed: ``git show
87f368f6:benchmarks/f8r32_device_check.py``)."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import block_experts, emulation_f64
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
    q = block_experts(g, E, N, K)
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    return x, q, ids, torch.rand(m, k, generator=g)


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


@pytest.mark.parametrize("num_tokens, inter, down_pipelined", [
    (1024, 14336, True), (2047, 14336, True),  # Mixtral-8x7B: 256-511 rows an expert, 112 down K-steps
    (512, 14336, False), (2048, 14336, False), (16384, 14336, False),  # 128, 512, 4096 (the wide down tile)
    (1024, 14464, False), (1024, None, False),  # another N; N not known
])
def test_the_plan_pipelines_the_down_gemm_at_the_measured_shape_and_rows(num_tokens, inter, down_pipelined):
    plan = plan_gluon_fp8(num_tokens, 2, 8, 4096, inter=inter)
    assert plan.down.pipelined == down_pipelined and not plan.up.pipelined
    assert plan.down.wide == (num_tokens >= 16384)
    given = plan_gluon_fp8(num_tokens, 2, 8, 4096, down=DOWN_TILE, inter=inter)  # a given tile replaces alone
    assert given.down == DOWN_TILE and given.up == plan.up


@pytest.mark.parametrize("inter, down_pipelined", [(256, True), (384, False)])  # 2 down K-steps; 3: an odd last one
def test_the_route_falls_back_to_the_waited_down_gemm_for_an_odd_k_step_count(fake_gemms, monkeypatch, inter,
                                                                              down_pipelined):
    import moekit.experts.triton_gluon_fp8_launch as launch
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    monkeypatch.setattr(launch, "PIPE_DOWN_SHAPES", ((E, K, inter),))
    monkeypatch.setattr(launch, "PIPE_DOWN_ROWS", (1, 10**6))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, K, generator=g).bfloat16()
    q = block_experts(g, E, inter, K)
    ids = torch.rand(40, E, generator=g).topk(2, dim=1).indices.int()
    weights = torch.rand(40, 2, generator=g)
    out = experts_gluon_fp8(x, *q, ids, weights)  # the plan's tiles, lean launch
    assert rel_l2(out, emulation_f64(x, *q, ids, weights, (128, 128))) < 2e-2
    assert [b["PIPE"] for _, b, _ in fake_gemms["fp8"].log if not b["GATED"]] == [down_pipelined]
