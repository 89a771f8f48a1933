"""The weight-only Gluon path's lean launch (``triton_gluon_wo_lean``) on the CPU: the alignment, gather and combine
kernels under Triton's interpreter, the Gluon GEMM as its torch stand-in (``_gluon_fakes.wo_gemm``). The lean launch
hands every kernel what the plain launch hands it (outputs equal bit for bit, the GEMMs' arguments equal), with an
expert map, above the pool's size (the branch a CUDA graph capture takes), through the ``triton`` backend's fast path
on QuantizedWeights; what it keeps follows the scales (an in-place update: the same launches, the new values; a new
tensor: recorded again). The kernels themselves: ``benchmarks/wolean_device_check.py``."""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from test_triton_gluon_wo import E, K, N, _call, _f64, _rel, _weights
from moekit.experts.triton_gluon_wo import run_experts_wo_gluon
from moekit.experts.triton_wo import WoWeight

SCHEMES = ["int8_w8a16", "int4_w4a16", "mxfp4"]


def _lean():
    from moekit.experts import triton_gluon_wo_lean

    return triton_gluon_wo_lean


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [40, 300])  # blocks part full; an expert over two 128-row blocks
def test_lean_equals_plain_and_a_float64_loop(fake_gemms, launched, scheme, m):
    w13, w2 = _weights(scheme)
    x, ids, weights = _call(m)
    plain = run_experts_wo_gluon(x, w13, w2, ids, weights, None, scheme, lean=False)
    first = run_experts_wo_gluon(x, w13, w2, ids, weights, None, scheme)  # compiles: the bound launches
    again = run_experts_wo_gluon(x, w13, w2, ids, weights, None, scheme)  # the recorded sequence
    assert launched[0] == 1
    assert torch.equal(first, plain) and torch.equal(again, plain)
    assert _rel(again, _f64(x, w13, w2, ids, weights)) < 2e-2
    x2, ids2, weights2 = _call(m, seed=7)  # new call tensors through the same sequence
    assert torch.equal(run_experts_wo_gluon(x2, w13, w2, ids2, weights2, None, scheme),
                       run_experts_wo_gluon(x2, w13, w2, ids2, weights2, None, scheme, lean=False))
    assert launched[0] == 2


def test_expert_map_skips_other_ranks_experts(fake_gemms, launched):
    w13, w2 = _weights("int4_w4a16")
    x, _, weights = _call(30)
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1, -1], dtype=torch.int32)  # 8 global experts, 4 here
    ids = torch.rand(30, 8, generator=torch.Generator().manual_seed(9)).topk(2, dim=1).indices.int()
    outs = [run_experts_wo_gluon(x, w13, w2, ids, weights, expert_map, "int4_w4a16", lean=lean)
            for lean in (False, True, True)]
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0]) and launched[0] == 1
    local = expert_map[ids.long()]
    kept = local >= 0  # the float64 loop over the slots routed here, their local experts
    ref = _f64(x, w13, w2, torch.where(kept, local, 0), weights * kept)
    assert _rel(outs[2], ref) < 2e-2


def _geometry(log) -> list:
    """Each logged launch as what it must equal between the plain and the lean launch: grid, the arguments (a
    descriptor: its shape, strides, block, dtype and layout; a tensor: dtype and shape), the compile options."""
    def arg(v):
        if hasattr(v, "block_shape"):
            return ("desc", tuple(v.shape), tuple(v.strides), tuple(v.block_shape), v.base.dtype, repr(v.layout))
        return ("tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v

    return [(grid, {k: arg(v) for k, v in bound.items()}, options) for grid, bound, options in log]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gemm_arguments_equal_the_plain_launches(fake_gemms, scheme):
    """Each GEMM launch gets the plain launch's grid, scalars, constexprs, options and descriptor geometry: on the
    compiling call, and (but for the options, fixed by the compile) from the recorded sequence."""
    w13, w2 = _weights(scheme)
    x, ids, weights = _call(40)
    log = fake_gemms["wo"].log
    logs = []
    for lean in (False, True, True):
        log.clear()
        run_experts_wo_gluon(x, w13, w2, ids, weights, None, scheme, lean=lean)
        logs.append(_geometry(log))
    assert len(logs[0]) == 2 and logs[1] == logs[0]
    assert [entry[:2] for entry in logs[2]] == [entry[:2] for entry in logs[0]]


def test_above_the_pool_size_fresh_buffers_give_the_same_output(fake_gemms, launched, monkeypatch):
    """Above the pool's size (and while a CUDA graph captures) the bound launches run on fresh regions with their
    descriptors built per call: the same output; the backend keeps no entry (its regions would be per call)."""
    from moekit.experts.triton_gluon_lean import _WORKSPACES
    from moekit.experts.triton_wo import weight_args

    monkeypatch.setattr(_WORKSPACES, "max_bytes", 1024)
    w13, w2 = _weights("mxfp4")
    x, ids, weights = _call(40)
    plain = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "mxfp4", lean=False)
    for _ in range(2):
        assert torch.equal(run_experts_wo_gluon(x, w13, w2, ids, weights, None, "mxfp4"), plain)
    assert launched[0] == 0
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    assert _lean().wo_gluon_lean_inputs(x, a13, a2, ids, weights, "mxfp4") is None


def test_scales_updated_in_place_or_replaced(fake_gemms, launched):
    """An in-place update of a scale keeps the sequence (addresses) and the output follows the values; a new scale
    tensor gets a sequence of its own, never the old addresses."""
    w13, w2 = _weights("int4_w4a16")
    x, ids, weights = _call(40)
    run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16")
    run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16")
    w2.scale.mul_(3)
    updated = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16")
    assert launched[0] == 2 and torch.equal(updated, run_experts_wo_gluon(x, w13, w2, ids, weights, None,
                                                                          "int4_w4a16", lean=False))
    assert _rel(updated, _f64(x, w13, w2, ids, weights)) < 2e-2
    w2_new = WoWeight(w2.scheme, w2.q, w2.scale / 3, w2.zero, w2.group_size)  # same q, a new scale tensor
    sequences = len(_lean()._SEQUENCES)
    replaced = run_experts_wo_gluon(x, w13, w2_new, ids, weights, None, "int4_w4a16")
    assert len(_lean()._SEQUENCES) == sequences + 1
    assert torch.equal(replaced, run_experts_wo_gluon(x, w13, w2_new, ids, weights, None, "int4_w4a16", lean=False))
    assert _rel(replaced, _f64(x, w13, w2_new, ids, weights)) < 2e-2


def test_one_plan_and_one_sequence_a_kind(fake_gemms):
    """Host-only: repeated calls of one kind share one plan, the weights' descriptors and one sequence (the
    alignment's one launch below 128 assignments, gather, gate-up, down, combine); another M is another plan."""
    from moekit.experts.triton_gluon_lean import _PLANS

    lean = _lean()
    w13, w2 = _weights("int8_w8a16")
    for m in (40, 40, 40, 41):
        x, ids, weights = _call(m)
        run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16")
    plans = [p for p in _PLANS.values() if isinstance(p, lean.WoLeanPlan)]
    assert len(plans) == 2
    (sequence,) = [s for key, s in lean._SEQUENCES.items() if key[0] is plans[0]]
    assert len(sequence.steps) == 5  # A = 80 < 128: one alignment launch
    assert len(lean._DESCRIPTORS) == 1


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16"])
def test_backend_repeated_calls_launch_from_its_kept_entry(fake_gemms, monkeypatch, scheme):
    """The ``triton`` backend on QuantizedWeights at a measured cell: the first call runs the custom op (the lean
    plan's launches compile), the next ones launch from ``triton_quant_fast``'s entry, recorded over the Gluon
    path's plan: equal to the plain launch and to a float64 loop."""
    import moekit.experts.triton_gluon_wo as tgw
    import moekit.experts.triton_quant_fast as tqf
    from moekit.experts.triton import experts_triton_unchecked
    from moekit.experts.triton_quant import _wo
    from moekit.quant import quantize

    g = torch.Generator().manual_seed(4)
    w13 = quantize(torch.randn(E, 2 * N, K, generator=g) * K**-0.5, scheme)
    w2 = quantize(torch.randn(E, K, N, generator=g) * N**-0.5, scheme)
    x, ids, weights = _call(600)
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS", {(scheme, E, N, K): (600, 601)})
    hits, real = [0], tqf._launch

    def counted(*args):
        hits[0] += 1
        return real(*args)

    monkeypatch.setattr(tqf, "_launch", counted)
    plain = run_experts_wo_gluon(x, _wo(w13), _wo(w2), ids, weights, None, scheme, lean=False)
    outs = [experts_triton_unchecked(x, w13, w2, ids, weights) for _ in range(3)]
    assert hits[0] == 2 and len(fake_gemms["wo"].log) == 2 * 4  # plain, then the three calls: two GEMMs each
    assert all(torch.equal(out, plain) for out in outs)
    assert _rel(outs[-1], _f64(x, _wo(w13), _wo(w2), ids, weights)) < 2e-2
