"""Weight-only quantized experts under torch.compile on the CPU: a call that needs no gradient runs the eager
quantized loop (only the touched experts) as the opaque op ``moekit::cpu_quant_experts``; one that needs a gradient
traces the whole-dequantize path as before. Checked against a float64 loop written here and against eager."""

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.experts.cpu_packed import clear_packed_weights, repack_cache
from moekit.experts.grouped_mm import experts_grouped_mm
from test_cpu_compile import GPT_OSS, OpRecorder, check_compiled_experts, compiled
from test_cpu_quant import E, SCHEMES, loop64, problem, rel_err


@pytest.mark.parametrize("scheme, options", SCHEMES)
@pytest.mark.parametrize("backend", ["recorder", "inductor"])
def test_compiled_inference_runs_the_op_on_touched_experts_and_equals_eager(scheme, options, backend, monkeypatch):
    x, q13, q2, _, weights = problem(scheme, options, hidden=96, seed=21, gated=True)
    g = torch.Generator().manual_seed(22)
    kwargs = dict(activation=GPT_OSS, b13=torch.randn(E, 64, generator=g), b2=torch.randn(E, 96, generator=g),
                  expert_map=torch.tensor([2, -1, 0, 3, 1, -1, 5, 4]))
    ids = torch.randint(0, 8, weights.shape, generator=g).int()
    want = loop64(x, q13, q2, ids, weights, GPT_OSS, kwargs["b13"], kwargs["b2"], kwargs["expert_map"])
    monkeypatch.setattr(type(q13), "dequantize", lambda *a, **k: pytest.fail("dequantized every expert"))
    with torch.no_grad():
        check_compiled_experts((x, q13, q2, ids, weights), kwargs, want, backend, "moekit.cpu_quant_experts")


def test_compiled_with_gradient_keeps_the_traced_dequantize():
    x, q13, q2, ids, weights = problem("int8_w8a16", {}, seed=23)
    x.requires_grad_(True)
    recorder = OpRecorder()
    got = compiled(experts_grouped_mm, recorder)(x, q13, q2, ids, weights)
    assert not recorder.saw("moekit.cpu_quant_experts")
    got.sum().backward()
    assert x.grad is not None and rel_err(got.detach(), loop64(x.detach(), q13, q2, ids, weights)) < 1e-5


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
def test_compiled_quantized_layer_equals_eager_and_keeps_its_repacked_experts(scheme):
    """A quantized MoE compiled by inductor: its QuantizedWeight tensors reach the op as the module's own, so the
    repack cache (the int8 forms of mxfp4 and int4) fills once and the next call reuses it."""
    cfg = MoEConfig(hidden_size=128, moe_intermediate_size=64, num_experts=E, top_k=2)
    torch.manual_seed(24)
    moe = MoE(cfg).quantize_(scheme)
    x = torch.randn(5, 128)
    clear_packed_weights()
    recorder = OpRecorder()
    with torch.no_grad():
        eager = moe(x)
        traced = compiled(moe, recorder)(x)
        fn = compiled(moe, "inductor")
        first = fn(x)
        used = repack_cache().used_bytes()
        second = fn(x)
    assert recorder.saw("moekit.cpu_quant_experts")
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    # inductor's own code for the gate and router is vectorized for the host: on some hosts it rounds differently
    # from eager (an AMD EPYC: up to 1.2e-7 absolute; the Xeon of earlier sessions: bit-equal), float32 rounding
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert repack_cache().used_bytes() == used and (used > 0) == (scheme != "int8_w8a16")  # int8: codes as stored
    clear_packed_weights()
