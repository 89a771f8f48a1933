"""The fp8 Gluon path with the experts variant (issue #15, session 42): expert biases, gpt-oss's activation (interleaved
gate/up rows, silu alpha 1.702, a clamp, up + 1) and N / K past a multiple of 128, on the CPU. The twin against a
float64 loop written here and the reference backend's fp8 recipe; the plain and lean launches with the GEMMs as torch
stand-ins that address the weights tile by tile as the kernel does (``_gluon_fakes.fp8_gemm``: interleaved row tiles,
clamped scale blocks, zeros past the views) against the twin; the route (``Fp8GluonChoice.variants``, on by default)
and the keys that keep a variant's plans apart from silu's. The kernels themselves compile in
``test_triton_gluon_fp8.test_gemm_compiles_for_sm90`` and run in ``benchmarks/gfp42_device_check.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _fp8_cases import block_experts
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import count_served, glu64, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.activations import ActivationSpec
from moekit.experts.triton_gluon_fp8 import (
    Fp8GluonChoice, experts_gluon_fp8, experts_gluon_fp8_twin, fp8_fast_key, gluon_fp8_takes, gluon_fp8_unfit,
)
from moekit.quant.fp8_block import Fp8BlockWeight

# gpt-oss's spec with a clamp that bites at these scales (gpt-oss: limit 7)
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.6, up_shift=1.0)
E, N, K = 3, 208, 176  # N, K multiples of 16, not of 128: 2N = 416 is 3.25 scale blocks (a last tile past 2N)
ON = Fp8GluonChoice(min_flops=1, min_rows_per_expert=0, variants=True)  # every call, variants included


def _problem(m=40, k=2, n=N, hidden=K, seed=0, biases=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    q = block_experts(g, E, n, hidden)
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    b13 = torch.randn(E, 2 * n, generator=g).bfloat16() if biases else None
    b2 = torch.randn(E, hidden, generator=g).bfloat16() if biases else None
    return x, q, ids, torch.rand(m, k, generator=g), b13, b2


def _groups_f64(v: torch.Tensor) -> torch.Tensor:
    """v [C] through e4m3 per 128 values (scale amax / 448, 1 for zeros; a last partial group over its own), float64."""
    out = torch.empty(v.shape, dtype=torch.float64)
    for c in range(0, v.shape[0], 128):
        g = v[c:c + 128].double()
        amax = g.abs().max()
        s = amax / 448 if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
        out[c:c + 128] = (g / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    return out


def _f64(x, q, ids, weights, b13, b2, spec):
    """Token by token, slot by slot: x and h through e4m3 per 128 columns, the block-dequantized weights, + b13,
    the spec's glu written out (``glu64``), + b2, y rounded to bf16, the weighted sum."""
    def deq(w, s):  # [E, R, C] * s[e, r // 128, c // 128]
        return w.double() * s.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :w.shape[1], :w.shape[2]]

    w13, w2 = deq(q[0], q[1]), deq(q[2], q[3])
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ _groups_f64(x[t]) + (0 if b13 is None else b13[e].double())  # [2N]
            y = w2[e] @ _groups_f64(glu64(gate_up, spec).float()) + (0 if b2 is None else b2[e].double())  # [K]
            out[t] += float(weights[t, j]) * y.bfloat16().double()
    return out


@pytest.mark.parametrize("spec, n, hidden, biases", [
    (GPT_OSS, N, K, True),  # gpt-oss: both tails, both biases
    (GPT_OSS, 128, 256, False),  # interleaved rows alone
    (ActivationSpec("gelu"), 128, K, True),  # another activation, gate rows first (N a multiple of 128), a K tail
])
def test_twin_matches_a_float64_loop_and_the_reference_recipe(spec, n, hidden, biases):
    from moekit.experts.triton_fp8 import fused_experts_fp8_torch

    x, q, ids, weights, b13, b2 = _problem(n=n, hidden=hidden, biases=biases)
    twin = experts_gluon_fp8_twin(x, *q, ids, weights, activation=spec, b13=b13, b2=b2)
    assert rel_l2(twin, _f64(x, q, ids, weights, b13, b2, spec)) < 1e-2
    recipe = fused_experts_fp8_torch(x, *q, ids, weights, activation=spec, b13=b13, b2=b2)  # y not rounded: close
    assert rel_l2(twin, recipe) < 1e-2
    plain = experts_gluon_fp8_twin(x, *q, ids, weights, activation=ActivationSpec(interleaved=spec.interleaved))
    assert rel_l2(plain, twin) > 0.1  # the biases / spec reach the result


def test_launches_equal_the_twin_with_tails_biases_and_interleaved_rows(fake_gemms):
    """Plain and lean launches bit for bit; against the twin and the float64 loop; the gate-up GEMM launched with
    the interleaved rows' tile walk (gate_offset 128, ceil(N / 128) column blocks) and the spec's constexprs, the
    biases as its and the down GEMM's pointers."""
    x, q, ids, weights, b13, b2 = _problem()
    plain = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
    assert torch.equal(plain, lean)
    assert rel_l2(plain, experts_gluon_fp8_twin(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)) < 1e-2
    assert rel_l2(plain, _f64(x, q, ids, weights, b13, b2, GPT_OSS)) < 1e-2
    launches = [bound for _, bound, _ in fake_gemms["fp8"].log]
    up = [b for b in launches if b["GATED"]]
    down = [b for b in launches if not b["GATED"]]
    assert len(up) == len(down) == 2
    for b in up:
        assert (b["gate_offset"], b["num_col_blocks"], b["w_rows"]) == (128, 2, 2 * N)
        assert (b["INTERLEAVED"], b["ALPHA"], b["LIMIT"], b["UP_SHIFT"]) == (True, 1.702, 0.6, 1.0)
        assert b["bias_ptr"] is b13
    for b in down:
        assert (b["num_col_blocks"], b["INTERLEAVED"], b["bias_ptr"]) == (2, False, b2)


def test_a_new_bias_tensor_is_read_by_the_kept_launches(fake_gemms):
    """The lean launches record the biases by address (their sequence's key): a call with other bias tensors
    launches with those, not the first call's."""
    x, q, ids, weights, b13, b2 = _problem()
    first = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
    assert torch.equal(first, experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2))
    other13, other2 = b13 * -2, b2 + 1
    again = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=other13, b2=other2)
    expected = experts_gluon_fp8_twin(x, *q, ids, weights, activation=GPT_OSS, b13=other13, b2=other2)
    assert rel_l2(again, expected) < 1e-2 and rel_l2(again, first) > 0.1


def test_plans_are_kept_apart_by_spec_and_biases(fake_gemms):
    """One shape, four kinds of call: silu, gpt-oss's spec, with and without biases: four lean plans, none reused
    for another (a silu plan launched for gpt-oss would compute silu(gate) * up of the wrong rows)."""
    from moekit.experts.triton_gluon_lean import _PLANS

    x, q, ids, weights, b13, b2 = _problem(n=128, hidden=256)
    outs = [experts_gluon_fp8(x, *q, ids, weights, activation=spec, b13=bias13, b2=bias2)
            for spec in ("silu", GPT_OSS) for bias13, bias2 in ((None, None), (b13, b2))]
    assert len(_PLANS) == 4
    for a in range(4):
        for b in range(a):
            assert not torch.equal(outs[a], outs[b])
    w13, w2 = _weights(q)
    assert fp8_fast_key(w13, w2, "silu", ON) != fp8_fast_key(w13, w2, GPT_OSS, ON)


def _weights(q):
    return (Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128), dtype=torch.bfloat16),
            Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128), dtype=torch.bfloat16))


def test_route_takes_variants_only_with_the_switch(fake_gemms, monkeypatch):
    """``gluon_fp8_takes``: a gpt-oss call (and a plain one with a K tail) never without ``variants`` (main's route:
    the fused Triton kernels, whose result the backend then returns), always with it where it fits; a non-interleaved
    spec with N not a multiple of 128 stays off; the ``triton`` backend with the switch on equals the Gluon launch
    and the reference backend's recipe."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts import run_experts

    x, q, ids, weights, b13, b2 = _problem(m=12)
    w13, w2 = _weights(q)
    off = dataclasses.replace(ON, variants=False)  # the fused Triton kernels for every variant call
    assert not gluon_fp8_takes(x, w13, w2, weights, GPT_OSS, b13, b2, off)
    assert not gluon_fp8_takes(x, w13, w2, weights, GPT_OSS, None, None, off)
    assert not gluon_fp8_takes(x, w13, w2, weights, "silu", None, None, ON)  # N = 208 with the gate rows first
    tail_x, tail_q, _, tail_weights, _, _ = _problem(m=12, n=128)  # K = 176: a plain call with a K tail fits now,
    assert gluon_fp8_takes(tail_x, *_weights(tail_q), tail_weights, "silu", None, None, ON)  # with the switch alone
    assert not gluon_fp8_takes(tail_x, *_weights(tail_q), tail_weights, "silu", None, None, off)
    plain_x, plain_q, _, plain_weights, _, _ = _problem(m=12, n=128, hidden=256)  # main's plain call: as before
    assert gluon_fp8_takes(plain_x, *_weights(plain_q), plain_weights, "silu", None, None, off)
    assert gluon_fp8_takes(x, w13, w2, weights, GPT_OSS, b13, b2, ON)
    assert not gluon_fp8_takes(x, w13, w2, weights, ActivationSpec("gelu"), b13, b2, ON)  # N = 208, gate rows first

    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", off)
    triton = run_experts(x, w13, w2, ids, weights, backend="triton", activation=GPT_OSS, b13=b13, b2=b2)
    assert fake_gemms["fp8"].log == []  # the fused Triton kernels (interpreted)
    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", ON)
    routed = run_experts(x, w13, w2, ids, weights, backend="triton", activation=GPT_OSS, b13=b13, b2=b2)
    assert len(fake_gemms["fp8"].log) == 2
    assert torch.equal(routed, experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2))
    reference = run_experts(x, w13, w2, ids, weights, backend="reference", activation=GPT_OSS, b13=b13, b2=b2)
    assert rel_l2(routed, reference) < 2e-2 and rel_l2(triton, reference) < 2e-2


@pytest.mark.parametrize("change, reason", [
    (dict(b13=torch.zeros(E, N)), "b13 (3, 208)"),
    (dict(b2=torch.zeros(E, 2 * K)[:, ::2]), "strided"),
    (dict(b2=torch.zeros(E, K, dtype=torch.int32)), "expected a float tensor"),
])
def test_unfit_names_a_bad_bias(change, reason):
    x, q, _, _, b13, b2 = _problem()
    biases = dict(b13=b13, b2=b2) | change
    msg = gluon_fp8_unfit(x, *q, GPT_OSS, (128, 128), **biases)
    assert msg is not None and reason in msg
    assert gluon_fp8_unfit(x, *q, GPT_OSS, (128, 128), b13=b13, b2=b2) is None


def test_an_unbiased_variant_call_is_kept_by_its_spec(fake_gemms, monkeypatch):
    """The backend's fast path keeps a gpt-oss call without biases (its key holds the spec): from the third call (the
    first compiles, the second records the launches) served from it and equal; a silu call of the same shape and
    weights is not served from the spec's entry."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts import run_experts

    x, q, ids, weights, _, _ = _problem(m=12, n=128, hidden=256)
    w13, w2 = _weights(q)
    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", ON)
    served = count_served(monkeypatch, tgf, "run_fast_fp8")
    first, *again = (run_experts(x, w13, w2, ids, weights, backend="triton", activation=GPT_OSS) for _ in range(3))
    assert served == [1] and all(torch.equal(first, out) for out in again)
    silu = run_experts(x, w13, w2, ids, weights, backend="triton")
    assert served == [1]
    assert torch.equal(silu, experts_gluon_fp8(x, *q, ids, weights)) and not torch.equal(silu, first)
