"""The one-launch fp8_block experts kernel (``triton_decode_one_fp8``) under Triton's interpreter: against a
float64 loop written here (x and h quantized per token per 128 columns with torch's e4m3 rounding, weights
dequantized in float64), and against the fp8 path's torch twin. Programs run in program-id order there, so
ticket order is program order (``test_triton_decode_one``'s docstring)."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreter  # noqa: F401
from moekit.experts.triton_launch import LaunchOptions
from moekit.quant.fp8_block import quantize_fp8_block

E, N, K, G = 4, 256, 384, 128  # two scale blocks of N, three of K; tiles below leave a partial last step
IDS = {(1, 2): [[1, 3]], (2, 2): [[1, 3], [3, 0]], (1, 4): [[3, 1, 0, 2]], (2, 8): [[0, 1, 2, 3, 0, 1, 2, -1]] * 2}


def _fake_quant(v: torch.Tensor) -> torch.Tensor:
    """v [C] (float64) quantized per G columns as the fp8 recipe says (s = amax / 448, e4m3 nearest), back to float64."""
    groups = v.float().view(-1, G)
    amax = groups.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return ((groups / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()).view(-1)


def float64_loop(x, w13, w2, ids, weights) -> torch.Tensor:
    w13d, w2d = w13.dequantize(torch.float64), w2.dequantize(torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = _fake_quant(x[t].double())
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13d.shape[0]:
                continue
            gate, up = w13d[e, :N] @ xq, w13d[e, N:] @ xq
            h = gate * torch.sigmoid(gate) * up
            out[t] += float(weights[t, j]) * (w2d[e] @ _fake_quant(h))
    return out


def _inputs(m: int, k: int):
    g = torch.Generator().manual_seed(m * 10 + k)
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    w13 = quantize_fp8_block(torch.randn(E, 2 * N, K, generator=g) / K**0.5)
    w2 = quantize_fp8_block(torch.randn(E, K, N, generator=g) / N**0.5)
    return x, w13, w2, torch.tensor(IDS[(m, k)]), torch.rand(m, k, generator=g)


@pytest.mark.parametrize("tiles", [1, 4])  # down tiles per program: 384 / 64 = 6 tiles; 4: the last 2 past K
@pytest.mark.parametrize("mk", sorted(IDS), ids=lambda mk: f"M{mk[0]}k{mk[1]}")
def test_matches_float64_loop_and_twin(interpreter, mk, tiles):  # noqa: F811
    from moekit.experts.triton_decode_one import _ARENAS, DecodeOneConfig
    from moekit.experts.triton_decode_one_fp8 import run_decode_one_fp8
    from moekit.experts.triton_fp8 import fused_experts_fp8_torch

    x, w13, w2, ids, weights = _inputs(*mk)
    config = DecodeOneConfig(block_n_up=32, block_k_up=256, block_k_out=64, block_n_red=256, down_tiles=tiles)  # K: 256+128
    out = run_decode_one_fp8(x, w13, w2, ids, weights, config)
    # one e4m3 rounding flip of an h element moves an output by ~1/16 of that term: a loose bound against float64
    torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, weights), rtol=2e-2, atol=2e-2)
    twin = fused_experts_fp8_torch(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights)
    torch.testing.assert_close(out.float(), twin.float(), rtol=1.6e-2, atol=1e-2)  # a bf16 rounding apart
    assert torch.equal(out, run_decode_one_fp8(x, w13, w2, ids, weights, config))
    assert all(int(a.abs().sum()) == 0 for a in _ARENAS.values())


def test_option_routes_fp8_calls(interpreter, monkeypatch):  # noqa: F811
    import moekit.experts.triton_decode_one_fp8 as d1

    calls = []
    real = d1.run_decode_one_fp8
    monkeypatch.setattr(d1, "run_decode_one_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w13, w2, ids, weights = _inputs(1, 2)
    out = interpreter.experts_triton(x, w13, w2, ids, weights, options=LaunchOptions(decode_one=True))
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, weights), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["block", "tiles", "tail"])
def test_refusals(interpreter, case):  # noqa: F811
    from moekit.experts.triton_decode_one import DecodeOneConfig
    from moekit.experts.triton_decode_one_fp8 import decode_one_fp8_refusal

    x, w13, w2, ids, _ = _inputs(1, 2)
    config = None
    if case == "block":
        w13 = quantize_fp8_block(torch.randn(E, 2 * N, K) / K**0.5, block_shape=(64, 64))
    elif case == "tiles":
        config = DecodeOneConfig(block_n_up=256)
    else:
        x = x[:, :K - 64].contiguous()
    assert decode_one_fp8_refusal(x, w13, w2, ids, config=config)
