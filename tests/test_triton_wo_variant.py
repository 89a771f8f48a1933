"""Expert biases and the activation variant (gpt-oss as it ships: interleaved gate/up rows, alpha 1.702, a clamp,
up + 1) on the weight-only Triton kernels, on the CPU under Triton's interpreter, tiny shapes.

Chain: each variant decode ("tile", "register"; "mma", "gemv": ``test_triton_wo_{mma,gemv}_variant``) with b13 + b2 +
the spec, and with each alone, against a float64 per-token loop (``_helpers.experts_loop``, its glu written out) over
weights decoded by the hand dequantizer of ``test_triton_wo`` (int8 / int4 / mxfp4); the torch twin the same way;
the route: a call with biases or a spec takes a variant decode (never grouped_mm's dequantizing path), a caller's
other decode is an error naming it; a tiny gpt-oss's swapped MXFP4 blocks (interleaved rows as the checkpoint
stores them) on the triton backend equal the same blocks on the reference backend.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import experts_loop, rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from test_triton_wo import POISON, dequant64, problem, rel  # noqa: E402

from moekit.activations import ActivationSpec, as_spec  # noqa: E402

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 32), ("mxfp4", 32)]
# gpt-oss's spec but for the clamp, which bites at these sizes (gate-up outputs near unit size; gpt-oss's is 7.0)
SPEC = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=1.0, up_shift=1.0)
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
PARTS = {"all": (True, True, SPEC), "b13": (True, False, "silu"), "b2": (False, True, "silu"),
         "spec": (False, False, SPEC)}


@pytest.fixture(scope="module")
def wo():
    with interpreted("moekit.experts", "moekit.experts.triton"), \
            interpreted("moekit.experts", "moekit.experts.triton_wo") as module:
        yield module


def _biases(e: int, n: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * n, generator=g), torch.randn(e, hidden, generator=g)  # b13 [E, 2N], b2 [E, K]


def _loop(x, w13, w2, ids, weights, b13, b2, spec, expert_map=None):
    return experts_loop(x, dequant64(w13, x.shape[1]), dequant64(w2, w13.q.shape[1] // 2), ids, weights, expert_map,
                        b13=b13, b2=b2, spec=spec)


def variant_problem(wo, scheme: str, group: int, parts: str, hidden: int, seed: int = 3) -> tuple:
    """(x, w13, w2, ids, weights, b13, b2, spec) of M = 5, k = 2, E = 4, N = 64 with PARTS[parts]'s biases and spec
    (b2 the size of the output: mxfp4's here is ~100)."""
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=hidden, n=64, seed=seed)
    with_b13, with_b2, spec = PARTS[parts]
    b13, b2 = _biases(4, 64, hidden, 9)
    b2 = b2 * _loop(x, w13, w2, ids, weights, None, None, "silu").pow(2).mean().sqrt().float()
    return x, w13, w2, ids, weights, (b13 if with_b13 else None), (b2 if with_b2 else None), spec


def assert_variant(out, x, w13, w2, ids, weights, b13, b2, spec) -> None:
    """``out`` equals the float64 loop with b13 / b2 / spec (fp16 in and out, interpreter dots fp32: rel 1e-3), the
    variant shows against the plain silu and, with SPEC, its clamp bites."""
    want = _loop(x, w13, w2, ids, weights, b13, b2, spec)
    assert rel(out, want) < 1e-3
    assert rel(want, _loop(x, w13, w2, ids, weights, None, None, "silu")) > 0.05
    if spec is SPEC:
        unclamped = ActivationSpec("silu", interleaved=True, alpha=1.702, up_shift=1.0)
        assert rel(want, _loop(x, w13, w2, ids, weights, b13, b2, unclamped)) > 0.01


def run_variant(wo, decode, x, w13, w2, ids, weights, spec, b13, b2, config=None, expert_map=None, split_k=None):
    """``run_experts_wo`` with ``decode`` (None: the route's), poisoned workspaces (the op cannot poison)."""
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, spec, config=config, options=POISON,
                             split_k=split_k, decode=decode, b13=b13, b2=b2)


def built_plans(monkeypatch) -> list:
    """The plans ``triton_wo_plan.build_wo_plan`` builds from here on (patched to keep them; a cached kind builds
    none)."""
    import moekit.experts.triton_wo_plan as plan

    built, real = [], plan.build_wo_plan
    monkeypatch.setattr(plan, "build_wo_plan", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    return built


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("decode", ["tile", "register"])
@pytest.mark.parametrize("parts", list(PARTS))
def test_variant_decodes_match_float64_loop(wo, scheme, group, decode, parts):
    x, w13, w2, ids, weights, b13, b2, spec = variant_problem(wo, scheme, group, parts, hidden=96)
    out = run_variant(wo, decode, x, w13, w2, ids, weights, spec, b13, b2)
    assert_variant(out, x, w13, w2, ids, weights, b13, b2, spec)


@pytest.mark.parametrize("decode", ["tile", "register"])
def test_split_down_adds_b2_once(wo, decode):
    # three splits of the down GEMM's reduction: only split 0 adds b2 (the k-sum adds the partials)
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=3, k=2, hidden=96, n=96, seed=5)
    b13, b2 = _biases(4, 96, 96, 6)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    out = wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", GPT_OSS, options=POISON, split_k=3,
                            decode=decode, b13=b13, b2=b2)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, GPT_OSS)) < 1e-3


@pytest.mark.parametrize("decode", ["tile", "register"])
def test_tiny_batch_shortcut_with_the_variant(wo, decode):
    # M = 1, k = 4 of E = 16 (gpt-oss's M = 1: A * 4 <= E): no alignment, each block one assignment, its expert
    # read from topk_ids (the NAIVE kernels), where b13 / b2 are indexed by that expert
    from moekit.layouts.block_aligned import use_naive

    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=1, k=4, e=16, hidden=96, n=64, seed=13)
    assert use_naive(4, 16, None)
    b13, b2 = _biases(16, 64, 96, 14)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    out = wo.run_experts_wo(x, *args, ids, weights, None, "mxfp4", GPT_OSS, options=POISON, decode=decode, b13=b13,
                            b2=b2 * 50)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2 * 50, GPT_OSS)) < 1e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_twin_with_the_variant_matches_float64_loop(wo, scheme, group):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=6, k=2, hidden=99, n=40, seed=8)
    b13, b2 = _biases(4, 40, 99, 2)
    out = wo.fused_experts_wo_torch(x, w13, w2, ids, weights, activation=SPEC, b13=b13, b2=b2)
    assert rel(out, _loop(x, w13, w2, ids, weights, b13, b2, SPEC)) < 2e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_the_op_takes_biases_and_the_spec(wo, scheme, group):
    # fused_experts_wo (the custom op; the spec crosses it as fields), the chooser's decode, bf16 and strided biases
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=4, k=2, hidden=96, n=64, dtype=torch.bfloat16, seed=11)
    b13, b2 = _biases(4, 64, 96, 12)
    b13_t = b13.to(torch.bfloat16).t().contiguous().t()  # [E, 2N] column-major: read contiguous (a copy)
    out = wo.fused_experts_wo(x, w13, w2, ids, weights, activation=GPT_OSS, b13=b13_t, b2=b2.to(torch.bfloat16))
    want = _loop(x, w13, w2, ids, weights, b13.bfloat16(), b2.bfloat16(), GPT_OSS)
    assert rel(out, want) < 1e-2  # bf16 out


def test_the_op_with_the_variant_passes_opcheck(wo):
    # the schema's trailing b13, b2 and spec fields: the fake, the schema and aot dispatch hold (torch.library.opcheck)
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=3, k=2, hidden=96, n=64, seed=17)
    b13, b2 = _biases(4, 64, 96, 18)
    args = (x, w13.q, w13.scale, w13.zero, 32, w2.q, w2.scale, w2.zero, 32, ids, weights, None, "int4_w4a16", "silu",
            False, "", b13, b2, True, True, 1.702, 7.0, 1.0)
    with torch.no_grad():
        got = torch.ops.moekit.triton_experts_wo(*args)
    assert rel(got, _loop(x, w13, w2, ids, weights, b13, b2, GPT_OSS)) < 1e-3
    torch.library.opcheck(torch.ops.moekit.triton_experts_wo.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_chooser_picks_give_way_to_a_variant_decode(wo, monkeypatch):
    import moekit.experts.triton_wo_plan as plan

    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=2, k=2, hidden=256, n=128, seed=1)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    for pick in ("gemv", "mma", "tile", "register"):
        monkeypatch.setattr(plan, "choose_decode", lambda *a, pick=pick, **k: pick)
        plain = plan._usable_decode(None, *args, "mxfp4", 2, 4, 128, 256, 2, True)
        assert plain == pick  # whole words, groups of 32 fitting the mma: each pick stands without a variant
        assert plan._usable_decode(None, *args, "mxfp4", 2, 4, 128, 256, 2, True, variant=True) == (
            pick if pick in plan.VARIANT_DECODES else "register")


@pytest.mark.parametrize("decode", ["gluon"])  # "scratch", "mma" and "gemv" take them (their own test files)
def test_a_callers_decode_without_the_variant_is_refused(wo, decode):
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=2, k=2, hidden=256, n=128, seed=1)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    b13, _ = _biases(4, 128, 256, 1)
    with pytest.raises(ValueError, match=f"decode='{decode}' takes no expert biases or activation variant"):
        wo.run_experts_wo(x, *args, ids, weights, None, "mxfp4", "silu", decode=decode, b13=b13)


def test_bias_shapes_are_checked(wo):
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=2, k=2, hidden=96, n=64, seed=1)
    with pytest.raises(ValueError, match=r"b13 must be a floating tensor of shape \(4, 128\)"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, b13=torch.zeros(4, 64))
    with pytest.raises(ValueError, match=r"b2 must be a floating tensor of shape \(4, 96\)"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, b2=torch.zeros(4, 96, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation must be gated"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, activation=ActivationSpec("relu2", gated=False))


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
def test_quantized_triton_route_runs_gpt_oss_fused(wo, scheme, monkeypatch):
    """``run_experts`` on the triton backend with gpt-oss's b13, b2 and spec on quantized weights: the fused kernels
    (grouped_mm's dequantizing path, patched to fail, is never taken), against the float64 loop."""
    import moekit.experts.grouped_mm as grouped_mm
    import moekit.quant as Q
    from moekit.experts import run_experts

    def refuse(*args, **kwargs):
        raise AssertionError("grouped_mm's dequantizing path ran")

    monkeypatch.setattr(grouped_mm, "experts_grouped_mm", refuse)
    g = torch.Generator().manual_seed(21)
    e, hidden, n, m = 4, 128, 64, 5
    w13 = Q.quantize((torch.randn(e, 2 * n, hidden, generator=g) / 8).bfloat16(), scheme)
    w2 = Q.quantize((torch.randn(e, hidden, n, generator=g) / 8).bfloat16(), scheme)
    b13, b2 = (b.to(torch.bfloat16) for b in _biases(e, n, hidden, 22))
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(m)]).int()
    weights = torch.rand(m, 2, generator=g)
    got = run_experts(x, w13, w2, ids, weights, activation=SPEC, b13=b13, b2=b2, backend="triton")
    want = experts_loop(x, w13.dequantize(torch.float64), w2.dequantize(torch.float64), ids, weights, b13=b13, b2=b2,
                        spec=SPEC)
    assert rel_l2(got, want) < 1e-2  # bf16 in and out


def test_an_ungated_spec_still_falls_back_naming_it(wo):
    import moekit.quant as Q
    from moekit.experts import run_experts
    from moekit.experts.triton_quant import _warn_once

    g = torch.Generator().manual_seed(3)
    w13 = Q.quantize((torch.randn(2, 64, 64, generator=g) / 8).bfloat16(), "int8_w8a16")  # [E, N, K]
    w2 = Q.quantize((torch.randn(2, 64, 64, generator=g) / 8).bfloat16(), "int8_w8a16")
    x, ids, weights = torch.randn(3, 64, generator=g).bfloat16(), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    spec = ActivationSpec("relu2", gated=False)
    _warn_once.cache_clear()
    with pytest.warns(UserWarning, match="int8_w8a16 weights with the ungated activation spec .* grouped_mm"):
        got = run_experts(x, w13, w2, ids, weights, activation=spec, backend="triton")
    want = experts_loop(x, w13.dequantize(torch.float64), w2.dequantize(torch.float64), ids, weights, spec=spec)
    assert rel_l2(got, want) < 1e-2


def tiny_gpt_oss(quant: str | None):
    """A tiny gpt-oss (bf16, random weights, built offline) whose MoE blocks ``use_moekit_blocks`` swapped on the
    triton backend, quantized with ``quant`` (or not), and its swaps."""
    transformers = pytest.importorskip("transformers")
    import moekit.hf as moekit_hf
    from _swap_helpers import swaps

    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_local_experts=6,
                                    num_experts_per_tok=2, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5)  # biases ~ N(0, 0.25): they count
    model = model.to(torch.bfloat16).eval()
    report = moekit_hf.use_moekit_blocks(model, backend="triton", quant=quant)
    assert len(report.swapped) == 2 and not report.left
    return model, swaps(model)


def refuse_grouped_mm(monkeypatch):
    import moekit.experts.grouped_mm as grouped_mm

    def refuse(*args, **kwargs):
        raise AssertionError("grouped_mm's dequantizing path ran")

    monkeypatch.setattr(grouped_mm, "experts_grouped_mm", refuse)


def triton_and_reference(layer, moe, x, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decoder layer's MoE block on x on the triton backend, grouped_mm patched to fail and any warning an error
    (a fallback warns: ``triton_quant._warn_once``, cleared first); the same block on the reference backend)."""
    import warnings

    from moekit.experts.triton_quant import _warn_once

    refuse_grouped_mm(monkeypatch)
    _warn_once.cache_clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = layer.mlp(x)
    monkeypatch.undo()
    moe.backend = "reference"
    with torch.no_grad():
        want = layer.mlp(x)
    moe.backend = "triton"
    return tuple(t[0] if isinstance(t, tuple) else t for t in (got, want))


def test_tiny_gpt_oss_mxfp4_blocks_on_triton_equal_reference(wo, monkeypatch):
    """The swapped blocks keep the checkpoint's interleaved gate/up rows and biases; on the triton backend (the fused
    kernels: grouped_mm patched to fail) each block equals the same block on the reference backend."""
    model, swapped = tiny_gpt_oss("mxfp4")
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for swap, layer in zip(swapped, model.model.layers):
        moe = swap.moe
        assert moe.quant_scheme == "mxfp4" and as_spec(moe.config.activation).interleaved
        assert moe.b13 is not None and moe.b2 is not None
        got, want = triton_and_reference(layer, moe, x, monkeypatch)
        assert rel_l2(got, want) < 1e-2 and want.abs().max() > 0.1  # bf16's rounding, a real signal


def test_tiny_gpt_oss_mxfp4_layer_traces_whole(wo, monkeypatch):
    """The quantized gpt-oss layer as its compiled forward calls it (``traced_forward``), compiled with
    ``fullgraph=True``: the weight-only op with biases and the spec, no graph break, its eager call's output."""
    from _swap_helpers import eager_and_compiled

    _, swapped = tiny_gpt_oss("mxfp4")
    moe = swapped[0].moe
    refuse_grouped_mm(monkeypatch)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # [T, K]
    eager, compiled = eager_and_compiled(moe, x)
    assert rel_l2(compiled, eager) < 1e-2 and rel_l2(eager, torch.zeros_like(eager)) > 0.5
