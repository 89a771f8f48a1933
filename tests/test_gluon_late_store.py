"""The bf16 Gluon GEMMs' late store (``GluonTile.late_store``: each tile's product stored under the next tile's first
MMAs) on the CPU: its refusal, its fit, and its wiring: the plain and lean launches hand the gate-up (plain or
gathering) and down kernels LATE_STORE where the tile asks and only there, with outputs equal to the plain tiles' and
to a float64 loop (the kernels run as torch stand-ins, ``_gluon_fakes``: Gluon does not run in the interpreter; the
kernels themselves are checked on the H200 by ``benchmarks/prefill6_device_check.py`` and compiled for sm_90 by
``prefill6_compile_cpu.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_launch import NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile, late_store_arg

E, N, K, M, TOP_K = 4, 128, 256, 60, 2


def test_late_store_is_refused_with_a_tail_and_passes_the_constexpr_only_where_asked():
    with pytest.raises(ValueError, match="late_store"):
        GluonTile(tail=64, late_store=True)
    late = replace(NARROW_DOWN_TILE, late_store=True)
    # the kept product is bf16 registers, not a float32 accumulator, and no SMEM: the fit checks are the plain tile's
    assert late.accumulator_registers(gated=False) == NARROW_DOWN_TILE.accumulator_registers(gated=False)
    assert late.shared_bytes(gated=False) == NARROW_DOWN_TILE.shared_bytes(gated=False)
    check_tile(late, gated=False)
    check_tile(replace(UP_TILE, late_store=True), gated=True)
    assert late_store_arg(late) == {"LATE_STORE": True}
    assert late_store_arg(NARROW_DOWN_TILE) == {}  # the kernels' default: the launches stay what they were


def _problem():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    ids = torch.rand(M, E, generator=g).topk(TOP_K, dim=1).indices.int()
    return x, w13, w2, ids, torch.softmax(torch.rand(M, TOP_K, generator=g), dim=1)


def _f64(x, w13, w2, ids, weights):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate_up[:N]) * gate_up[N:]))
    return out


@pytest.mark.parametrize("up_late, down_late", [(False, True), (True, False), (True, True)])
def test_lean_and_plain_launches_pass_late_store_where_the_tiles_ask(fake_gemms, up_late, down_late):
    from moekit.experts.triton_gluon_launch import launch_gemm
    from moekit.experts.triton_gluon_lean import run_lean

    x, w13, w2, ids, weights = _problem()
    up, down = replace(UP_TILE, late_store=up_late), replace(NARROW_DOWN_TILE, late_store=down_late)
    plain_out = run_lean(x, w13, w2, ids, weights, None, UP_TILE, NARROW_DOWN_TILE)
    for fake in fake_gemms.values():
        fake.log.clear()
    for _ in range(2):  # the compiling call, then the recorded sequence
        out = run_lean(x, w13, w2, ids, weights, None, up, down)
        assert torch.equal(out, plain_out)
    assert rel_l2(out.double(), _f64(x, w13, w2, ids, weights)) < 1e-2
    # N = 128: the gate-up GEMM gathers in its loader ("gather"), the down GEMM is the plain kernel ("bf16")
    assert [bound["LATE_STORE"] for _, bound, _ in fake_gemms["gather"].log] == [up_late] * 2
    assert [bound["LATE_STORE"] for _, bound, _ in fake_gemms["bf16"].log] == [down_late] * 2
    fake_gemms["bf16"].log.clear()
    h, y = torch.zeros(256, N, dtype=x.dtype), torch.zeros(256, K, dtype=x.dtype)
    experts, used = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([256], dtype=torch.int32)
    launch_gemm(h, w2.view(E * K, N), y, experts, used, down, gated=False, w_rows=K)
    launch_gemm(y, w13.view(E * 2 * N, K), h, experts, used, up, gated=True, w_rows=2 * N, gate_offset=N)
    assert [bound["LATE_STORE"] for _, bound, _ in fake_gemms["bf16"].log] == [down_late, up_late]
