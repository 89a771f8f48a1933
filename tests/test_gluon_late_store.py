"""The bf16 Gluon down GEMM's late store (``GluonTile.late_store``: each tile's product stored under the next tile's
first MMAs) on the CPU: its refusals, its register count, and its wiring: the plain and lean launches hand the kernel
LATE_STORE (and only where the tile asks), with outputs equal to the plain tile's and to a float64 loop (the kernel
runs as a torch stand-in, ``_gluon_fakes``: Gluon does not run in the interpreter; the kernel itself is checked on
the H200 by ``benchmarks/prefill6_device_check.py`` and compiled for sm_90 by ``prefill6_compile_cpu.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_launch import NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile, late_store_arg

E, N, K, M, TOP_K = 4, 128, 256, 60, 2


def test_late_store_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="late_store"):
        GluonTile(tail=64, late_store=True)
    late = GluonTile(late_store=True)
    with pytest.raises(ValueError, match="down GEMM only"):
        check_tile(late, gated=True)
    with pytest.raises(ValueError, match="down GEMM only"):
        late_store_arg(late, gated=True)
    wide = GluonTile(block_n=256, stages=3, late_store=True)  # two [128, 256] float32 products on 256 threads
    assert wide.accumulator_registers(gated=False) == 2 * 128 * 256 // 256
    with pytest.raises(ValueError, match="accumulator registers"):
        check_tile(wide, gated=False)


def test_late_store_counts_the_kept_product_and_only_it_passes_the_constexpr():
    late = replace(NARROW_DOWN_TILE, late_store=True)
    assert late.accumulator_registers(gated=False) == 2 * NARROW_DOWN_TILE.accumulator_registers(gated=False) == 128
    assert late.shared_bytes(gated=False) == NARROW_DOWN_TILE.shared_bytes(gated=False)  # registers, not SMEM
    check_tile(late, gated=False)
    assert late_store_arg(late, gated=False) == {"LATE_STORE": True}
    assert late_store_arg(NARROW_DOWN_TILE, gated=False) == {}  # the kernel's default: launches as before


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


def test_lean_and_plain_launches_pass_late_store_to_the_down_gemm(fake_gemms):
    from moekit.experts.triton_gluon_launch import launch_gemm
    from moekit.experts.triton_gluon_lean import run_lean

    x, w13, w2, ids, weights = _problem()
    late = replace(NARROW_DOWN_TILE, late_store=True)
    plain_out = run_lean(x, w13, w2, ids, weights, None, UP_TILE, NARROW_DOWN_TILE)
    fake_gemms["bf16"].log.clear()
    for _ in range(2):  # the compiling call, then the recorded sequence
        out = run_lean(x, w13, w2, ids, weights, None, UP_TILE, late)
        assert torch.equal(out, plain_out)
    assert rel_l2(out.double(), _f64(x, w13, w2, ids, weights)) < 1e-2
    assert [bound["LATE_STORE"] for _, bound, _ in fake_gemms["bf16"].log] == [True, True]  # down only: up gathers
    fake_gemms["bf16"].log.clear()
    h, y = torch.zeros(256, N, dtype=x.dtype), torch.zeros(256, K, dtype=x.dtype)
    experts, used = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([256], dtype=torch.int32)
    launch_gemm(h, w2.view(E * K, N), y, experts, used, late, gated=False, w_rows=K)
    launch_gemm(h, w2.view(E * K, N), y, experts, used, NARROW_DOWN_TILE, gated=False, w_rows=K)
    assert [bound["LATE_STORE"] for _, bound, _ in fake_gemms["bf16"].log] == [True, False]
    with pytest.raises(ValueError, match="down GEMM only"):
        launch_gemm(h, w13.view(E * 2 * N, K)[:, :N], h, experts, used, replace(UP_TILE, late_store=True), gated=True,
                    w_rows=2 * N, gate_offset=N)
