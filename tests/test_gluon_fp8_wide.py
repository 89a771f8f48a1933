"""The fp8 Gluon down GEMM on [128, 256] tiles (``Fp8GluonTile.wide``) on the CPU: the plain and lean launches with
the GEMMs as torch stand-ins that address the weights tile by tile as the kernel does (``_gluon_fakes.fp8_gemm``:
a wrong column-block count or second-tile offset leaves NaN or wrong columns), against the [128, 128] tiles bit for
bit and a float64 loop; the refusals; where the plan takes it (``wants_wide_down``: from 4096 rows per expert, with
the 4-group gather) and the ``triton`` backend's call there. The kernel itself: session 27's
``f8pre_device_check.py`` on the H200 (removed: ``git show 87f368f6:benchmarks/f8pre_device_check.py``)."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import block_experts
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    DOWN_TILE, UP_TILE, WIDE_DOWN_TILE, launch_gemm_fp8, plan_gluon_fp8, wants_wide_down,
)

E, N, K = 4, 128, 512  # K = two 256-wide column blocks of the down GEMM


def _problem(m, k=2, seed=0, experts=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    q = block_experts(g, experts, N, K)
    ids = torch.rand(m, experts, generator=g).topk(k, dim=1).indices.int()
    return x, q, ids, torch.rand(m, k, generator=g)


def _e4m3_groups(v: torch.Tensor) -> torch.Tensor:
    """v [R, C] through e4m3 per row per 128 values (scale amax / 448, 1 for zeros), in float64."""
    g = v.double().view(v.shape[0], -1, 128)
    amax = g.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((g / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double() * s).view(v.shape)


def _f64(x, q, ids, weights):
    """Slot by slot, the tokens of one expert at a time: x and h through e4m3 per 128 columns, dequantized
    weights, y rounded to bf16, the weighted sum over the slots in order."""
    w13 = q[0].double() * q[1].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    w2 = q[2].double() * q[3].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = _e4m3_groups(x)  # [M, K]
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            tokens = (ids[:, j] == e).nonzero().squeeze(1)  # [n]
            gate_up = xq[tokens] @ w13[e].T  # [n, 2N]
            h = _e4m3_groups(torch.nn.functional.silu(gate_up[:, :N]) * gate_up[:, N:])
            out[tokens] += weights[tokens, j, None].double() * (h @ w2[e].T).bfloat16().double()
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
])
def test_wide_tiles_are_refused_where_they_do_not_fit(tile, gated, cols, what):
    with pytest.raises(ValueError, match=f"wide tiles are for the down GEMM alone.*{what}"):
        launch_gemm_fp8(*_dummies(cols), tile=tile, gated=gated, gate_offset=128)


def test_wide_tile_fits_shared_memory():
    """3 stages of two 64-row A halves (e4m3) and two weight tiles, four [64, 128] bf16 output buffers."""
    stage = 2 * 64 * 128 + 2 * 128 * 128
    assert WIDE_DOWN_TILE.stages * stage + 4 * 64 * 128 * 2 <= 227 * 1024
    assert WIDE_DOWN_TILE.block_n == 256 and DOWN_TILE.block_n == 128


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden, wide", [
    (4096, 1, 1, 4096, True),  # 4096 rows per expert
    (4095, 1, 1, 4096, False),
    (4095 * 4, 2, 8, 4096, False),  # 4095
    (16384, 2, 8, 4096, True),  # Mixtral-8x7B M = 16384
    (16384, 2, 8, 4096 + 128, False),  # K not a multiple of 256
    (16384, 8, 128, 2048, False),  # Qwen3-30B-A3B M = 16384: 1024 rows per expert
    (4096, 8, 256, 7168, False),  # DeepSeek-V3 M = 4096: 128
])
def test_plan_takes_the_wide_tile_and_four_groups_from_4096_rows_per_expert(num_tokens, top_k, num_experts, hidden,
                                                                            wide):
    assert wants_wide_down(num_tokens, top_k, num_experts, hidden) == wide
    plan = plan_gluon_fp8(num_tokens, top_k, num_experts, hidden)
    expected = (UP_TILE, WIDE_DOWN_TILE, 4) if wide else (UP_TILE, DOWN_TILE, 1)  # no N given: no pipelined down
    assert (plan.up, plan.down, plan.gather_groups) == expected
    given = plan_gluon_fp8(num_tokens, top_k, num_experts, hidden, down=DOWN_TILE)  # each given one replaces alone
    assert (given.down, given.gather_groups) == (DOWN_TILE, 4 if wide else 1)
    assert plan_gluon_fp8(num_tokens, top_k, num_experts, hidden, gather_groups=2).gather_groups == 2


def test_backend_call_at_4096_rows_per_expert_takes_the_wide_plan(fake_gemms, monkeypatch):
    """The ``triton`` backend on fp8_block weights at M * k / E = 4096: the lean plan's down GEMM wide, its gather
    one program column of 4 groups (K = 512), kept apart from the narrow plan's; equal to the narrow launch bit for
    bit and to the float64 loop."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_lean import _PLANS
    from moekit.quant.fp8_block import Fp8BlockWeight

    x, q, ids, weights = _problem(4096, experts=2)
    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", tgf.Fp8GluonChoice(min_flops=1, min_rows_per_expert=0))
    w13 = Fp8BlockWeight(q=q[0], scale=q[1], dtype=torch.bfloat16)
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], dtype=torch.bfloat16)
    routed = run_experts(x, w13, w2, ids, weights, backend="triton")
    (wide,) = _PLANS.values()
    assert wide.gather.grid[1] == 1  # 4 groups of 128 columns: one program column
    narrow = tgf.experts_gluon_fp8(x, *q, ids, weights, down=DOWN_TILE, gather_groups=1)
    assert len(_PLANS) == 2 and [p.gather.grid[1] for p in _PLANS.values()] == [1, 4]
    assert [b["WIDE"] for _, b, _ in fake_gemms["fp8"].log if not b["GATED"]] == [True, False]
    assert torch.equal(routed, narrow)
    assert rel_l2(routed, _f64(x, q, ids, weights)) < 2e-2


@pytest.mark.parametrize("groups", [0, 3, 6])
def test_gather_groups_not_a_power_of_two_is_refused(groups):
    from moekit.experts.triton_gluon_fp8_launch import plan_gluon_fp8

    with pytest.raises(ValueError, match="gather_groups"):
        plan_gluon_fp8(4096, 2, 8, 4096, gather_groups=groups)
    assert plan_gluon_fp8(4096, 2, 8, 4096, gather_groups=2).gather_groups == 2
