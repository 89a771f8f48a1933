"""The gate GEMM kernel (``moekit.routing.gate``) on the CPU under Triton's interpreter, against a float64
matmul written here: the fp32 multiply-and-sum of up to MAX_TOKENS rows (F.linear beyond),
bias, ragged K and E, the cases it hands back to F.linear, and that a kind of call kept bound follows
a replaced, updated or recast weight. bf16 rounding and tensor-core accumulation on the GPU:
``benchmarks/layer_host_device_check.py``."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig

triton = pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to max |logit|; bf16: 8 bits


@pytest.fixture(scope="module", autouse=True)
def gate():
    with interpreted("moekit.routing", "moekit.routing.fused"):
        import moekit.routing.gate as module

        yield module


def reference(x, w, b=None):
    """float64 x @ w^T + b, one output at a time."""
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        for e in range(w.shape[0]):
            out[t, e] = (x[t].double() * w[e].double()).sum() + (0.0 if b is None else float(b[e]))
    return out


def assert_close(got, want, dtype):
    assert got.dtype == dtype
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale


# M = 1, 3, 4, 6, 8 (MAX_TOKENS): one row, padded row blocks, full ones
CASES = [(m, dt) for m in (1, 3, 4, 6, 8) for dt in TOL]


@pytest.mark.parametrize("num_tokens,dtype", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(gate, num_tokens, dtype, with_bias):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 40, generator=g).to(dtype)  # K = 40: a ragged last K step
    w = torch.randn(12, 40, generator=g).to(dtype)  # E = 12: a ragged expert tile
    b = torch.randn(12, generator=g).to(dtype) if with_bias else None
    assert_close(gate.gate_logits(x, w, b), reference(x, w, b), dtype)


@pytest.mark.parametrize("num_tokens,hidden,experts", [(3, 2100, 5), (4, 200, 40)])
def test_many_programs_and_k_steps(gate, num_tokens, hidden, experts):
    """Ragged expert tiles over several programs and ragged K steps: M = 3 (2 experts x 2048 columns a
    tile: 3 programs, 2 steps), M = 4 (16 experts x 256 columns a tile: 3 programs, one ragged step)."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.randn(experts, hidden, generator=g).to(torch.bfloat16)
    assert_close(gate.gate_logits(x, w), reference(x, w), torch.bfloat16)


def test_strided_rows(gate):
    """x and W as row slices of wider tensors (leading stride != K), x not 16-byte aligned."""
    x_wide, w_wide = torch.randn(3, 50), torch.randn(12, 48)
    x, w = x_wide[:, 1:41], w_wide[:, :40]
    assert_close(gate.gate_logits(x, w), reference(x, w), torch.float32)


def test_empty_batch(gate):
    out = gate.gate_logits(torch.empty(0, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16))
    assert out.shape == (0, 4) and out.dtype == torch.bfloat16


def test_hands_back_to_linear(gate):
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert gate.gate_logits(x, w.double()) is None  # mixed dtypes
    assert gate.gate_logits(x.double(), w.double()) is None  # float64
    assert gate.gate_logits(torch.randn(8, 2).t(), w) is None  # last dim not contiguous
    rows = gate.MAX_TOKENS + 1
    assert gate.gate_logits(torch.randn(rows, 8), w) is None  # past the decode sizes: cuBLAS is faster there
    assert gate.gate_logits(x, w.requires_grad_()) is None  # autograd
    with torch.no_grad():
        assert gate.gate_logits(x, w) is not None


def test_bound_call_follows_the_weight(gate):
    """A kind of call is bound once; the weight is passed on every call: replaced, updated in place or
    recast, the logits follow (each checked against a fresh reference)."""
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert_close(gate.gate_logits(x, w), reference(x, w), torch.bfloat16)
    w.mul_(-3.0)  # in place
    assert_close(gate.gate_logits(x, w), reference(x, w), torch.bfloat16)
    w2 = torch.randn(8, 16, dtype=torch.bfloat16)  # replaced
    assert_close(gate.gate_logits(x, w2), reference(x, w2), torch.bfloat16)
    x32, w32 = x.float(), w2.float()  # recast: another kind of call
    assert_close(gate.gate_logits(x32, w32), reference(x32, w32), torch.float32)


def test_layer_gate_on_the_kernel(gate, monkeypatch):
    """MoE(router="fused") computes its logits on the kernel, and they follow the gate weight through
    replacement, in-place update and a dtype change; router="torch" keeps F.linear."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2)
    layer = MoE(cfg, backend="reference", router="fused", dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(layer, "_gate_fn", lambda *a: calls.append(1) or gate.gate_logits(*a))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_close(layer._router_logits(x), reference(x, layer.gate.weight), torch.bfloat16)
        layer.gate.weight.mul_(2.0)
        assert_close(layer._router_logits(x), reference(x, layer.gate.weight), torch.bfloat16)
        layer.gate.weight = torch.nn.Parameter(torch.randn(8, 16, dtype=torch.bfloat16))
        assert_close(layer._router_logits(x), reference(x, layer.gate.weight), torch.bfloat16)
    assert len(calls) == 3
    layer = layer.float()  # a move re-resolves the gate: the kernel again, in fp32
    assert layer._gate_fn is gate.gate_logits
    with torch.no_grad():
        assert_close(layer._router_logits(x.float()), reference(x, layer.gate.weight), torch.float32)
    assert MoE(cfg, backend="reference", router="torch")._gate_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_into_is_f_linear(gate, dtype, with_bias):
    """Above MAX_TOKENS rows: torch.mm / addmm into the kept buffer, bit-equal to F.linear (the ops it runs) and
    close to the float64 loop; None (F.linear) under autograd and for mixed dtypes."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 40, generator=g).to(dtype), torch.randn(12, 40, generator=g).to(dtype)
    b = torch.randn(12, generator=g).to(dtype) if with_bias else None
    out = torch.full((9, 12), float("nan"), dtype=dtype)
    got = gate.linear_into(x, w, b, out)
    assert got is out and torch.equal(out, torch.nn.functional.linear(x, w, b))
    assert_close(out, reference(x, w, b), dtype)
    assert gate.linear_into(x, w.double(), b, out) is None
    assert gate.linear_into(x, w.requires_grad_(), b, out) is None


def test_layer_gate_above_the_kernel_writes_the_kept_logits(gate):
    """MoE.forward at M > MAX_TOKENS: the gate writes the workspace's logits through linear_into, and the output
    equals the layer's with F.linear there."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2)
    layer = MoE(cfg, backend="reference", router="fused")
    x = torch.randn(7, 16)
    with torch.no_grad():
        out = layer(x)
        kept = next(iter(layer._route_ws._buffers.values())).logits
        torch.testing.assert_close(kept.double(), reference(x, layer.gate.weight), rtol=1e-5, atol=1e-5)
        layer._gate_mm = None
        assert torch.equal(layer(x), out)
