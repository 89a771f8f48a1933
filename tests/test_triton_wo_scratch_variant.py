"""Expert biases and the activation variant (gpt-oss as it ships) on the weight-only "scratch" decode
(``triton_wo_scratch``: each chunk of experts dequantized once, then the bf16 GEMMs, which add the chunk's bias rows
and read the interleaved gate/up rows from the scratch as stored), on the CPU under Triton's interpreter, tiny shapes.

Chain: the decode with b13 + b2 + the spec, and each alone, against a float64 per-token loop (``_helpers.experts_loop``,
its glu written out) over weights decoded by ``test_triton_wo``'s hand dequantizer (int8 / int4 / mxfp4); in chunks of
experts (``SCRATCH_MAX_BYTES`` lowered) with an expert map; two calls of one kind with other biases (no stale bias
pointer); the route: a call with biases or the spec takes the scratch decode where a plain call would
(``SCRATCH_MIN_TOKENS`` lowered), a fused variant decode below it, and from a measured shape's M
(``VARIANT_SCRATCH_FROM``) for variant calls only. "gluon" still refused for a variant:
``test_triton_wo_variant``; the lean form of a variant call: ``test_triton_wo_scratch_lean``.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_wo import POISON, problem, rel, wo  # noqa: E402, F401  (wo: fixture)
from test_triton_wo_variant import GPT_OSS, PARTS, SCHEMES, SPEC, _biases, _loop  # noqa: E402


def _args(wo, w13, w2):
    return [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]


def _scaled_biases(x, w13, w2, ids, weights, e: int, n: int, hidden: int, seed: int):
    """b13 [E, 2N] ~ N(0, 1), b2 [E, K] the size of the plain output (mxfp4's here is ~100)."""
    plain = _loop(x, w13, w2, ids, weights, None, None, "silu")
    b13, b2 = _biases(e, n, hidden, seed)
    return b13, b2 * plain.pow(2).mean().sqrt().float()


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("parts", list(PARTS))
def test_scratch_decode_with_the_variant_matches_float64_loop(wo, scheme, group, parts):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=96, n=64, seed=3)
    with_b13, with_b2, spec = PARTS[parts]
    b13, b2 = _scaled_biases(x, w13, w2, ids, weights, 4, 64, 96, 9)
    b13, b2 = (b13 if with_b13 else None), (b2 if with_b2 else None)
    out = wo.run_experts_wo(x, *_args(wo, w13, w2), ids, weights, None, scheme, spec, options=POISON, decode="scratch",
                            b13=b13, b2=b2)
    want = _loop(x, w13, w2, ids, weights, b13, b2, spec)
    assert rel(out, want) < 1e-3  # fp16 in and out (float32 scratch and dots under the interpreter)
    assert rel(want, _loop(x, w13, w2, ids, weights, None, None, "silu")) > 0.05  # the variant shows


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("per_chunk", [1, 3])
def test_chunks_with_an_expert_map_take_their_bias_rows(wo, scheme, group, per_chunk, monkeypatch):
    # 8 global experts, 5 here in a shuffled order; chunks of 1 or 3 experts: chunk c's GEMMs index b13 / b2 by the
    # expert's index in the chunk, so each must get rows [expert0, expert0 + c) of the local biases
    import moekit.experts.triton_wo_scratch as scratch

    e, n, hidden = 5, 32, 64
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=9, k=2, e=8, hidden=hidden, n=n, seed=per_chunk)
    w13, w2 = (type(w)(w.scheme, w.q[:e], w.scale[:e], None if w.zero is None else w.zero[:e], w.group_size)
               for w in (w13, w2))
    expert_map = torch.tensor([3, -1, 0, 4, -1, 1, 2, -1], dtype=torch.int32)
    monkeypatch.setattr(scratch, "SCRATCH_MAX_BYTES", per_chunk * 2 * n * hidden * 4)  # float32 scratch
    assert scratch.scratch_chunking(x, e, n, hidden)[0] == per_chunk
    b13, b2 = _biases(e, n, hidden, 7)
    out = wo.run_experts_wo(x, *_args(wo, w13, w2), ids, weights, expert_map, scheme, GPT_OSS, options=POISON,
                            decode="scratch", b13=b13, b2=b2)
    local = expert_map[ids.long()]  # [M, k]: -1 for the experts not here
    from _helpers import experts_loop
    from test_triton_wo import dequant64

    want = experts_loop(x, dequant64(w13, hidden), dequant64(w2, n), ids, weights, expert_map, b13=b13, b2=b2,
                        spec=GPT_OSS)
    assert (local < 0).any() and (local >= 0).any()
    assert rel(out, want) < 1e-3


def test_two_calls_of_one_kind_with_other_biases(wo):
    # the same shapes, dtypes and alignment: one scratch plan and one bf16 plan per chunk; each call's biases are its
    # own pointers (a kept plan never runs with another call's), and a call without biases is a kind of its own
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=6, k=2, hidden=96, n=64, seed=4)
    args = _args(wo, w13, w2)
    for seed in (1, 2):
        b13, b2 = _biases(4, 64, 96, seed)
        out = wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", GPT_OSS, options=POISON, decode="scratch",
                                b13=b13, b2=b2)
        assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, GPT_OSS)) < 1e-3
    out = wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", GPT_OSS, options=POISON, decode="scratch")
    assert rel(out, _loop(x, w13, w2, ids, weights, None, None, GPT_OSS)) < 1e-3


def test_a_float64_bias_is_added_in_float32(wo):
    # the weight-only contract takes any float bias; the bf16 kernels take 16/32-bit ones: float64 goes as float32
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=4, k=2, hidden=96, n=64, seed=6)
    b13, b2 = (b.double() for b in _biases(4, 64, 96, 3))
    out = wo.run_experts_wo(x, *_args(wo, w13, w2), ids, weights, None, "mxfp4", SPEC, options=POISON,
                            decode="scratch", b13=b13, b2=b2 * 10)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2 * 10, SPEC)) < 1e-3


@pytest.mark.parametrize("biased", [True, False])
def test_route_takes_scratch_for_a_variant_call_where_a_plain_one_would(wo, biased, monkeypatch):
    """fused_experts_wo (the op, the chooser's decode) with gpt-oss's spec (and biases): from SCRATCH_MIN_TOKENS
    (lowered to 6 here) the scratch decode runs, below it a fused variant decode; both against the loop."""
    import moekit.experts.triton_wo_plan as plans
    import moekit.experts.triton_wo_winners as winners

    calls = []
    real = wo.run_experts_wo_scratch
    monkeypatch.setattr(winners, "WO_WINNERS", {})  # the threshold rule alone
    plans.chosen_decode.cache_clear()
    monkeypatch.setattr(plans, "SCRATCH_MIN_TOKENS", 6)
    monkeypatch.setattr(wo, "SCRATCH_MIN_TOKENS", 6)
    monkeypatch.setattr(wo, "run_experts_wo_scratch", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (5, 6):
        x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=m, k=2, hidden=96, n=64, seed=m)
        b13, b2 = _biases(4, 64, 96, m) if biased else (None, None)
        out = wo.fused_experts_wo(x, w13, w2, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
        assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, GPT_OSS)) < 1e-3
    plans.chosen_decode.cache_clear()
    assert calls == [6]



def test_a_measured_shape_takes_scratch_from_its_m_for_variant_calls_only(wo, monkeypatch):
    """VARIANT_SCRATCH_FROM (here this tiny shape from M = 6; SCRATCH_MIN_TOKENS as shipped): a call with gpt-oss's spec
    and biases of M = 6 runs the scratch decode, of M = 5 a fused one, a plain call of M = 6 a fused one too; each
    equals the loop."""
    import moekit.experts.triton_wo_scratch as scratch

    calls = []
    real = wo.run_experts_wo_scratch
    monkeypatch.setattr(scratch, "VARIANT_SCRATCH_FROM", {("mxfp4", 4, 64, 96): 6})
    monkeypatch.setattr(wo, "MIN_M", 2)  # the route's cheap test: no scratch below min(4096, MIN_M / 2) tokens
    monkeypatch.setattr(wo, "run_experts_wo_scratch", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m, variant in ((5, True), (6, True), (6, False)):
        x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=m, k=2, hidden=96, n=64, seed=m)
        b13, b2 = _biases(4, 64, 96, m) if variant else (None, None)
        spec = GPT_OSS if variant else "silu"
        out = wo.fused_experts_wo(x, w13, w2, ids, weights, activation=spec, b13=b13, b2=b2)
        assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, spec)) < 1e-3
    assert calls == [6]


def test_gpt_oss_20b_variant_calls_take_scratch_from_1024():
    # the H100's measured rows (scr39_device_check): mxfp4 / int4 from 1024; int8 and gpt-oss-120b (E = 128) unmeasured
    from moekit.experts.triton_wo_scratch import variant_takes_scratch

    for scheme in ("mxfp4", "int4_w4a16"):
        assert variant_takes_scratch(scheme, 1024, 32, 2880, 2880, 2)
        assert not variant_takes_scratch(scheme, 1023, 32, 2880, 2880, 2)
        assert not variant_takes_scratch(scheme, 1024, 128, 2880, 2880, 2)
    assert not variant_takes_scratch("int8_w8a16", 1024, 32, 2880, 2880, 2)
    # the route's cheap test skips every call below MIN_M / 2 tokens: no row may start there
    from moekit.experts.triton_wo_scratch import VARIANT_SCRATCH_FROM
    from moekit.experts.triton_wo_winners import MIN_M

    assert min(VARIANT_SCRATCH_FROM.values()) >= MIN_M // 2
