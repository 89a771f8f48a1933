"""The clamp after the activation (``ActivationSpec.limit_after_act``, session 48) through what the Triton backend keeps
and crosses, under Triton's interpreter on the CPU: two specs differing only in the clamp's place never share a plan, a
compiled kernel or a recorded launch sequence (bf16 weights through the eager fast path and the op, int4 and fp8
weights through the quantized lean path: calls alternating in either order, each against the float64 loop of
``_limit_after``); transformers' Step-3.7 model (built offline, two MoE layers with their own limits) with its experts
on ``backend="triton"`` equals its own eager experts; the backward (a recompute on grouped_mm) gives the loop's
gradients for each place.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import emulation_f64  # noqa: E402
from _helpers import bf16_quantized_pair, bf16_routing, count_calls, make_problem, rel_l2  # noqa: E402
from _limit_after import both, loop64  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)

from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SPECS = both(ActivationSpec("silu", limit=0.5))  # (before, after): at 0.5 the two places differ by ~30%
ORDERS = {"before_first": (0, 1, 0, 1, 1, 0), "after_first": (1, 0, 1, 0, 0, 1)}
THROUGH_OP = LaunchOptions(direct_eager=False)  # the custom op: the spec crosses its schema as fields


def _alternate(interpreter, order, run, wants, tol) -> None:
    """Calls ``run(spec)`` for the specs in ``order`` from cleared caches, each within ``tol`` of its own answer."""
    assert rel_l2(wants[0], wants[1]) > 10 * tol  # a call served with the other spec's kernels would fail
    interpreter.clear_launch_caches()
    for i in order:
        assert rel_l2(run(SPECS[i]), wants[i]) < tol, (order, i)


@pytest.mark.parametrize("order", list(ORDERS))
def test_bf16_plans_kernels_and_kept_calls_are_per_place(interpreter, order):
    x, w13, w2, ids, weights = make_problem(5, 2, 8, 33, 17, seed=4)
    wants = [loop64(x, w13, w2, ids, weights, spec)[0] for spec in SPECS]
    _alternate(interpreter, ORDERS[order], lambda spec: interpreter.experts_triton(x, w13, w2, ids, weights,
                                                                                   activation=spec), wants, 1e-5)
    _alternate(interpreter, ORDERS[order], lambda spec: interpreter.experts_triton(
        x, w13, w2, ids, weights, activation=spec, options=THROUGH_OP), wants, 1e-5)
    from moekit.experts import triton_plan

    places = {spec.limit_after_act for key in triton_plan._PLANS for spec in key if isinstance(spec, ActivationSpec)}
    assert places == {False, True}  # one plan each


@pytest.mark.parametrize("scheme", ["int4_w4a16", "fp8_block"])
def test_quantized_kept_sequences_are_per_place(interpreter, monkeypatch, scheme):
    from moekit.experts import triton_quant_fast

    options = {"int4_w4a16": dict(group_size=32), "fp8_block": dict(block_shape=(32, 32))}[scheme]
    q13, q2 = bf16_quantized_pair(scheme, 4, 32, 64, options, seed=0)
    x, ids, weights = bf16_routing(5, 64, 4, 2, seed=1)
    if scheme == "fp8_block":  # the recipe: x and h through e4m3 per 32 columns
        wants = [emulation_f64(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, (32, 32), spec=s) for s in SPECS]
    else:
        wants = [loop64(x, q13.dequantize(), q2.dequantize(), ids, weights, s)[0] for s in SPECS]
    served = count_calls(monkeypatch, {"hits": 0}, [(triton_quant_fast, "_launch", "hits")])
    run = lambda spec: interpreter.experts_triton(x, q13, q2, ids, weights, activation=spec)  # noqa: E731
    _alternate(interpreter, (0, 1, 0, 1, 1, 0), run, wants, 2e-2 if scheme == "fp8_block" else 1e-2)
    assert served["hits"] >= 3  # repeats were served from their kept sequences


def test_step_3_7_experts_on_the_triton_backend(interpreter, monkeypatch):
    """transformers' Step-3.7 model (``test_hf_layer_clamps._step_model``: limits 3 and 5, the MLP inputs ~30x, past
    every clamp) with its experts implementation "moekit" on the triton backend equals its eager experts."""
    pytest.importorskip("transformers")
    import moekit.hf as moekit_hf
    from moekit.experts import triton_plan
    from test_hf_layer_clamps import LIMITS, _step_model, eager_and_moekit

    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "triton")
    interpreter.clear_launch_caches()
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    want, got = eager_and_moekit(_step_model(), ids)
    assert rel_l2(got, want) < 1e-5
    limits = sorted({spec.limit for key in triton_plan._PLANS for spec in key
                     if isinstance(spec, ActivationSpec) and spec.limit_after_act})
    assert limits == LIMITS  # both layers' experts ran on the Triton kernels, each with its own clamp


def test_the_backward_differentiates_each_place(interpreter):
    """x's gradient through the Triton backend's recomputing backward, against the float64 loop's, for the clamp
    before and after the activation (whose gradients differ: the test can tell them apart)."""
    x, w13, w2, ids, weights = make_problem(3, 2, 8, 33, 17, seed=6)
    wants = []
    for spec in SPECS:
        x64 = x.double().requires_grad_()
        loop64(x64, w13, w2, ids, weights, spec)[0].sum().backward()
        wants.append(x64.grad)
    assert rel_l2(wants[0], wants[1]) > 1e-3
    for spec, want in zip(SPECS, wants):
        leaf = x.clone().requires_grad_()
        interpreter.experts_triton(leaf, w13, w2, ids, weights, activation=spec).sum().backward()
        assert rel_l2(leaf.grad, want) < 1e-5
