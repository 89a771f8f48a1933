"""The bf16 Gluon GEMM's SKIP_PADDING on the CPU (issue 19 at prefill: a row block whose lower 64 rows are all padding
runs 64-row MMAs): the tile's flag and the layout's sorted_ids reach both GEMMs through the plain and the lean
launches, and a call with it (torch stand-in kernels ``_gluon_fakes``, which then write the upper half only: a wrong
sorted_ids or assignment count would leave real rows unwritten) equals the call without it and a float64 loop.
The Gluon kernel itself: compiled for sm_90 by ``benchmarks/ridge_compile_cpu.py`` (its "g128 skip" tiles), checked
on the H200 against the twin by ``benchmarks/prefill_device_check.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, launch_gemm

E, N, K = 4, 128, 128


def _problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return x, w13, w2, ids, weights


def _f64(x, w13, w2, ids, weights):
    """out[t] = sum_j w[t, j] * w2[e] @ (silu(gate) * up), e = ids[t, j], in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate_up[:N]) * gate_up[N:]))
    return out


def _call(x, w13, w2, ids, weights, up, down, lean: bool) -> torch.Tensor:
    if lean:
        from moekit.experts.triton_gluon_lean import run_lean

        return run_lean(x, w13, w2, ids, weights, None, up, down)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from ridge_variants import gluon_bf16_call  # the plain launches with given tiles
    finally:
        sys.path.pop(0)
    return gluon_bf16_call(x, w13, w2, ids, weights, up, down)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("m", [20, 70, 150])
def test_a_call_that_skips_padding_halves_equals_one_that_does_not(fake_gemms, m, lean):
    """m = 20: every expert's block is 10 real rows (its lower half all padding); 70: 35; 150: 75 (a full upper
    half and 11 real rows in the lower one: not skipped)."""
    x, w13, w2, ids, weights = _problem(m)
    up, down = UP_TILE, down_tile(N)
    plain = _call(x, w13, w2, ids, weights, up, down, lean)
    fake_gemms["bf16"].log.clear()
    skip = _call(x, w13, w2, ids, weights, replace(up, skip_padding=True), replace(down, skip_padding=True), lean)
    assert torch.equal(skip, plain)
    assert rel_l2(skip, _f64(x, w13, w2, ids, weights)) < 2e-2
    log = fake_gemms["bf16"].log
    assert [bound["SKIP_PADDING"] for _grid, bound, _options in log] == [True, True]
    assert all(bound["num_assignments"] == ids.numel() for _grid, bound, _options in log)


def test_skip_padding_without_the_layouts_rows_is_refused():
    t = torch.zeros(1)
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm(t, t, t, t, t, replace(UP_TILE, skip_padding=True), True, 256, 128)
