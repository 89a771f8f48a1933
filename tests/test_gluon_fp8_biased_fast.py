"""A repeated eager fp8 call with expert biases that the route sends to the fp8 Gluon GEMMs (gpt-oss's: b13 / b2, its
clamped interleaved SwiGLU, N and K past a multiple of 128) keeps a fast-path entry with ``BIASED_FAST`` on (issue
#15, session 43; off by default until the device check has run), as an unbiased one does: from the third call served
from it, bit-equal to the plain launches and within e4m3's rounding of a float64 loop (``_fp8_cases.emulation_f64``);
a bias updated in place, moved, replaced or dropped misses, the full path runs with the call's biases and keeps the
call again. On the CPU: kernels under the interpreter, the Gluon GEMMs as ``_gluon_fakes``' torch stand-ins (the same
tile walk as the kernel)."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import block_experts, emulation_f64
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import count_served, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.activations import ActivationSpec
from moekit.experts.triton_gluon_fp8 import Fp8GluonChoice, experts_gluon_fp8
from moekit.quant.fp8_block import Fp8BlockWeight

GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.6, up_shift=1.0)  # a clamp that bites here
E, N, K, M, TOP_K = 3, 208, 176, 12, 2  # N, K multiples of 16, not of 128
ON = Fp8GluonChoice(min_flops=1, min_rows_per_expert=0, variants=True)  # every call on the Gluon path


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    q = block_experts(g, E, N, K)
    ids = torch.rand(M, E, generator=g).topk(TOP_K, dim=1).indices.int()
    b13, b2 = torch.randn(E, 2 * N, generator=g).bfloat16(), torch.randn(E, K, generator=g).bfloat16()
    return x, q, ids, torch.rand(M, TOP_K, generator=g), b13, b2


def _weights(q):
    return (Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128), dtype=torch.bfloat16),
            Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128), dtype=torch.bfloat16))


@pytest.fixture
def route(fake_gemms, monkeypatch):
    """(call(x, ids, weights, b13, b2) on the ``triton`` backend with ``ON`` as the default choice, [calls served
    by the fp8 Gluon path's entries])."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts import run_experts

    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", ON)
    monkeypatch.setattr(tgf, "BIASED_FAST", True)
    served = count_served(monkeypatch, tgf, "run_fast_fp8")

    def call(w13, w2, x, ids, weights, b13, b2):
        return run_experts(x, w13, w2, ids, weights, backend="triton", activation=GPT_OSS, b13=b13, b2=b2)

    return call, served


def _plain(x, q, ids, weights, b13, b2):
    """The plain launches (built per call, nothing kept) of the same call."""
    return experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2, lean=False)


def test_a_biased_call_is_served_bit_equal_to_the_plain_path(route):
    call, served = route
    x, q, ids, weights, b13, b2 = _problem()
    w13, w2 = _weights(q)
    outs = [call(w13, w2, x, ids, weights, b13, b2) for _ in range(4)]
    assert served == [2]  # the first compiles, the second records and keeps, the third and fourth are served
    plain = _plain(x, q, ids, weights, b13, b2)
    assert all(torch.equal(out, plain) for out in outs)
    assert rel_l2(plain, emulation_f64(x, *q, ids, weights, (128, 128), b13=b13, b2=b2, spec=GPT_OSS)) < 1e-2


@pytest.mark.parametrize("which", ["b13", "b2"])
def test_a_bias_updated_in_place_misses_and_is_kept_again(route, which):
    call, served = route
    x, q, ids, weights, b13, b2 = _problem(1)
    w13, w2 = _weights(q)
    biases = {"b13": b13, "b2": b2}
    for _ in range(3):
        before = call(w13, w2, x, ids, weights, b13, b2)
    assert served == [1]
    biases[which].mul_(-2)  # the same tensor, same address: only its version moves
    after = call(w13, w2, x, ids, weights, b13, b2)
    assert served == [1]  # missed: the full path ran, with the new values
    assert torch.equal(after, _plain(x, q, ids, weights, b13, b2)) and rel_l2(after, before) > 0.05
    assert torch.equal(call(w13, w2, x, ids, weights, b13, b2), after) and served == [2]  # kept again


def test_a_moved_new_or_dropped_bias_misses(route):
    call, served = route
    x, q, ids, weights, b13, b2 = _problem(2)
    w13, w2 = _weights(q)
    for _ in range(3):
        call(w13, w2, x, ids, weights, b13, b2)
    assert served == [1]
    b2.data = b2.data.clone() * 0.5  # moved, other values: the kept launches hold the old address
    moved = call(w13, w2, x, ids, weights, b13, b2)
    assert served == [1] and torch.equal(moved, _plain(x, q, ids, weights, b13, b2))
    other = b13.clone()  # a new tensor, equal values
    assert torch.equal(call(w13, w2, x, ids, weights, other, b2), moved) and served == [1]
    dropped = call(w13, w2, x, ids, weights, None, None)
    assert served == [1] and torch.equal(dropped, _plain(x, q, ids, weights, None, None))
    assert rel_l2(dropped, moved) > 0.05


def test_the_switch_off_keeps_no_biased_call(route, monkeypatch):
    import moekit.experts.triton_gluon_fp8 as tgf

    monkeypatch.setattr(tgf, "BIASED_FAST", False)
    call, served = route
    x, q, ids, weights, b13, b2 = _problem(3)
    w13, w2 = _weights(q)
    outs = [call(w13, w2, x, ids, weights, b13, b2) for _ in range(4)]
    assert served == [0] and all(torch.equal(out, outs[0]) for out in outs)


def test_the_triton_gluon_backend_serves_a_biased_call(fake_gemms, monkeypatch):
    """``experts_triton_gluon`` with an fp8 choice of its own: its key holds that choice; served and bit-equal."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts.triton_gluon import experts_triton_gluon

    monkeypatch.setattr(tgf, "BIASED_FAST", True)
    served = count_served(monkeypatch, tgf, "run_fast_fp8")
    x, q, ids, weights, b13, b2 = _problem(4)
    w13, w2 = _weights(q)
    outs = [experts_triton_gluon(x, w13, w2, ids, weights, activation=GPT_OSS, b13=b13, b2=b2, fp8_choice=ON)
            for _ in range(3)]
    assert served == [1] and all(torch.equal(out, _plain(x, q, ids, weights, b13, b2)) for out in outs)


def test_a_gpt_oss_layer_in_fp8_is_served(route):
    """The real client's call: a gpt-oss MoE layer from a transformers config (random weights and biases) with its
    experts quantized by ``MoE.quantize_("fp8_block")``; its repeated eager forward is served from the entry and equals
    the forward with the switch off."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts.triton_fast import clear_fast
    from moekit.hf import moe_from_hf

    transformers = pytest.importorskip("transformers")
    _, served = route
    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=K, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, intermediate_size=N, num_hidden_layers=1, num_local_experts=E,
                                    num_experts_per_tok=TOP_K)
    torch.manual_seed(0)
    block = transformers.GptOssForCausalLM(cfg).model.layers[0].mlp.to(torch.bfloat16).eval()
    layer = moe_from_hf(block, backend="triton").eval()
    layer.quantize_("fp8_block")
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert layer.config.activation == ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
    with torch.no_grad():
        layer.b13.copy_(torch.randn_like(layer.b13) * 0.5), layer.b2.copy_(torch.randn_like(layer.b2) * 0.5)
        outs = [layer(x) for _ in range(4)]
        assert served == [2] and all(torch.equal(out, outs[0]) for out in outs)
        tgf.BIASED_FAST = False  # (the fixture's monkeypatch restores it)
        clear_fast()
        assert torch.equal(layer(x), outs[0]) and served == [2]
