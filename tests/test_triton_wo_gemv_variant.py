"""Expert biases and the activation variant (gpt-oss as it ships: b13, b2, interleaved gate/up rows, its clamped SwiGLU)
on the weight-only word decode (``decode="gemv"``, ``_kernels/gemm_wo_gemv.py``, session 40), on the CPU under
Triton's interpreter, tiny shapes.

Chain (b13 + b2 + the spec and each alone x the schemes in 2-row blocks: ``test_triton_wo_mma_variant``'s parts test):
the gemv decode with b13 + b2 + the spec, int8 / int4 g32 / mxfp4, K = 200 (a tail step), on the 1-row shortcut and
split, against the float64 loop of ``test_triton_wo_variant`` (its problem and assertions); the gate-up split along K
(b13 in split 0's partials alone, the spec in the split_glu launch), folded into the down GEMM for biases on the plain
silu (b13 once through ``load_h``) and never for a spec (a looked-up config's fold dropped, a caller's refused by name).
(The split-K down GEMM with an expert map and the route: ``test_triton_wo_mma_variant``'s, for both word decodes.)

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from test_triton_wo import problem, rel, wo  # noqa: E402, F401  (wo: fixture)
from test_triton_wo_variant import (  # noqa: E402
    SPEC, _biases, _loop, assert_variant, built_plans, run_variant, variant_problem,
)

from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo_gemv import PER, WordConfig  # noqa: E402

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 32), ("mxfp4", 32)]


def _config(scheme: str, rows: int = 1, **word) -> WordConfig:
    """16 words a step, 64 weight rows a program in 2 warps (the 1-row default), ``word``'s splits."""
    tile = GemmTile(64, 16 * PER[scheme], 1, 2, 1)
    return WordConfig(rows, tile, tile, **word)


def _run(wo, *args, decode="gemv", **kwargs):
    return run_variant(wo, decode, *args, **kwargs)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_gemv_shortcut_indexes_the_biases_by_expert(wo, scheme, group):
    # M = 1, k = 4 of E = 16 (gpt-oss's decode: A <= E): no alignment, one row a block, its expert from topk_ids
    from moekit.layouts.block_aligned import use_naive

    x, w13, w2, ids, weights = problem(wo, scheme, group, m=1, k=4, e=16, hidden=200, n=64, seed=13)
    assert use_naive(4, 16, None)
    b13, b2 = _biases(16, 64, 200, 14)
    out = _run(wo, x, w13, w2, ids, weights, SPEC, b13, b2 * 50)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2 * 50, SPEC)) < 1e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("split", [2, 3])
def test_gemv_split_gate_up_takes_b13_once_and_the_spec(wo, scheme, group, split):
    # K = 200 in 2 or 3 splits of whole steps (the last a tail): float32 partials, b13 in split 0's, the split_glu
    # launch sums them and runs the spec
    x, w13, w2, ids, weights, b13, b2, spec = variant_problem(wo, scheme, group, "all", hidden=200)
    out = _run(wo, x, w13, w2, ids, weights, spec, b13, b2, _config(scheme, 2, up_split=split))
    assert_variant(out, x, w13, w2, ids, weights, b13, b2, spec)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_gemv_folded_split_takes_b13_once_on_the_plain_silu(wo, scheme, group):
    # the fold (the down GEMM sums the partials and activates as it reads h) keeps b13 once: split 0's partials
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=200, n=64, seed=21)
    b13, b2 = _biases(4, 64, 200, 22)
    out = _run(wo, x, w13, w2, ids, weights, "silu", b13, b2, _config(scheme, 2, up_split=2, glu_fold=True))
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, "silu")) < 1e-3


def test_a_variant_never_folds(wo, monkeypatch):
    # the fold runs the plain activation: a caller's folded config with a spec is refused by name; a looked-up one
    # (``wo_config``, patched to fold) runs unfolded, its split_glu launch running the spec
    import moekit.experts.triton_wo_plan as plan

    x, w13, w2, ids, weights, b13, b2, spec = variant_problem(wo, "mxfp4", 32, "all", hidden=200)
    folded = _config("mxfp4", 2, up_split=2, glu_fold=True)
    with pytest.raises(ValueError, match="config.glu_fold runs the plain activation"):
        _run(wo, x, w13, w2, ids, weights, spec, b13, b2, folded)
    monkeypatch.setattr(plan, "wo_config", lambda *a, **k: folded)
    plan.clear_wo_plans()  # this call's kind ran before on the heuristic's config (the parts test): built anew
    built = built_plans(monkeypatch)
    out = _run(wo, x, w13, w2, ids, weights, spec, b13, b2)
    assert [(p.glu_fold, p.glu is not None, p.config.glu_fold) for p in built] == [(False, True, False)]
    assert_variant(out, x, w13, w2, ids, weights, b13, b2, spec)
