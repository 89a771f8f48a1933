"""The clamp after the activation (``limit_after_act``, session 48) on the two Gluon paths that take a variant, on the
CPU: their kernels replaced by the torch stand-ins of ``_gluon_fakes`` (the fp8 GEMMs) and ``_words_fakes`` (the words
decode), which compute what the kernels' constexprs say. What this holds: the host plumbing (``Fp8GluonVariant`` /
``WordsVariant`` carry the clamp's place to the launches' LIMIT_AFTER, the plans and kept sequences of the two places
stay apart, calls alternating in either order); the kernels' own arithmetic is ``benchmarks/act48_device_check.py``'s.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _limit_after import both
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from _words_fakes import E, rel, routing, stand_ins  # noqa: F401  (a fixture)
from test_gluon_fp8_variant import _f64, _problem
from test_triton_wo_words_lean import _weight, launched, lean  # noqa: F401  (launched: a fixture)

from moekit.activations import ActivationSpec


def test_fp8_gemms_take_the_place_of_the_clamp(fake_gemms):
    """Gate rows first and interleaved, lean launches on: each call equals the float64 loop of its own spec (x * 3:
    the gate-up sums past the limit), the gate-up GEMM launched with its LIMIT_AFTER; the other order the same."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights, b13, b2 = _problem(n=128, hidden=256)  # N a multiple of 128: gate rows first too
    x = x * 3
    for spec in (ActivationSpec("silu", limit=1.0), ActivationSpec("silu", interleaved=True, limit=1.0, up_shift=1.0)):
        before, after = both(spec)
        wants = {s: _f64(x, q, ids, weights, b13, b2, s) for s in (before, after)}
        assert rel_l2(wants[before], wants[after]) > 0.05  # the place shows
        for order in ((before, after, before), (after, before, after)):
            fake_gemms["fp8"].log.clear()
            for s in order:
                out = experts_gluon_fp8(x, *q, ids, weights, activation=s, b13=b13, b2=b2)
                assert rel_l2(out, wants[s]) < 1e-2
            ups = [bound["LIMIT_AFTER"] for _, bound, _ in fake_gemms["fp8"].log if bound["GATED"]]
            assert ups == [s.limit_after_act for s in order]


def _words_loop(x, w13, w2, ids, weights, spec) -> torch.Tensor:
    """out [M, K] float64: v = w13 x; gate, up its halves; |up| <= L, and gate <= L before the activation or
    gate sigmoid(gate) <= L after it; h rounded to bf16; out += weight (w2 h)."""
    from _words_fakes import dequant

    out = torch.zeros(x.shape, dtype=torch.float64)
    n, k, limit = w13.q.shape[1] // 2, x.shape[1], spec.limit
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            v = dequant(w13.q, w13.scale, w13.zero, e, k) @ x[t].double()
            gate, up = v[:n], v[n:].clamp(-limit, limit)
            act = gate.clamp(max=limit) * torch.sigmoid(gate.clamp(max=limit))
            if spec.limit_after_act:
                act = (gate * torch.sigmoid(gate)).clamp(max=limit)
            h = (act * up).bfloat16().double()
            out[t] += float(weights[t, slot]) * (dequant(w2.q, w2.scale, w2.zero, e, n) @ h)
    return out


def test_the_words_decode_takes_the_place_of_the_clamp(stand_ins, launched):
    """int4 words, gate rows first: each spec's kept sequence serves its own calls only (lean from its second call),
    each call within 1e-2 of its spec's float64 loop, the gate-up launched with its LIMIT_AFTER."""
    from moekit.experts.triton_wo_words_route import words_variant

    n, k = 256, 512
    w13, w2 = _weight(2 * n, k, 7, False), _weight(k, n, 8, False)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).bfloat16() * 4  # sums past the limit
    _, ids, weights = routing(5, 11)
    specs = both(ActivationSpec("silu", limit=1.0))
    variants = [words_variant(s, None, None) for s in specs]
    wants = [_words_loop(x, w13, w2, ids, weights, s) for s in specs]
    assert rel(wants[0], wants[1]) > 0.05
    for i in (0, 1, 0, 1, 1, 0):
        out = lean.words_lean_call(x, w13, w2, ids, weights, variants[i])
        if out is None:  # this kind's first call: the plan, then its sequence kept
            out = lean.run_words(x, w13, w2, ids, weights, variant=variants[i])
        assert rel(out, wants[i]) < 1e-2, i
        assert stand_ins["gate_up"].log[-1][1]["LIMIT_AFTER"] == specs[i].limit_after_act
    assert launched["lean"] == 4  # two first calls planned, the other four served from their own sequences
