"""``MoE.quantize_`` on a layer that fuses its shared expert (``fuse_shared=True``, the default): DeepSeek-V3's
layer as a user builds it quantizes at the first try, the shared expert un-fused into the separate MLP in the model
dtype. Held against (a) the same weights built ``fuse_shared=False`` and quantized the same way and (b) a float64
per-token loop over the dequantized routed weights plus the shared MLP read off the fused slots before quantizing.
Shapes: K=64 hidden, N=32, E=16 routed experts, k=4, S=2 shared slots (shared width 2N)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from _parallel_harness import run_ranks
from _quant_refs import fake_fp8_rows, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (the Triton kernels under the interpreter)

import moekit.quant as Q
from moekit.config import MoEConfig
from moekit.layer import MoE

# DeepSeek-V3's routing (sigmoid, groups, correction bias, scaled weights) at tiny widths, two shared slots
TINY_V3 = MoEConfig.preset("deepseek-v3").replace(hidden_size=64, moe_intermediate_size=32, num_experts=16, top_k=4,
                                                  n_group=4, topk_group=2, shared_expert_intermediate_size=64)
E, N, S = 16, 32, 2


def _fused(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(TINY_V3, backend="reference", **kwargs)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
    return moe


def _slot_mlp(moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused shared expert as one MLP, float64, from its slots E..E+S-1 (each [gate N rows; up N rows]):
    (w_gate_up [2SN, K] with every slot's gate rows first, w_down [K, SN])."""
    slots13, slots2 = moe.w13[E:].detach().double(), moe.w2[E:].detach().double()
    gate = torch.cat([slots13[s, :N] for s in range(S)])
    up = torch.cat([slots13[s, N:] for s in range(S)])
    return torch.cat([gate, up]), torch.cat([slots2[s] for s in range(S)], dim=1)


def _unfused_twin(fused: MoE) -> MoE:
    """The same function built with ``fuse_shared=False``, its weights copied from the fused layer by hand."""
    twin = MoE(TINY_V3, backend="reference", fuse_shared=False)
    shared13, shared2 = _slot_mlp(fused)
    with torch.no_grad():
        twin.gate.weight.copy_(fused.gate.weight)
        twin.e_score_correction_bias.copy_(fused.e_score_correction_bias)
        twin.w13.copy_(fused.w13[:E])
        twin.w2.copy_(fused.w2[:E])
        twin.shared_w13.copy_(shared13)
        twin.shared_w2.copy_(shared2)
    return twin


def _per_token(moe: MoE, x: torch.Tensor, shared13: torch.Tensor, shared2: torch.Tensor, fp8: bool) -> torch.Tensor:
    """float64: each token's routed experts (the layer's routing) on the dequantized weights (fp8: activations
    quantized 1x128 before each GEMM), plus the shared MLP with weight 1."""
    routing = moe.route_tokens(x).routing
    w13, w2 = moe.w13.dequantize(torch.float64), moe.w2.dequantize(torch.float64)
    act = fake_fp8_rows if fp8 else (lambda t: t.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(routing.topk_ids[t].tolist(), routing.topk_weights[t].tolist()):
            h = act(x[t:t + 1]) @ w13[e].t()  # [1, 2N]
            out[t] += w * (act(F.silu(h[:, :N]) * h[:, N:]) @ w2[e].t())[0]
        h = x[t:t + 1].double() @ shared13.t()  # [1, 2SN]
        out[t] += ((F.silu(h[:, :S * N]) * h[:, S * N:]) @ shared2.t())[0]
    return out


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_a_fused_shared_layer_quantizes_as_the_unfused_one(scheme):
    fused, x = _fused(), torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    assert fused.fuse_shared and fused.w13.shape[0] == E + S
    shared13, shared2 = _slot_mlp(fused)
    twin = _unfused_twin(fused).quantize_(scheme)
    with torch.no_grad():
        assert fused.quantize_(scheme) is fused and fused.quant_scheme == scheme
        got, want = fused(x), twin(x)
        assert not fused.fuse_shared and fused.w13.shape[0] == E and fused.b13 is None
        assert fused.shared_w13.dtype == torch.float32 and isinstance(fused.shared_w13, torch.nn.Parameter)
        assert torch.equal(fused.shared_w13, twin.shared_w13) and torch.equal(fused.shared_w2, twin.shared_w2)
        assert torch.equal(fused.w13.tensors()["q"], twin.w13.tensors()["q"])  # the routed rows quantized alike
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert rel_l2(got, _per_token(fused, x, shared13, shared2, scheme == "fp8_block")) < 1e-5
    names = [name for name, _ in fused.named_parameters()]
    assert "shared_w13" in names and "shared_w2" in names and "w13" not in names


def test_the_full_size_preset_quantizes_at_the_first_try():
    """``MoE(MoEConfig.preset("deepseek-v3")).quantize_("fp8_block")`` as a user writes it, at a width the CPU
    holds: the preset's own routing and one shared slot of width N."""
    cfg = MoEConfig.preset("deepseek-v3").replace(hidden_size=128, moe_intermediate_size=128,
                                                  shared_expert_intermediate_size=128)
    moe = MoE(cfg).quantize_("fp8_block")
    assert moe.quant_scheme == "fp8_block" and moe.w13.shape == (256, 256, 128)
    assert moe.shared_w13.shape == (256, 128) and "separate" in repr(moe)
    with torch.no_grad():
        assert torch.isfinite(moe(torch.randn(3, 128))).all()


def test_a_refused_option_leaves_the_layer_fused():
    moe = _fused()
    w13 = moe.w13.detach().clone()
    with pytest.raises(ValueError, match="not options of scheme"):
        moe.quantize_("mxfp4", group_size=32)
    assert moe.fuse_shared and moe.shared_w13 is None and torch.equal(moe.w13, w13)


@pytest.mark.parametrize("scheme", ["int4_w4a16", "fp8_block"])
def test_its_state_dict_loads_into_a_layer_built_fused_and_quantized_alike(scheme):
    saved = _fused().quantize_(scheme)
    buf = io.BytesIO()
    torch.save(saved.state_dict(), buf)
    buf.seek(0)
    loaded = _fused(seed=7).quantize_(scheme)
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), saved(x))


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_the_triton_backend_runs_the_quantized_fused_shared_layer(scheme, interpreter):
    """Under the interpreter, bf16: the triton backend on the un-fused quantized layer equals the reference one."""
    moe = _fused(dtype=torch.bfloat16).quantize_(scheme)
    x = torch.randn(4, 64).bfloat16()
    with torch.no_grad():
        ref = moe(x)
        moe.backend = "triton"
        assert rel_l2(moe(x), ref) < 1e-2  # bf16 in and out


@torch.no_grad()
def _ep_ranks(rank: int, world_size: int) -> float:
    from moekit.parallel import EPMoE

    moe = _fused()
    ep = EPMoE.from_moe(moe)
    assert ep.fuse_shared
    x = torch.randn(2 * world_size + 3, 64, generator=torch.Generator().manual_seed(5))[rank::world_size]
    ep.quantize_("int8_w8a16")
    moe.quantize_("int8_w8a16")
    assert not ep.fuse_shared
    return rel_l2(ep(x), moe(x))


def test_an_ep_layer_with_a_fused_shared_expert_quantizes_as_the_whole_layer():
    assert all(err < 1e-6 for err in run_ranks(_ep_ranks, 2, timeout_s=120))



def _gpt_oss_glu(h: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved columns (2i gate i, 2i + 1 up i), written here: [M, 2W] -> [M, W]."""
    gate, up = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
    return (up + 1.0) * gate * torch.sigmoid(1.702 * gate)


def test_an_interleaved_activation_keeps_its_shared_rows_in_order():
    """gpt-oss's interleaved spec on a fused shared expert: quantize_ un-fuses the slots in their row order (split as
    gate rows then up rows they would compute another function; found merging usr44's un-fusing with fuz44's fix of
    the same split in OffloadedMoE, session 44). The separate MLP it leaves, against the fused slots before, float64."""
    from moekit.activations import ActivationSpec

    spec = ActivationSpec(name="silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
                    shared_expert_intermediate_size=64, activation=spec)
    torch.manual_seed(0)
    moe = MoE(cfg, backend="reference")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).double()
    slots13, slots2 = moe.w13[8:].detach().double(), moe.w2[8:].detach().double()  # [S, 2N, K], [S, K, N]
    want = sum(_gpt_oss_glu(x @ slots13[s].t()) @ slots2[s].t() for s in range(2))  # [6, K]
    moe.quantize_("int8_w8a16")
    assert not moe.fuse_shared and moe.shared_w13.shape == (128, 64)
    got = _gpt_oss_glu(x @ moe.shared_w13.detach().double().t()) @ moe.shared_w2.detach().double().t()
    assert rel_l2(got, want) < 1e-12
