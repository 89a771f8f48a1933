"""The scratch decode of the weight-only Triton experts (``triton_wo_scratch``, ``_kernels/dequant_wo.py``)
on the CPU, under Triton's interpreter, tiny shapes.

Chain: the dequant kernel vs the float64 dequantizer of ``test_triton_wo.py`` (bit by bit from each
scheme's layout, e2m1 by its exponent/mantissa rule), on random bytes (an odd C's padding nibble is garbage that must
never show), for int8, int4 at each group size with zero points, and mxfp4; then the whole path
(dequantize, bf16 GEMMs, k-sum; all experts at once and in chunks, with an expert map) against the
``reference`` backend on weights quantized by ``moekit.quant``; the overlapped pipeline's stream order
(fake streams: which launch happens before which). What the interpreter cannot run
(bf16 rounding of the scratch on the device, real shapes, timing): ``benchmarks/wo_large_device_check.py``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_wo import dequant64, wo  # noqa: E402, F401  (wo: fixture)
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.quant import quantize  # noqa: E402

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 32), ("int4_w4a16", 64), ("int4_w4a16", 128), ("mxfp4", 32)]
POISON = LaunchOptions(poison_workspace=True)


def random_weight(wo, scheme: str, group: int, e: int, r: int, c: int, seed: int):
    """Random bytes in the scheme's layout (``triton_wo.WoWeight``), scales of a few binades."""
    g = torch.Generator().manual_seed(seed)
    if scheme == "int8_w8a16":
        q = torch.randint(-128, 128, (e, r, c), generator=g, dtype=torch.int8)
        return wo.WoWeight(scheme, q, torch.rand(e, r, generator=g) + 0.25)
    groups = -(-c // group)
    q = torch.randint(0, 256, (e, r, -(-c // 2)), generator=g, dtype=torch.uint8)
    if scheme == "int4_w4a16":
        zero = torch.randint(0, 16, (e, r, groups), generator=g, dtype=torch.uint8)
        return wo.WoWeight(scheme, q, torch.rand(e, r, groups, generator=g) + 0.25, zero, group)
    return wo.WoWeight(scheme, q, torch.randint(118, 136, (e, r, groups), generator=g, dtype=torch.uint8), None, group)


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("cols", [160, 67])
def test_dequant_kernel_matches_independent_decoder(wo, scheme, group, cols):
    from moekit.experts.triton_wo_plan import SCHEME_IDS, weight_args
    from moekit.experts.triton_wo_scratch import dequantize_experts

    w = random_weight(wo, scheme, group, 4, 40, cols, seed=cols + group)
    expected = dequant64(w, cols)
    out = torch.full((2, 40, cols), float("nan"))  # experts 1 and 2 of 4: a chunk not at 0
    dequantize_experts(weight_args(w.q, w.scale, w.zero, w.group_size), SCHEME_IDS[scheme], cols, out, 1)
    # int4 decodes as (128 + code) * s - (128 + zero) * s in float32 (``gemm_wo``): up to ~2 x 144 s 2^-24
    atol = 2 * 144 * 1.25 * 2.0**-24 if scheme == "int4_w4a16" else 1e-6
    torch.testing.assert_close(out.double(), expected[1:3], rtol=1e-6, atol=atol)


def test_dequant_kernel_rounds_to_bf16(wo):
    from moekit.experts.triton_wo_plan import SCHEME_IDS, weight_args
    from moekit.experts.triton_wo_scratch import dequantize_experts

    w = random_weight(wo, "int4_w4a16", 32, 2, 16, 96, seed=3)
    out = torch.empty(2, 16, 96, dtype=torch.bfloat16)
    dequantize_experts(weight_args(w.q, w.scale, w.zero, 32), SCHEME_IDS["int4_w4a16"], 96, out, 0)
    expected = dequant64(w, 96)
    # the interpreter's float -> bf16 conversion truncates: within one bf16 ulp (2^-7 relative)
    assert ((out.double() - expected).abs() <= expected.abs() * 2.0**-7 + 1e-12).all()


def quantized_pair(scheme: str, group: int, e: int, n: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    options = {"group_size": group} if scheme == "int4_w4a16" else {}
    w13 = quantize(torch.randn(e, 2 * n, hidden, generator=g) / hidden**0.5, scheme, **options)
    w2 = quantize(torch.randn(e, hidden, n, generator=g) / n**0.5, scheme, **options)
    return w13, w2


def routing(m: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [M, k] int32 of k distinct experts per token, weights [M, k] float32 summing to 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].int()
    return ids, torch.softmax(torch.rand(m, k, generator=g), dim=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_scratch(wo, x, w13, w2, ids, weights, expert_map=None, max_bytes=None):
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo_plan import SCHEME_IDS, weight_args

    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (_wo(w13), _wo(w2)))
    if max_bytes is None:  # the public entry, decode named
        return wo.run_experts_wo(x, a13, a2, ids, weights, expert_map, w13.scheme, options=POISON, decode="scratch")
    from moekit.experts.triton_wo_scratch import run_experts_wo_scratch

    return run_experts_wo_scratch(x, a13, a2, ids.contiguous(), weights.contiguous(), expert_map,
                                  SCHEME_IDS[w13.scheme], "silu", POISON, max_scratch_bytes=max_bytes)


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("hidden", [96, 67])
def test_scratch_path_matches_reference(wo, scheme, group, hidden):
    e, n, m, k = 4, 48, 7, 2
    w13, w2 = quantized_pair(scheme, group, e, n, hidden, seed=hidden)
    x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, weights = routing(m, e, k, seed=2)
    out = run_scratch(wo, x, w13, w2, ids, weights)
    ref = experts_reference(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 1e-2


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_chunks_of_experts_with_expert_map_match_reference(wo, per_chunk):
    e, n, hidden, m, k = 5, 32, 64, 9, 2
    w13, w2 = quantized_pair("int4_w4a16", 32, e, n, hidden, seed=per_chunk)
    x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids, weights = routing(m, 8, k, seed=5)  # 8 global experts, 5 of them here
    expert_map = torch.tensor([3, -1, 0, 4, -1, 1, 2, -1], dtype=torch.int32)
    cap = per_chunk * 2 * n * hidden * 4  # float32 scratch under the interpreter
    out = run_scratch(wo, x, w13, w2, ids, weights, expert_map, max_bytes=cap)
    ref = experts_reference(x, w13, w2, ids, weights, expert_map=expert_map)
    assert rel(out, ref) < 1e-2


def test_expert_above_the_cap_is_refused_by_name(wo):
    w13, w2 = quantized_pair("int8_w8a16", 0, 2, 16, 32, seed=0)
    x = torch.randn(3, 32).to(torch.bfloat16)
    ids, weights = routing(3, 2, 1, seed=0)
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        run_scratch(wo, x, w13, w2, ids, weights, max_bytes=100)


def test_chooser_takes_scratch_from_the_threshold_where_it_fits(monkeypatch):
    from moekit.experts import triton_wo_winners
    from moekit.experts.triton_wo_plan import choose_decode
    from moekit.experts.triton_wo_scratch import SCRATCH_MIN_TOKENS

    # the threshold rule alone: the measured winners table (test_triton_wo_mid.py) has a row at every
    # one of these cells, and skipping them left nothing here to fail
    monkeypatch.setattr(triton_wo_winners, "WO_WINNERS", {})
    for scheme in ("int8_w8a16", "int4_w4a16", "mxfp4"):
        for shape in ((128, 768, 2048, 8), (8, 14336, 4096, 2)):  # Qwen3-30B-A3B, Mixtral-8x7B
            assert choose_decode(scheme, SCRATCH_MIN_TOKENS, *shape) == "scratch"
            assert choose_decode(scheme, SCRATCH_MIN_TOKENS * 4, *shape) == "scratch"
            assert choose_decode(scheme, SCRATCH_MIN_TOKENS - 1, *shape) != "scratch"
            assert choose_decode(scheme, SCRATCH_MIN_TOKENS, *shape, fused=True) != "scratch"
    # one expert's bf16 w13 of 2 x 2^15 x 2^16 x 2 bytes = 8 GiB: above the cap, a fused decode
    assert choose_decode("int4_w4a16", SCRATCH_MIN_TOKENS, 4, 1 << 15, 1 << 16, 2) == "tile"
    # 2 x 2^14 x 3 * 2^13 weights: 1.5 GiB in bf16 fits the 2 GiB cap, 3 GiB in fp32 (an fp32 x's scratch) not
    assert choose_decode("int8_w8a16", SCRATCH_MIN_TOKENS, 4, 1 << 14, 3 << 13, 2, itemsize=2) == "scratch"
    assert choose_decode("int8_w8a16", SCRATCH_MIN_TOKENS, 4, 1 << 14, 3 << 13, 2, itemsize=4) != "scratch"


def test_large_batch_runs_scratch_through_the_public_entry(wo, monkeypatch):
    """The chooser's "scratch" reaches run_experts_wo's diversion (threshold lowered to this batch)."""
    import moekit.experts.triton_wo_plan as plans
    import moekit.experts.triton_wo_scratch as scratch

    calls = []
    real = scratch.run_experts_wo_scratch
    monkeypatch.setattr(plans, "SCRATCH_MIN_TOKENS", 4)
    monkeypatch.setattr(wo, "SCRATCH_MIN_TOKENS", 4)
    monkeypatch.setattr(wo, "run_experts_wo_scratch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w13, w2 = quantized_pair("mxfp4", 32, 4, 32, 64, seed=6)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ids, weights = routing(6, 4, 2, seed=6)
    from moekit.experts.triton_quant import _wo

    out = wo.fused_experts_wo(x, _wo(w13), _wo(w2), ids, weights)
    assert calls == [1] and rel(out, experts_reference(x, w13, w2, ids, weights)) < 1e-2


class _FakeStream:
    """Records the ops launched on it and what each must wait for (the previous op on this stream and
    the ops behind the events waited on), to check the happens-before order of ``_pipelined``."""

    def __init__(self, preds: dict):
        self.preds, self.last, self.waits = preds, None, []

    def record_event(self):
        return self.last

    def wait_event(self, event) -> None:
        if event is not None:
            self.waits.append(event)

    def wait_stream(self, other: "_FakeStream") -> None:
        self.wait_event(other.last)

    def launch(self, op) -> None:
        self.preds[op] = [p for p in [self.last, *self.waits] if p is not None]
        self.last, self.waits = op, []


def test_overlap_pipeline_orders_each_buffer_and_overlaps_neighbours(monkeypatch):
    """Step j's GEMM after its dequant; step j + 1's dequant after step j - 1's GEMM (same buffer) but
    concurrent with step j's GEMM; everything before the join."""
    import contextlib

    import moekit.experts.triton_wo_scratch as scratch

    preds: dict = {}
    main, side = _FakeStream(preds), _FakeStream(preds)
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(scratch, "_SIDE_STREAMS", {})
    steps = [(j, None) for j in range(6)]  # 3 chunks x (gate-up, down)
    scratch._pipelined(steps, lambda j, _: current[-1].launch(("dequant", j)),
                       lambda j, _: current[-1].launch(("gemm", j)), torch.device("cuda", 0))
    main.launch("after")

    def before(a, b) -> bool:  # a happens before b
        todo, seen = list(preds[b]), set()
        while todo:
            p = todo.pop()
            if p == a:
                return True
            if p not in seen:
                seen.add(p)
                todo.extend(preds[p])
        return False

    for j in range(6):
        assert before(("dequant", j), ("gemm", j))
        assert all(before(op, "after") for op in (("dequant", j), ("gemm", j)))
        if j + 1 < 6:
            assert not before(("dequant", j + 1), ("gemm", j)) and not before(("gemm", j), ("dequant", j + 1))
        if j >= 1 and j + 1 < 6:
            assert before(("gemm", j - 1), ("dequant", j + 1))
