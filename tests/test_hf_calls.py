"""The "moekit" transformers experts implementation's repeated eager call (``moekit.hf``, session 32): each module
keeps an unvouched ``ExpertsCallCache``, so the full argument check runs once per weight set, while a call still
shows its routing's shapes, dtypes and devices and the weights at the addresses that passed (a move or a ``.data``
swap is checked again); bad routing raises the check's error after the cache has passed; outputs equal the
checked path's and a float64 loop written here; a model (and a ``MoE``) pickles after a forward. On the triton
backend (interpreted) a repeated decode call is served by the fast path without the check.
"""

import io

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.experts as experts  # noqa: E402
import moekit.hf as moekit_hf  # noqa: E402
from _helpers import count_calls  # noqa: E402


def _model():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("moekit")
    return model


def _call(num_tokens: int, seed: int = 0):
    """x [M, 32], ids [M, 3] int64 (distinct experts), weights [M, 3]: a decode call as transformers makes it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=g)
    ids = torch.rand(num_tokens, 8, generator=g).topk(3, dim=1).indices  # [M, 3] int64
    return x, ids, torch.rand(num_tokens, 3, generator=g)


def _loop64(module, x, ids, weights):
    """out[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), in float64."""
    w13, w2 = module.gate_up_proj.double(), module.down_proj.double()
    n = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:n]) * h[n:]))
    return out


@pytest.fixture
def checks(monkeypatch):
    return count_calls(monkeypatch, {"checks": 0}, [(experts, "check_experts_args", "checks")])


def test_checked_once_per_weight_set(checks):
    module = _model().model.layers[0].mlp.experts
    with torch.no_grad():
        for seed in range(3):
            x, ids, w = _call(1, seed)
            got = module(x, ids, w)
            ref = experts.call_backend(experts.backend_fn("auto", x.device), x, module.gate_up_proj,
                                       module.down_proj, ids, w, activation="silu")
            assert torch.equal(got, ref)
            torch.testing.assert_close(got.double(), _loop64(module, x, ids, w), rtol=1e-4, atol=1e-5)
        assert checks["checks"] == 1 + 3  # the forwards' one, then the reference calls' own (call_backend)
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.detach() * 2)  # a new weight set
        x, ids, w = _call(2, 7)
        torch.testing.assert_close(module(x, ids, w).double(), _loop64(module, x, ids, w), rtol=1e-4, atol=1e-5)
    assert checks["checks"] == 5


def test_moved_weights_are_checked_again(checks):
    module = _model().model.layers[0].mlp.experts
    x, ids, w = _call(2)
    with torch.no_grad():
        module(x, ids, w)
        module.down_proj.data = module.down_proj.data * 3  # what .to() does: the same Parameter, new memory
        got = module(x, ids, w)
    assert checks["checks"] == 2
    torch.testing.assert_close(got.double(), _loop64(module, x, ids, w), rtol=1e-4, atol=1e-5)


def test_bad_routing_raises_after_the_cache_passed():
    module = _model().model.layers[0].mlp.experts
    x, ids, w = _call(2)
    with torch.no_grad():
        module(x, ids, w)
        with pytest.raises(ValueError, match="topk_weights must have the shape of topk_ids"):
            module(x, ids, w[:, :2])
        with pytest.raises(ValueError, match="topk_ids must have shape"):
            module(x, ids[:1], w[:1])
        with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
            module(x, ids.float(), w)


def test_pickles_after_a_forward():
    model = _model()
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        before = model(ids).logits
        buf = io.BytesIO()
        torch.save(model, buf)  # the module's ExpertsCallCache holds weak references
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(ids).logits, before)
    from moekit import MoE, MoEConfig

    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2))
    moe(torch.randn(3, 32))
    buf = io.BytesIO()
    torch.save(moe, buf)


def test_triton_decode_served_by_the_fast_path(monkeypatch, checks):
    pytest.importorskip("triton")
    import moekit.experts.triton_fast as triton_fast

    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "triton")
    monkeypatch.setattr(experts, "_RESOLVED", {})
    hits = count_calls(monkeypatch, {"hits": 0}, [(triton_fast, "launch_lean", "hits")])
    model = _model().to(torch.bfloat16)
    module = model.model.layers[0].mlp.experts
    x, ids, w = _call(1)
    x, w = x.bfloat16(), w.bfloat16()
    with torch.no_grad():
        outs = [module(x, ids, w) for _ in range(4)]  # compiled, kept, then served
    assert hits["hits"] >= 2 and checks["checks"] == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0].double(), _loop64(module, x, ids, w), rtol=2e-2, atol=2e-2)
