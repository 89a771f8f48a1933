"""Expert biases, gpt-oss's activation variant and the other gated activations on the fused fp8 Triton kernels (issue
#15), on the CPU under Triton's interpreter, tiny shapes (K and N not multiples of 128, as gpt-oss-20b's 2880).

Chain: the kernels with b13 alone, b2 alone, the spec alone (interleaved rows, alpha 1.702, a clamp that bites, up + 1),
all together, and GELU, against a float64 emulation of the recipe (``_fp8_cases.emulation_f64``: dequantized weights, x
and h through e4m3 per 128 columns, the glu written out in ``_helpers.glu64``); the twin the same way; each plan the
kernels have (the tiny-batch shortcut, aligned blocks, x quantized inside gate-up, h float32, SWAP_AB, the k-sum in the
down GEMM or apart, an expert map with -1, M = 0 / 1); two calls with other biases on one plan; the persistent GEMMs
only where asked; the route (no grouped_mm fallback) and a tiny gpt-oss quantized to fp8_block against the reference
backend; the lean eager path serving a variant call with its own plan (a biased one too, session 41). Workspaces are
filled with NaN first (``POISON``).

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, SHAPES, emulation_f64, problem  # noqa: E402
from _helpers import experts_loop, partial_expert_map, rel_l2  # noqa: E402
from _triton_helpers import fp8, interpreter  # noqa: E402, F401  (fixtures)
from test_triton_wo_variant import refuse_grouped_mm, tiny_gpt_oss, triton_and_reference  # noqa: E402

from moekit.activations import ActivationSpec, as_spec, spec_fields  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402

# gpt-oss's spec but for the clamp, which bites at these sizes (gate-up outputs near unit size; gpt-oss's is 7.0)
SPEC = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=1.0, up_shift=1.0)
PARTS = {"b13": (True, False, "silu"), "b2": (False, True, "silu"), "spec": (False, False, SPEC),
         "all": (True, True, SPEC), "gelu": (False, False, "gelu"), "gelu_tanh_biases": (True, True, "gelu_tanh")}
SHAPE, BLOCK = SHAPES[0]  # E 4, K 160, N 96; (128, 128)
CONFIGS = {  # tiles the plan may take, forced (the tuned files' forms)
    "h_fp32": KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2)),
    "swap_ab": KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(128, 128, 1, 4, 2), swap_ab=True),
    "prefill": KernelConfig(64, GemmTile(128, 128, 8, 8, 2), GemmTile(128, 128, 8, 4, 2)),
}


def _biases(shape, seed: int, out_scale: float = 1.0):
    """b13 [E, 2N] ~ N(0, 1) (gate-up outputs are ~ N(0, 1) here), b2 [E, K] ~ N(0, out_scale^2)."""
    (num_experts, hidden, inter), g = shape, torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, 2 * inter, generator=g), torch.randn(num_experts, hidden, generator=g) * out_scale


def _emulated(x, quantized, ids, weights, block_shape, b13, b2, activation, expert_map=None):
    spec = None if activation == "silu" else as_spec(activation)
    return emulation_f64(x, *quantized, ids, weights, block_shape, expert_map, b13=b13, b2=b2, spec=spec)


@pytest.mark.parametrize("shape,block_shape", SHAPES)
@pytest.mark.parametrize("parts", list(PARTS))
def test_kernels_and_twin_match_float64_emulation(fp8, parts, shape, block_shape):
    x, _, quantized, ids, weights = problem(5, 2, shape, block_shape, seed=7)
    with_b13, with_b2, activation = PARTS[parts]
    plain = _emulated(x, quantized, ids, weights, block_shape, None, None, "silu")
    b13, b2 = _biases(shape, 8, plain.pow(2).mean().sqrt().item())
    b13, b2 = (b13 if with_b13 else None), (b2 if with_b2 else None)
    out = fp8.fused_experts_fp8(x, *quantized, ids, weights, activation=activation, block_shape=block_shape,
                                options=POISON, b13=b13, b2=b2)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, activation=activation, block_shape=block_shape,
                                       b13=b13, b2=b2)
    want = _emulated(x, quantized, ids, weights, block_shape, b13, b2, activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_l2(out, want) < FLIP_TOL and rel_l2(twin, want) < FLIP_TOL
    assert rel_l2(want, plain) > 0.05  # the variant shows
    if activation is SPEC:  # and its clamp bites
        unclamped = ActivationSpec("silu", interleaved=True, alpha=1.702, up_shift=1.0)
        assert rel_l2(want, _emulated(x, quantized, ids, weights, block_shape, b13, b2, unclamped)) > 0.01


@pytest.mark.parametrize("plan", ["x_in_gate_up", *CONFIGS])
def test_every_plan_form_takes_biases_and_the_spec(fp8, plan):
    # M = 6, k = 2 of E = 4: aligned blocks (no shortcut); each forced form against the float64 emulation
    x, _, quantized, ids, weights = problem(6, 2, SHAPE, BLOCK, seed=11)
    b13, b2 = _biases(SHAPE, 12)
    config = CONFIGS.get(plan)
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, config, POISON,
                                       x_in_gate_up=plan == "x_in_gate_up" or None, activation=SPEC, b13=b13, b2=b2)
    assert rel_l2(out, _emulated(x, quantized, ids, weights, BLOCK, b13, b2, SPEC)) < FLIP_TOL


@pytest.mark.parametrize("m,k", [(0, 2), (1, 1), (1, 2), (9, 2)])
def test_expert_map_with_unrouted_slots_and_tiny_batches(fp8, m, k):
    # ids into 8 global experts (20% of slots -1), 4 of them local: a slot not here adds neither b2 nor anything;
    # M = 1, k = 1 takes the tiny-batch shortcut (A * 4 <= E) with no map, so it runs without one too
    x, _, quantized, ids, weights = problem(m, k, SHAPE, BLOCK, seed=m + 20, num_global=8)
    b13, b2 = _biases(SHAPE, 13)
    for expert_map in (partial_expert_map(8, 4, seed=m), None):
        if expert_map is None:
            ids = torch.where(ids < 4, ids, -1)  # local ids (and -1) only
        out = fp8.fused_experts_fp8(x, *quantized, ids, weights, activation=SPEC, expert_map=expert_map,
                                    block_shape=BLOCK, options=POISON, b13=b13, b2=b2)
        want = _emulated(x, quantized, ids, weights, BLOCK, b13, b2, SPEC, expert_map)
        assert out.shape == x.shape
        assert rel_l2(out, want) < FLIP_TOL if m else out.numel() == 0


def test_the_op_with_and_without_the_folded_k_sum(fp8):
    # the op takes fresh workspaces (no kept counters: down, then the k-sum apart); a direct eager call folds the
    # k-sum into the down GEMM (M <= sum_fold_max): b2 once either way
    x, _, quantized, ids, weights = problem(3, 2, SHAPE, BLOCK, seed=14)
    b13, b2 = _biases(SHAPE, 15)
    want = _emulated(x, quantized, ids, weights, BLOCK, b13, b2, SPEC)
    via_op = torch.ops.moekit.triton_experts_fp8(x, *quantized, ids, weights, None, *BLOCK, True, False, True, b13, b2,
                                                 *spec_fields(SPEC))
    direct = fp8.fused_experts_fp8(x, *quantized, ids, weights, activation=SPEC, block_shape=BLOCK, options=POISON,
                                   b13=b13, b2=b2)
    assert rel_l2(via_op, want) < FLIP_TOL and rel_l2(direct, want) < FLIP_TOL


def test_calls_with_other_biases_share_a_plan_and_never_each_others(fp8):
    plans = sys.modules[fp8.plan_for.__module__]._PLANS
    fp8.clear_launch_caches()
    x, _, quantized, ids, weights = problem(4, 2, SHAPE, BLOCK, seed=16)

    def call(b13, b2, activation=SPEC):
        return fp8.fused_experts_fp8(x, *quantized, ids, weights, activation=activation, block_shape=BLOCK,
                                     options=POISON, b13=b13, b2=b2)

    first, second = _biases(SHAPE, 17), _biases(SHAPE, 18)
    got = call(*first)
    assert len(plans) == 1
    assert rel_l2(got, _emulated(x, quantized, ids, weights, BLOCK, *first, SPEC)) < FLIP_TOL
    got = call(*second)  # the same plan, this call's biases
    assert len(plans) == 1
    assert rel_l2(got, _emulated(x, quantized, ids, weights, BLOCK, *second, SPEC)) < FLIP_TOL
    plain = call(None, None, "silu")  # a plan of its own: no bias, no spec
    assert len(plans) == 2
    assert rel_l2(plain, _emulated(x, quantized, ids, weights, BLOCK, None, None, "silu")) < FLIP_TOL


def test_persistent_gemms_for_a_variant_call_only_where_asked():
    # session 41: the persistent kernels take biases and the spec (test_triton_fp8_interleaved_tma runs them); a tuned
    # entry's persistent GEMMs still never reach a variant call, and interleaved rows on pointer loads are refused
    from moekit.experts.triton_fp8_persistent import Persistent, choose_persistent

    assert choose_persistent(Persistent(), None, False, False, False, False, plain=False) == Persistent()
    with pytest.raises(ValueError, match="persistent fp8 GEMMs do not take interleaved gate/up rows on pointer loads"):
        choose_persistent(Persistent(), None, False, False, False, False, False, interleaved_pointers=True)
    assert choose_persistent(None, Persistent(), False, False, False, False, plain=False) is None  # a tuned entry's
    assert choose_persistent(None, Persistent(), False, False, False, False, plain=True) == Persistent()


def test_bad_biases_and_an_ungated_activation_are_named(fp8):
    x, _, quantized, ids, weights = problem(2, 2, SHAPE, BLOCK, seed=19)
    b13, b2 = _biases(SHAPE, 20)
    with pytest.raises(ValueError, match=r"b13 must have shape \[E=4, 2N=192\]"):
        fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=BLOCK, b13=b13[:, :96])
    with pytest.raises(ValueError, match=r"b2 must have shape \[E=4, K=160\]"):
        fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=BLOCK, b2=b2.T)
    with pytest.raises(TypeError, match="b2 must have x's dtype"):
        fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=BLOCK, b2=b2.double())
    with pytest.raises(ValueError, match="activation must be gated for the fp8 path"):
        fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=BLOCK, activation=ActivationSpec(
            "relu2", gated=False))


def test_quantized_route_runs_fp8_variant_calls_fused(fp8, monkeypatch):
    """``run_experts`` on the triton backend with fp8_block weights, b13, b2 and the spec: the fused kernels (grouped_mm
    patched to fail, no fallback warning), equal to the reference backend's fp8 emulation (bf16 in and out)."""
    import moekit.quant as Q
    from moekit.experts import run_experts
    from moekit.experts.triton_quant import _warn_once

    g = torch.Generator().manual_seed(21)
    (e, hidden, n), m = SHAPE, 5
    w13 = Q.quantize((torch.randn(e, 2 * n, hidden, generator=g) / hidden**0.5).bfloat16(), "fp8_block")
    w2 = Q.quantize((torch.randn(e, hidden, n, generator=g) / n**0.5).bfloat16(), "fp8_block")
    b13, b2 = (b.bfloat16() for b in _biases(SHAPE, 22))
    x = torch.randn(m, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(m)]).int()
    weights = torch.rand(m, 2, generator=g)
    refuse_grouped_mm(monkeypatch)
    _warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_experts(x, w13, w2, ids, weights, activation=SPEC, b13=b13, b2=b2, backend="triton")
    want = run_experts(x, w13, w2, ids, weights, activation=SPEC, b13=b13, b2=b2, backend="reference")
    assert rel_l2(got, want) < 1e-2
    loop = experts_loop(x, w13.dequantize(torch.float64), w2.dequantize(torch.float64), ids, weights, b13=b13, b2=b2,
                        spec=SPEC)
    assert 1e-3 < rel_l2(want, loop) < 0.1  # the reference is fp8's recipe: x and h quantized, a few percent off


def test_tiny_gpt_oss_quantized_to_fp8_block_runs_fused_equal_to_reference(fp8, monkeypatch):
    """A tiny gpt-oss (bf16, random weights, built offline from a transformers config), its MoE blocks swapped, then
    ``moe.quantize_("fp8_block")``: the checkpoint's interleaved gate/up rows, biases and clamped SwiGLU run on the
    fused fp8 kernels (grouped_mm patched to fail, no fallback warning), each block equal to the same block on the
    reference backend."""
    model, swapped = tiny_gpt_oss(None)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for swap, layer in zip(swapped, model.model.layers):
        moe = swap.moe.quantize_("fp8_block")
        assert moe.quant_scheme == "fp8_block" and as_spec(moe.config.activation).interleaved
        assert moe.b13 is not None and moe.b2 is not None
        got, want = triton_and_reference(layer, moe, x, monkeypatch)
        assert rel_l2(got, want) < 1e-2 and want.abs().max() > 0.1  # bf16's rounding, a real signal


def test_a_repeated_variant_call_is_served_lean_equal_to_the_plain_path(fp8, interpreter, monkeypatch):
    """An unbiased call with gpt-oss's spec is kept by ``triton_quant_fast`` (its plan: the spec's, not the plain
    SiLU's): after a call of the kind (the plain path, launches compiled) the next records and later ones are served
    from the kept launches, bit-equal to the plain path and to the float64 emulation; a biased call too (session 41;
    ``tests/test_gpt_oss_fast.py`` has the misses on changed biases): its first call records (its plan's launches
    compiled there), the next two are served, bit-equal to its plain path."""
    import moekit.quant as Q
    from _helpers import count_calls
    from moekit.experts import triton_quant_fast
    from moekit.experts.triton_launch import LaunchOptions

    seen = count_calls(monkeypatch, {"hits": 0}, [(triton_quant_fast, "_launch", "hits")])
    interpreter.clear_launch_caches()
    g = torch.Generator().manual_seed(23)
    (e, hidden, n), m = SHAPE, 3
    q13 = Q.quantize((torch.randn(e, 2 * n, hidden, generator=g) / hidden**0.5).bfloat16(), "fp8_block")
    q2 = Q.quantize((torch.randn(e, hidden, n, generator=g) / n**0.5).bfloat16(), "fp8_block")
    x, weights = torch.randn(m, hidden, generator=g).bfloat16(), torch.rand(m, 2, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(m)]).int()
    b13, b2 = (b.bfloat16() for b in _biases(SHAPE, 24))
    plain = interpreter.experts_triton(x, q13, q2, ids, weights, activation=SPEC,
                                       options=LaunchOptions(lean_launch=False))
    got = [interpreter.experts_triton(x, q13, q2, ids, weights, activation=SPEC) for _ in range(3)]
    assert seen["hits"] == 2 and all(torch.equal(t, plain) for t in got)  # the first records (launches compiled)
    quantized = (q13.q, q13.scale, q2.q, q2.scale)
    assert rel_l2(plain, _emulated(x.float(), quantized, ids, weights, BLOCK, None, None, SPEC)) < 1e-2  # bf16 out
    biased = [interpreter.experts_triton(x, q13, q2, ids, weights, activation=SPEC, b13=b13, b2=b2) for _ in range(3)]
    assert seen["hits"] == 4
    full = interpreter.experts_triton(x, q13, q2, ids, weights, activation=SPEC, b13=b13, b2=b2,
                                      options=LaunchOptions(lean_launch=False))
    assert all(torch.equal(t, full) for t in biased)
    assert rel_l2(full, _emulated(x.float(), quantized, ids, weights, BLOCK, b13.float(), b2.float(), SPEC)) < 1e-2
