"""Expert biases and the activation variant (gpt-oss as it ships: b13, b2, interleaved gate/up rows, its clamped SwiGLU)
on the weight-only word MMA decode (``decode="mma"``, ``_kernels/gemm_wo_mma.py``, session 40), on the CPU under
Triton's interpreter, tiny shapes.

Chain: the mma decode (and the gemv, ``test_triton_wo_gemv_variant``'s other tests) with b13 + b2 + the spec, and each
alone, int8 / int4 g128 / mxfp4, K and N with tail steps, against a float64 per-token loop (``_helpers.experts_loop``,
its glu written out) over weights decoded by the hand dequantizer of ``test_triton_wo``; the gate-up split along K (b13
in split 0's partials alone, the spec in the split_glu launch) and in halves (interleaved rows mapped to p's gate / up
columns); the down GEMM split along N with an expert map holding -1 (b2 once; the gemv too); a plain call's launches
keep the kernels' defaults; the route: a variant call takes the mma (or gemv) decode where a plain one of its shape and
M does, and its shape's ``VARIANT_DECODE_MEASURED`` entry first.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_wo import POISON, problem, rel, wo  # noqa: E402, F401  (wo: fixture)
from test_triton_wo_variant import (  # noqa: E402
    PARTS, SPEC, _biases, _loop, assert_variant, built_plans, run_variant, variant_problem,
)

from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 128), ("mxfp4", 32)]


def _config(rows: int = 32, block_k: int = 128, **word) -> KernelConfig:
    tile = GemmTile(rows, block_k, 1, 1, 1)
    return WordConfig(16, tile, tile, **word) if word else KernelConfig(16, tile, tile)


def _run(wo, *args, decode="mma", **kwargs):
    return run_variant(wo, decode, *args, **kwargs)


# the mma: every part x every scheme; the gemv (ten times the interpreter's work a case): b13 + b2 + the spec with
# every scheme's decode, and each part alone once (its epilogue, add_b13 / add_b2 / _glu, reads no weight: the scheme
# changes only the decoded values the parts are added to, which "all" checks for every scheme)
WORD_CASES = [("mma", parts, *scheme) for parts in PARTS for scheme in SCHEMES] + [
    ("gemv", "all", *scheme) for scheme in SCHEMES] + [
    ("gemv", "b13", *SCHEMES[0]), ("gemv", "b2", *SCHEMES[1]), ("gemv", "spec", *SCHEMES[2])]


@pytest.mark.parametrize("decode,parts,scheme,group", WORD_CASES)
def test_word_decodes_variant_matches_float64_loop(wo, scheme, group, parts, decode):
    # K = 200: a tail step (words, x and scales past the row load as 0); N = 64: half a down step; the mma in 16-row
    # blocks of 32 x 128 tiles, the gemv in its heuristic's 2-row blocks (M = 5, k = 2 of E = 4: aligned)
    x, w13, w2, ids, weights, b13, b2, spec = variant_problem(wo, scheme, group, parts, hidden=200)
    out = _run(wo, x, w13, w2, ids, weights, spec, b13, b2, _config() if decode == "mma" else None, decode=decode)
    assert_variant(out, x, w13, w2, ids, weights, b13, b2, spec)


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("word", [dict(up_split=2), dict(up_split=3), dict(halves=True),
                                  dict(halves=True, up_split=2)])
def test_mma_partial_gate_ups_take_b13_once_and_the_spec(wo, scheme, group, word):
    # K = 328: three 128-column steps (the last a tail) in 2 or 3 splits, or the gate and up rows in separate
    # programs (interleaved rows read as gate / up columns of p); the split_glu launch sums them and runs the spec
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=328, n=64, seed=7)
    b13, b2 = _biases(4, 64, 328, 8)
    out = _run(wo, x, w13, w2, ids, weights, SPEC, b13, b2, _config(**word))
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, SPEC)) < 1e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("decode", ["mma", "gemv"])
def test_word_decodes_split_down_with_expert_map_add_b2_once(wo, scheme, group, decode):
    # N = 384: three 128-wide steps (the gemv's int8: six of 64) in 3 splits of the down GEMM (split 0 alone adds b2);
    # global expert 2 lives elsewhere (-1 in the map): its slots add nothing, bias included
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=128, n=384, seed=43)
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    ids[0, 0] = 2
    b13, b2 = _biases(4, 384, 128, 44)
    out = _run(wo, x, w13, w2, ids, weights, SPEC, b13, b2, _config(rows=16) if decode == "mma" else None,
               expert_map=expert_map, split_k=3, decode=decode)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, SPEC, expert_map)) < 1e-3


def test_plain_mma_launches_keep_the_kernel_defaults(wo):
    # no bias, the plain silu: gate-up, split_glu and down take the kernels' defaults (None bias pointers, not
    # interleaved, alpha 1, no clamp, no shift): the plain kernels (sm_90 SASS identical: the notes' diff)
    from moekit.experts.triton_wo_plan import wo_plan_for

    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=3, k=2, hidden=256, n=64, seed=5)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    for config in (_config(), _config(up_split=2)):
        plan = wo_plan_for(x, *args, ids, weights, None, "mxfp4", "silu", config, POISON, decode="mma")
        assert plan.biased
        for launch in (plan.gate_up, plan.glu) if plan.glu is not None else (plan.gate_up,):
            names = launch.kernel.arg_names[len(launch.kernel.arg_names) - len(launch.tail):]
            constexprs = dict(zip(names, launch.tail))
            assert (constexprs["ALPHA"], constexprs["LIMIT"], constexprs["UP_SHIFT"]) == (1.0, None, 0.0)
            assert constexprs.get("INTERLEAVED", False) is False
        assert plan.gate_up.kernel.arg_names[9] == "b13_ptr" and plan.down.kernel.arg_names[13] == "b2_ptr"
        out = _run(wo, x, w13, w2, ids, weights, "silu", None, None, config)
        assert rel(out, _loop(x, w13, w2, ids, weights, None, None, "silu")) < 1e-3


@pytest.mark.parametrize("scheme,decode,m,k,e", [("mxfp4", "mma", 5, 2, 4), ("int4_w4a16", "gemv", 1, 4, 16)])
def test_route_gives_a_variant_call_the_word_decode_a_plain_call_takes(wo, monkeypatch, scheme, decode, m, k, e):
    # the plain chooser's "mma" (aligned 16-row blocks) or "gemv" (the shortcut: M = 1, k = 4 of E = 16), patched in
    # for this tiny shape's measured row, stands for a variant call (was "register"), end to end
    import moekit.experts.triton_wo_plan as plan

    x, w13, w2, ids, weights = problem(wo, scheme, 32, m=m, k=k, e=e, hidden=256, n=64, seed=11)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    monkeypatch.setitem(plan.DECODE_MEASURED, (scheme, e, 64, 256), {m: decode})
    shortcut = decode == "gemv"
    assert plan._usable_decode(None, *args, scheme, m, e, 64, 256, k, shortcut) == decode
    assert plan._usable_decode(None, *args, scheme, m, e, 64, 256, k, shortcut, variant=True) == decode
    b13, b2 = _biases(e, 64, 256, 12)
    ran = built_plans(monkeypatch)
    out = _run(wo, x, w13, w2, ids, weights, SPEC, b13, b2, decode=None)
    assert [p.decode for p in ran] == [decode]
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, SPEC)) < 1e-3


def test_variant_measured_entry_comes_first_for_variant_calls_only(wo, monkeypatch):
    # a VARIANT_DECODE_MEASURED entry of the shape (tile-height bucket 16: M = 1..31 here) decides variant calls;
    # plain calls keep the chooser's; another bucket (M = 40: 20 rows an expert) keeps the chooser's too
    import moekit.experts.triton_wo_plan as plan
    import moekit.experts.triton_wo_variant as variant

    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=5, k=2, hidden=256, n=64, seed=13)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    monkeypatch.setattr(plan, "choose_decode", lambda *a, **k: "tile")
    monkeypatch.setitem(variant.VARIANT_DECODE_MEASURED, ("mxfp4", 4, 64, 256), {8: "mma"})
    assert plan._usable_decode(None, *args, "mxfp4", 5, 4, 64, 256, 2, False, variant=True) == "mma"
    assert plan._usable_decode(None, *args, "mxfp4", 5, 4, 64, 256, 2, False) == "tile"
    assert plan._usable_decode(None, *args, "mxfp4", 40, 4, 64, 256, 2, False, variant=True) == "tile"
    assert plan._usable_decode("register", *args, "mxfp4", 5, 4, 64, 256, 2, False, variant=True) == "register"


def test_variant_measured_entries_reach_a_factor_2_only(monkeypatch):
    # an entry speaks for its bucket's Ms from half the smallest measured M to below twice the largest
    import moekit.experts.triton_wo_variant as variant

    monkeypatch.setitem(variant.VARIANT_DECODE_MEASURED, ("mxfp4", 4, 64, 256), {8: "mma"})
    picks = [variant.measured_variant_decode("mxfp4", m, 4, 64, 256, 2) for m in (3, 4, 15, 16)]
    assert picks == [None, "mma", "mma", None]  # M = 16: 8 rows an expert, still bucket 16, past 2 x 8


def test_shipped_variant_rows_of_gpt_oss_20b():
    # one H100's wom40 checks: mxfp4 M = 1..127 and int4 4..22 / 512..608 on the mma decode, int4 23..127 register
    # and 609..1023 tile (measured entries bounding them); int4 M = 1..3, int8 and other shapes: the plain chooser's
    from moekit.experts.triton_wo_variant import measured_variant_decode

    def picks(scheme, ms):
        return [measured_variant_decode(scheme, m, 32, 2880, 2880, 4) for m in ms]

    assert picks("mxfp4", (1, 3, 4, 8, 64, 127, 128, 512)) == ["mma", "mma", "mma", "mma", "mma", "mma", None, None]
    assert picks("int4_w4a16", (3, 4, 22, 23, 127, 256, 512, 608, 609, 1023)) == [
        None, "mma", "mma", "register", "register", None, "mma", "mma", "tile", "tile"]
    assert picks("int8_w8a16", (1, 8, 64, 512)) == [None] * 4
    assert measured_variant_decode("mxfp4", 8, 128, 2880, 2880, 4) is None  # gpt-oss-120b: unmeasured
