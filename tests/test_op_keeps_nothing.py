"""moekit's experts ops keep nothing they allocate (session 36, ``f8g36``), under Triton's interpreter, tiny shapes.

transformers' compiled decode ("reduce-overhead": CUDA-graph trees) warms a graph up with every allocation taken from
the graph's private pool and then requires each live block of that pool to be one of the graph's outputs; a tensor a
call allocates and a cache keeps past the call fails it ("Detected 2 tensor(s) in the cudagraph pool not tracked as
outputs": the fp8 op's reused workspace buffer and its kept k-sum counters, H200). The CPU stand-in: every tensor alive
after a call, ``gc.collect()`` run, whose storage did not exist before it is the output's or a leak. Checked for the
op bodies a compiled graph holds (``triton_experts_fp8``, ``triton_experts_wo``, ``triton_experts_infer``), called
through the op and inside a compiled (fullgraph) function, from empty caches, and for transformers' FP8Experts through
"moekit" compiled; the direct eager path keeps its pool. On main the fp8 cases kept a uint8 buffer, int32 counters."""

from __future__ import annotations

import gc

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import emulation_f64, problem as fp8_problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from test_triton_op import _compiled_ops  # noqa: E402  (fn compiled fullgraph, aot_eager: its output, its ops)
from test_triton_wo import loop64, problem as wo_problem, wo  # noqa: E402, F401  (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: discarded NaN lanes

FP8_SHAPE, FP8_BLOCK = (4, 160, 96), (128, 128)  # E, K, N


_REAL = (torch.Tensor, torch.nn.Parameter)  # not a compile's fake or functional tensors (no storage to hold)


def _live_tensors() -> list[torch.Tensor]:
    """The strided CPU / CUDA tensors alive now (an earlier test's oneDNN or sparse tensors have no storage to
    compare: a call here never makes one)."""
    gc.collect()
    return [o for o in gc.get_objects()
            if type(o) in _REAL and o.device.type != "meta" and o.layout == torch.strided and not o.is_mkldnn]


def _kept_after(call) -> tuple:
    """call()'s output (a tensor or a tuple), and (shape, dtype) of each tensor alive after it whose storage is new
    and not the output's. The tensors alive before are held for the call: no new storage can take their addresses."""
    before = _live_tensors()
    old = {t.untyped_storage().data_ptr() for t in before}
    with torch.no_grad():
        out = call()
    mine = {t.untyped_storage().data_ptr() for t in (out if isinstance(out, tuple) else (out,))
            if isinstance(t, torch.Tensor)}
    kept = [(tuple(t.shape), t.dtype) for t in _live_tensors()
            if t.untyped_storage().data_ptr() not in old | mine and t.untyped_storage().nbytes()]
    del before
    return out, kept


@pytest.fixture
def fp8(interpreter):
    from moekit.experts import triton_fp8

    triton_fp8.clear_launch_caches()
    yield triton_fp8
    triton_fp8.clear_launch_caches()


def _fp8_case(m: int, seed: int):
    x, _, quantized, ids, weights = fp8_problem(m, 2, FP8_SHAPE, FP8_BLOCK, seed=seed)
    return x, quantized, ids, weights


@pytest.mark.parametrize("m", [1, 5])  # 1: the tiny-batch shortcut and the folded k-sum's counters; 5: aligned blocks
def test_fp8_op_keeps_nothing_it_allocates(fp8, m):
    x, quantized, ids, weights = _fp8_case(m, seed=m)
    out, kept = _kept_after(lambda: torch.ops.moekit.triton_experts_fp8(x, *quantized, ids, weights, None, *FP8_BLOCK,
                                                                       True, False, False))
    assert kept == []
    assert len(fp8._WORKSPACES) == 0
    assert rel_l2(out, emulation_f64(x, *quantized, ids, weights, FP8_BLOCK)) < 1e-2


def test_compiled_fp8_call_keeps_nothing_it_allocates(fp8):
    """What moekit.hf's fp8 experts run under torch.compile: ``fused_experts_fp8`` traced whole into the op."""
    x, quantized, ids, weights = _fp8_case(1, seed=3)

    def fn(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights):
        return fp8.fused_experts_fp8(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, block_shape=FP8_BLOCK)

    compiled = {}

    def call():
        compiled["out"], compiled["ops"] = _compiled_ops(fn, x, *quantized, ids, weights)
        return compiled["out"]

    out, kept = _kept_after(call)
    assert [op.removesuffix(".default") for op in compiled["ops"]] == ["moekit.triton_experts_fp8"]
    assert kept == []
    assert rel_l2(out, emulation_f64(x, *quantized, ids, weights, FP8_BLOCK)) < 1e-2


def test_direct_eager_fp8_call_keeps_its_workspace_pool(fp8):
    """Eager calls are not slowed: the direct path still reuses the pool (one buffer kept, same bits as the op)."""
    x, quantized, ids, weights = _fp8_case(1, seed=4)
    with torch.no_grad():
        eager = fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=FP8_BLOCK)
        assert len(fp8._WORKSPACES) == 1
        via_op = torch.ops.moekit.triton_experts_fp8(x, *quantized, ids, weights, None, *FP8_BLOCK, True, False, False)
    assert torch.equal(eager, via_op)


@pytest.mark.parametrize("m", [1, 5])
def test_wo_op_keeps_nothing_it_allocates(wo, m):
    x, w13, w2, ids, weights = wo_problem(wo, "int4_w4a16", 32, m=m, k=2, seed=m)
    wo.clear_launch_caches()
    out, kept = _kept_after(lambda: torch.ops.moekit.triton_experts_wo(
        x, w13.q, w13.scale, w13.zero, 32, w2.q, w2.scale, w2.zero, 32, ids, weights, None, "int4_w4a16", "silu",
        False, ""))
    assert kept == []
    want = loop64(x, w13, w2, ids, weights)
    assert rel_l2(out.double(), want) < 1e-2


@pytest.mark.parametrize("m", [1, 5])
def test_bf16_op_keeps_nothing_it_allocates(interpreter, m):
    from moekit.experts.triton_op import traced_triton_experts

    g = torch.Generator().manual_seed(m)
    x, w13, w2 = torch.randn(m, 64, generator=g), torch.randn(4, 64, 64, generator=g) / 8, torch.randn(4, 64, 32,
                                                                                                       generator=g) / 6
    ids = torch.rand(m, 4, generator=g).argsort(dim=1)[:, :2].int()
    weights = torch.rand(m, 2, generator=g)
    out, kept = _kept_after(lambda: traced_triton_experts(x, w13, w2, ids, weights, "silu"))
    assert kept == []
    want = torch.zeros(m, 64, dtype=torch.float64)
    for t in range(m):
        for j in range(2):
            gate_up = w13[ids[t, j]].double() @ x[t].double()
            want[t] += float(weights[t, j]) * (w2[ids[t, j]].double() @ (torch.nn.functional.silu(gate_up[:32])
                                                                          * gate_up[32:]))
    assert rel_l2(out.double(), want) < 1e-4


def test_compiled_transformers_fp8_experts_keep_nothing(fp8, monkeypatch):
    """transformers' FP8Experts through "moekit" (``moekit_fp8_experts_forward``), the MoE block compiled fullgraph on
    the triton backend: a compiled call from empty caches (as the trees' warm-up on a stream of their own finds them)
    keeps nothing it allocates, and equals the eager block."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    from test_quant_hf import triton_fp8_block

    block, x = triton_fp8_block(monkeypatch, tokens=3, seed=5)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        compiled(x)
    fp8.clear_launch_caches()
    got, kept = _kept_after(lambda: compiled(x))
    assert kept == []
    eager, got = (out[0] if isinstance(out, tuple) else out for out in (eager, got))
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
