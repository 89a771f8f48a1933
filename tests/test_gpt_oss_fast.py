"""gpt-oss's eager decode on the fast paths, under Triton's interpreter: expert biases (b13 [E, 2N], b2 [E, K]), the
router Linear's bias and the clamped, interleaved SwiGLU (alpha 1.702, limit 7, up_shift 1). A repeated call is served
by the experts op's kept entry (bf16: ``triton_fast``; mxfp4, int4, fp8_block: ``triton_quant_fast``) and by the
layer's decode fast path (``layer_fast``, bf16), equal bit for bit to the full path and within bf16 (fp8_block: its
recipe's e4m3 x and h) of a float64 loop written here;
an in-place bias update, a new bias tensor, a moved bias (``.data`` swapped), a bias dropped and a spec change each
miss, running the full path with the call's own biases and spec."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from _helpers import TOLERANCE as TOL, count_calls, count_served, rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit import layer_fast  # noqa: E402
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.quant import quantize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

E, K, N, TOP_K = 4, 64, 32, 2  # 32-wide groups for mxfp4 / int4; 16-byte rows in bf16
GPT_OSS = ActivationSpec(name="silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
PLAIN = LaunchOptions(lean_launch=False)  # the full path's BoundLaunch calls, never kept
QTOL = 2e-2  # the weight-only paths keep bf16 x and h (tests/test_triton_quant_fast.py)
# fp8_block's recipe rounds x and h to e4m3 per 128 columns: a few percent off the loop on the dequantized weights
# (tests/test_triton_fp8_variant.py holds the path to a float64 emulation of that recipe)
FP8TOL = 6e-2


@pytest.fixture(scope="module", autouse=True)
def tri():
    with interpreted("moekit.routing", "moekit.routing.fused"), \
            interpreted("moekit.experts", "moekit.experts.triton") as module:
        yield module


@pytest.fixture
def counts(tri, monkeypatch):
    """The calls each path served: the bf16 kept entries' launches, the quantized ones', the layer's fast path."""
    from moekit.experts import triton_fast, triton_quant_fast

    seen = count_calls(monkeypatch, {"bf16": 0, "quant": 0}, [
        (triton_fast, "launch_lean", "bf16"), (triton_quant_fast, "_launch", "quant")])
    seen["layer"] = 0
    real = layer_fast.DecodeFast.__call__

    def counted(self, layer, x2d):
        out = real(self, layer, x2d)
        seen["layer"] += out is not None
        return out

    monkeypatch.setattr(layer_fast.DecodeFast, "__call__", counted)
    tri.clear_launch_caches()
    return seen


def _loop(x, w13, w2, b13, b2, ids, weights, spec: ActivationSpec = GPT_OSS) -> torch.Tensor:
    """float64: sum_j weights[t, j] * (w2[e] @ swiglu(w13[e] @ x[t] + b13[e]) + b2[e]), gpt-oss's clamped SwiGLU on
    interleaved gate/up rows."""
    x, w13, w2, b13, b2, weights = (t.double() for t in (x, w13, w2, b13, b2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t] + b13[e]
            gate, up = h[0::2].clamp(max=spec.limit), h[1::2].clamp(-spec.limit, spec.limit)
            y = w2[e] @ (gate * torch.sigmoid(spec.alpha * gate) * (up + spec.up_shift)) + b2[e]
            out[t] += weights[t, j] * y
    return out


def _problem(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    b13 = (torch.randn(E, 2 * N, generator=g) * 0.5).bfloat16()
    b2 = (torch.randn(E, K, generator=g) * 0.5).bfloat16()
    ids = torch.rand(m, E, generator=g).argsort(dim=1)[:, :TOP_K].int()
    weights = torch.softmax(torch.rand(m, TOP_K, generator=g), dim=1)
    return x, w13, w2, b13, b2, ids, weights


def _weights(scheme: str, w13, w2):
    if scheme == "bf16":
        return w13, w2
    options = {"int4_w4a16": dict(group_size=32)}.get(scheme, {})
    return quantize(w13, scheme, **options), quantize(w2, scheme, **options)


def _tol(scheme: str) -> float:
    return {"bf16": TOL[torch.bfloat16], "fp8_block": FP8TOL}.get(scheme, QTOL)


def _dense(w):
    return w if isinstance(w, torch.Tensor) else w.dequantize()


@pytest.mark.parametrize("scheme, m", [("bf16", 1), ("bf16", 4), ("mxfp4", 1), ("mxfp4", 4), ("int4_w4a16", 1),
                                       ("fp8_block", 1), ("fp8_block", 4)])
def test_op_serves_biased_gpt_oss_calls_equal_to_full_path(counts, tri, scheme, m):
    x, w13, w2, b13, b2, ids, weights = _problem(m)
    q13, q2 = _weights(scheme, w13, w2)
    key = "bf16" if scheme == "bf16" else "quant"
    full = tri.experts_triton(x, q13, q2, ids, weights, activation=GPT_OSS, b13=b13, b2=b2, options=PLAIN)
    assert rel_l2(full, _loop(x, _dense(q13), _dense(q2), b13, b2, ids, weights)) < _tol(scheme)
    for call in range(4):  # the first keeps the entry (the quantized path records on its second); then served
        got = tri.experts_triton(x, q13, q2, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
        assert torch.equal(got, full), call
    assert counts[key] >= 2


def _served(counts, key: str, call) -> tuple[torch.Tensor, int]:
    before = counts[key]
    out = call()
    return out, counts[key] - before


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4", "fp8_block"])
def test_op_misses_on_changed_biases_or_spec(counts, tri, scheme):
    """Each change misses once (the full path runs with the call's own biases and spec, and keeps it again)."""
    x, w13, w2, b13, b2, ids, weights = _problem(2, seed=1)
    q13, q2 = _weights(scheme, w13, w2)
    key = "bf16" if scheme == "bf16" else "quant"
    state = {"b13": b13, "b2": b2, "spec": GPT_OSS}

    def call(options=LaunchOptions()):
        return tri.experts_triton(x, q13, q2, ids, weights, activation=state["spec"], b13=state["b13"],
                                  b2=state["b2"], options=options)

    for _ in range(3):
        call()
    _, hit = _served(counts, key, call)
    assert hit == 1

    def changed(change) -> None:
        change()
        full = call(PLAIN)
        got, hit = _served(counts, key, call)
        assert hit == 0 and torch.equal(got, full)
        for _ in range(2):  # kept again: served with the new values
            got, hit = _served(counts, key, call)
        assert hit == 1 and torch.equal(got, full)

    changed(lambda: state["b13"].add_(0.25))  # in place: the version moves
    changed(lambda: state.update(b2=state["b2"] * 2))  # a new tensor
    changed(lambda: setattr(state["b13"], "data", state["b13"].clone()))  # moved: same object, new address
    changed(lambda: state.update(spec=dataclasses.replace(GPT_OSS, alpha=1.5)))
    changed(lambda: state.update(b2=None))
    assert rel_l2(call(), _loop(x, _dense(q13), _dense(q2), state["b13"], torch.zeros(E, K), ids, weights,
                                state["spec"])) < _tol(scheme)


def _gpt_oss_layer(scheme: str = "bf16"):
    """(layer, full): a gpt-oss-20b MoE layer at tiny widths from a transformers config with random weights and
    biases, its router fused, its experts quantized to ``scheme`` (bf16: as they are); ``full`` the same weights, its
    decode fast path off."""
    from moekit.hf import moe_from_hf

    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=K, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, intermediate_size=N, num_hidden_layers=1, num_local_experts=E,
                                    num_experts_per_tok=TOP_K)
    torch.manual_seed(0)
    block = transformers.GptOssForCausalLM(cfg).model.layers[0].mlp.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)
    layers = []
    for _ in range(2):
        layer = moe_from_hf(block, backend="triton").eval()
        layer.router = "fused"
        if scheme != "bf16":
            layer.quantize_(scheme)
        layers.append(layer)
    layers[1]._decode = _Never()
    return layers


class _Never(layer_fast.DecodeFast):
    """A ``DecodeFast`` that keeps nothing: the full forward every time."""

    def keep(self, layer, x2d) -> None:
        return None


@pytest.mark.parametrize("scheme, m", [("bf16", 1), ("bf16", 4), ("mxfp4", 1), ("mxfp4", 4)])
def test_layer_fast_path_serves_gpt_oss_decode(counts, scheme, m):
    layer, full = _gpt_oss_layer(scheme)
    assert layer.config.activation == GPT_OSS and layer.gate.bias is not None and layer.b2.shape == (E, K)
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
            got, want = layer(x), full(x)
            assert torch.equal(got, want), seed
            routing = full.route_tokens(x).routing
            ref = _loop(x, _dense(layer.w13), _dense(layer.w2), layer.b13, layer.b2, routing.topk_ids,
                        routing.topk_weights)
            assert rel_l2(got, ref) < (TOL[torch.bfloat16] if scheme == "bf16" else QTOL)
    assert counts["layer"] == 3 and list(layer._decode._entries) == [m]


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4"])
def test_layer_experts_call_misses_on_changed_biases_or_weights(counts, monkeypatch, scheme):
    """The experts' call the layer's fast path makes (bf16: its ``KeptCall``; quantized: the op's kept entry) misses
    on an in-place bias update or a moved bias (the layer's own experts call runs them); a new bias Parameter, or new
    quantized weights, misses the layer's entry (the full forward runs)."""
    from moekit.experts import triton_fast, triton_quant_fast

    layer, full = _gpt_oss_layer(scheme)
    if scheme == "bf16":
        served = count_served(monkeypatch, triton_fast.KeptCall, "__call__")
    else:
        served, real = [0], triton_quant_fast._launch

        def kept(entry, *args):
            served[0] += entry.w13() is layer.w13
            return real(entry, *args)

        monkeypatch.setattr(triton_quant_fast, "_launch", kept)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).bfloat16()

    def run() -> tuple[int, int]:
        kept_before, layer_before = served[0], counts["layer"]
        assert torch.equal(layer(x), full(x))
        return served[0] - kept_before, counts["layer"] - layer_before

    with torch.no_grad():
        run(), run()
        assert run() == (1, 1)
        layer.b13.add_(0.5), full.b13.add_(0.5)
        assert run() == (0, 1)  # the layer's path, the experts through the layer's own call
        run()
        assert run() == (1, 1)
        layer.b2.data = layer.b2.data.clone()  # moved
        assert run() == (0, 1)
        run()
        new = torch.nn.Parameter(layer.b2.detach() * 2, requires_grad=False)
        layer.b2, full.b2 = new, torch.nn.Parameter(new.detach().clone(), requires_grad=False)
        assert run() == (0, 0)  # a new tensor: the layer's entry misses
        run(), run()
        assert run() == (1, 1)
        if scheme != "bf16":  # a new quantized weight object (the same tensors): the layer's entry misses
            layer.w13 = copy.copy(layer.w13)
            assert run() == (0, 0)
