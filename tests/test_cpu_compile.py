"""The CPU experts under torch.compile: a call that needs no gradient runs the eager loop as the opaque op
``moekit::cpu_experts``; one that needs a gradient traces the grouped GEMM path (quantized weights:
``test_cpu_quant_compile.py``). Checked against a float64 (token, slot) loop (``_helpers.experts_loop``) and against the
eager call."""

import pytest
import torch

from _helpers import experts_loop
from moekit import MoE, MoEConfig
from moekit.activations import ActivationSpec
from moekit.experts.cpu_packed import clear_packed_weights, packed_weight_cache
from moekit.experts.grouped_mm import experts_grouped_mm

E, N, K = 6, 8, 16
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)


def rel_err(got, want):
    return float((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30))


def problem(m, top_k, seed, num_experts=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    w13 = torch.randn(num_experts, 2 * N, K, generator=g) * K**-0.5
    w2 = torch.randn(num_experts, K, N, generator=g) * N**-0.5
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(m)])
    ids[0, 0] = -1  # a skipped slot
    return x, w13, w2, ids, torch.rand(m, top_k, generator=g)


class OpRecorder:
    """A torch.compile backend that records the ops of every graph it gets, then runs the graph as traced."""

    def __init__(self):
        self.ops: list[str] = []
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops += [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return gm.forward

    def saw(self, name: str) -> bool:
        return any(name in op for op in self.ops)


def compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def check_compiled_experts(args: tuple, kwargs: dict, want: torch.Tensor, backend: str, op: str) -> None:
    """``experts_grouped_mm(*args, **kwargs)`` compiled fullgraph on ``backend`` ("recorder": an ``OpRecorder``, whose
    one graph must call ``op`` and never group_gemm) is finite, within 1e-5 of the float64 ``want`` and equal to the
    eager call bit for bit."""
    recorder = OpRecorder()
    fn = compiled(lambda *a: experts_grouped_mm(*a, **kwargs), recorder if backend == "recorder" else backend)
    got = fn(*args)
    eager = experts_grouped_mm(*args, **kwargs)
    assert not got.isnan().any() and rel_err(got, want) < 1e-5
    torch.testing.assert_close(got, eager, rtol=0, atol=0)  # the same eager loop ran
    if backend == "recorder":
        assert recorder.graphs == 1 and recorder.saw(op) and not recorder.saw("group_gemm")


@pytest.mark.parametrize("variant", ["plain", "gpt-oss-biases-map"])
@pytest.mark.parametrize("backend", ["recorder", "inductor"])
def test_compiled_inference_runs_the_op_and_equals_eager(variant, backend):
    x, w13, w2, ids, weights = problem(12, 3, seed=1)
    kwargs = {}
    if variant != "plain":
        g = torch.Generator().manual_seed(2)
        kwargs = dict(activation=GPT_OSS, b13=torch.randn(E, 2 * N, generator=g), b2=torch.randn(E, K, generator=g),
                      expert_map=torch.tensor([0, -1, 1, 2, -1, 3, 4, 5]))
        ids = torch.where(ids >= 0, ids + (ids >= 1) + (ids >= 3), ids)  # global ids 0..7, 1 and 4 not local
    spec = kwargs.get("activation", ActivationSpec())
    want = experts_loop(x, w13, w2, ids, weights, kwargs.get("expert_map"), b13=kwargs.get("b13"), b2=kwargs.get("b2"),
                        spec=spec)
    check_compiled_experts((x, w13, w2, ids, weights), kwargs, want, backend, "moekit.cpu_experts")


def test_compiled_with_gradient_traces_the_grouped_gemm_path():
    """The op has no backward: a call that needs one traces moekit::group_gemm, and its gradients equal eager's."""
    x, w13, w2, ids, weights = problem(10, 2, seed=3)
    w13.requires_grad_(True)
    recorder = OpRecorder()
    got = compiled(experts_grouped_mm, recorder)(x, w13, w2, ids, weights)
    assert recorder.saw("moekit.group_gemm") and not recorder.saw("moekit.cpu_experts")
    assert rel_err(got, experts_loop(x, w13.detach(), w2, ids, weights)) < 1e-5
    (grad,) = torch.autograd.grad(got.square().sum(), [w13])
    (want,) = torch.autograd.grad(experts_grouped_mm(x, w13, w2, ids, weights).square().sum(), [w13])
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_cpu_gemm_grouped_mm_keeps_the_traced_path():
    x, w13, w2, ids, weights = problem(6, 2, seed=4)
    recorder = OpRecorder()
    with torch.no_grad():
        compiled(lambda *a: experts_grouped_mm(*a, cpu_gemm="grouped_mm"), recorder)(x, w13, w2, ids, weights)
    assert recorder.saw("moekit.group_gemm") and not recorder.saw("moekit.cpu_experts")


def test_packed_cache_is_filled_by_the_op_not_by_tracing():
    """Tracing meets only the fake (the cache stays empty until the graph runs); the run packs the real
    weights (>= 4 rows per expert), and a second call reuses the copies."""
    x, w13, w2, ids, weights = problem(40, 3, seed=6)
    clear_packed_weights()
    seen_at_trace = []

    def backend(gm, example_inputs):
        seen_at_trace.append(packed_weight_cache().used_bytes())
        return gm.forward

    fn = compiled(experts_grouped_mm, backend)
    with torch.no_grad():
        first = fn(x, w13, w2, ids, weights)
        used = packed_weight_cache().used_bytes()
        second = fn(x, w13, w2, ids, weights)
    assert seen_at_trace == [0] and used > 0 and packed_weight_cache().used_bytes() == used
    assert rel_err(first, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    clear_packed_weights()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_compiled_inference_runs_the_op(dtype):
    torch.manual_seed(7)
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=8, top_k=2, shared_expert_intermediate_size=8)
    moe = MoE(cfg, dtype=dtype)
    x = torch.randn(3, 5, K, dtype=dtype)
    recorder = OpRecorder()
    with torch.no_grad():
        eager = moe(x)
        got = compiled(moe, recorder)(x)
        routing = moe.route_tokens(x.reshape(-1, K)).routing
    assert recorder.graphs == 1 and recorder.saw("moekit.cpu_experts")
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    routed = experts_loop(x.reshape(-1, K), moe.w13.detach(), moe.w2.detach(), routing.topk_ids, routing.topk_weights)
    experts = experts_grouped_mm(x.reshape(-1, K), moe.w13, moe.w2, routing.topk_ids, routing.topk_weights)
    assert rel_err(experts, routed) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_transposed_weights_keep_their_packed_copies_and_follow_updates():
    """Weights stored transposed (transformers' gpt-oss layout, read as views) cross the op as stored: under
    inductor the packed copies are keyed by the parameters themselves, kept from call to call, and an
    in-place update of a parameter is seen (fresh copies, the new result)."""
    x, w13, w2, ids, weights = problem(40, 3, seed=9)
    up = torch.nn.Parameter(w13.transpose(1, 2).contiguous(), requires_grad=False)  # [E, K, 2N] storage
    down = torch.nn.Parameter(w2.transpose(1, 2).contiguous(), requires_grad=False)  # [E, N, K] storage
    fn = compiled(lambda *a: experts_grouped_mm(a[0], up.transpose(1, 2), down.transpose(1, 2), *a[1:]), "inductor")
    clear_packed_weights()
    with torch.no_grad():
        fn(x, ids, weights)  # the first run after compiling meets an alias of the views: packed once more
        first = fn(x, ids, weights)
        used = packed_weight_cache().used_bytes()
        keys = list(packed_weight_cache()._entries.keys())
        assert fn(x, ids, weights).equal(first) and packed_weight_cache().used_bytes() == used
        down.mul_(2)
        updated = fn(x, ids, weights)
    assert any(k is up for k in keys) and any(k is down for k in keys)
    assert rel_err(first, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    assert rel_err(updated, experts_loop(x, w13, 2 * w2, ids, weights)) < 1e-5
    clear_packed_weights()


def test_compiled_bf16_decode_calls_equal_eager_and_float64():
    """M = 1 in bf16 (auto's decode: the split loop or the phased one, whose one-row experts run as matrix-vector
    products; the chooser alternates them over the first calls): every compiled call has the eager call's bits and
    bf16's error against the float64 loop."""
    x, w13, w2, ids, weights = problem(1, 4, seed=12)
    x, w13, w2, weights = x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16()
    ids[0, 0] = 2  # no skipped slot: four experts of one row
    want = experts_loop(x, w13, w2, ids, weights)
    fn = compiled(experts_grouped_mm, "inductor")
    with torch.no_grad():
        for _ in range(8):
            got = fn(x, w13, w2, ids, weights)
            assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2
            torch.testing.assert_close(got, experts_grouped_mm(x, w13, w2, ids, weights), rtol=0, atol=0)
