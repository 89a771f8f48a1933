"""grouped_mm's memory budget against what a call allocates: the CPU allocator's running total, read from
torch.profiler's memory events, must stay within the budget plus the call's own result [M, K], for the
contiguous run (the GEMM path of CUDA without Triton and of CPU training) and the CPU per-expert loop
(which keeps every expert's weighted rows, [A, K] in float32, until its combine)."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from _helpers import TOLERANCE, experts_loop, make_problem, rel_l2
from moekit import MoE, MoEConfig
from moekit.experts.grouped_mm import experts_grouped_mm, plan_grouped_mm
from moekit.experts.grouped_mm_plan import contiguous_token_bytes

E, N, K = 8, 16, 256


def peak_allocated(fn, path) -> int:
    """The most bytes ``fn`` held at once beyond what was allocated before it, from the profiler's [memory]
    events (each allocation's and free's size, in time order) on the calling thread."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        held += e["args"]["Bytes"]
        peak = max(peak, held)
    return peak


def problem(m, top_k, dtype):
    return make_problem(m, top_k, E, K, N, dtype)


# The GEMM-phase estimate's bytes for the whole batch: (2K + 3N) per routed row, written out here. The old plan
# ran every case below in one chunk under it, and three of them then held more (the combine's weighted copy,
# the loop's kept rows and its output).
def gemm_phase_bytes(m, top_k, dtype):
    return m * top_k * (2 * K + 3 * N) * dtype.itemsize


@pytest.mark.parametrize("cpu_gemm, top_k, dtype, layout", [
    ("onednn_packed", 1, torch.float32, "auto"), ("onednn_packed", 2, torch.bfloat16, "auto"),
    ("grouped_mm", 2, torch.bfloat16, "auto"), ("grouped_mm", 1, torch.float32, "auto"),
    ("grouped_mm", 2, torch.bfloat16, "masked_measured_cap"),
])
def test_call_peak_stays_within_the_budget(cpu_gemm, top_k, dtype, layout, tmp_path):
    m = 96
    x, w13, w2, ids, weights = problem(m, top_k, dtype)
    budget = gemm_phase_bytes(m, top_k, dtype)
    call = lambda: experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=budget,  # noqa: E731
                                      cpu_gemm=cpu_gemm, layout=layout)
    with torch.no_grad():
        out = call()  # packs the weights (a cache, not the call's activations) before the measured call
        peak = peak_allocated(call, tmp_path / "trace.json")
    plan = plan_grouped_mm(m, top_k, E, K, N, dtype, memory_budget_bytes=budget, layout=layout)
    assert peak <= budget + m * K * dtype.itemsize, (peak, budget, plan)  # the result [M, K] is the caller's
    want = experts_loop(x, w13, w2, ids, weights)
    assert rel_l2(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["contiguous", "masked_measured_cap"])
def test_a_wide_bf16_activation_stays_within_the_budget(layout, tmp_path):
    """N >> K, bf16: the activation's float32 intermediates (act(gate) and its product, [A, N] each, before the
    operand's one rounding) outweigh the combine, and the plan counts them (``glu_float_bytes``): a budget of
    twice the GEMM phase's bf16 rows ran contiguous in one chunk and peaked at 1.25x the budget without them."""
    m, top_k, dtype, wide_k, wide_n = 96, 2, torch.bfloat16, 16, 128
    x, w13, w2, ids, weights = make_problem(m, top_k, E, wide_k, wide_n, dtype)
    budget = 2 * m * top_k * (2 * wide_k + 3 * wide_n) * dtype.itemsize
    call = lambda: experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=budget,  # noqa: E731
                                      cpu_gemm="grouped_mm", layout=layout)
    with torch.no_grad():
        out = call()
        peak = peak_allocated(call, tmp_path / "trace.json")
    assert peak <= budget + m * wide_k * dtype.itemsize, (peak, budget)
    assert rel_l2(out, experts_loop(x, w13, w2, ids, weights)) < TOLERANCE[dtype]


def test_budget_errors_name_the_argument():
    """A bool is no budget (it used to pass as 1 byte or 0); a budget below one token's run says so, eager or traced."""
    x, w13, w2, ids, weights = problem(4, 2, torch.float32)
    for bad in (True, 0, -5, 2.5):
        with pytest.raises(ValueError, match="memory_budget_bytes must be a positive int or None"):
            experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=bad)
    with pytest.raises(ValueError, match="memory_budget_bytes=64 cannot hold even one token"):
        experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=64)
    fn = torch.compile(lambda *a: experts_grouped_mm(*a, memory_budget_bytes=64), fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="memory_budget_bytes=64 cannot hold even one token"):
        fn(x.requires_grad_(True), w13, w2, ids, weights)


def test_a_budget_of_a_few_kilobytes_is_told_in_bytes():
    """A budget below one token's run says what it holds and what the smallest layout needs, in bytes (fuzz37: a
    2 KB budget was told as "no layout fits 0.0 MiB; the smallest, contiguous, needs 0.0 MiB")."""
    x, w13, w2, ids, weights = problem(4, 2, torch.float32)
    for layout in ("auto", "masked_measured_cap"):
        with pytest.raises(ValueError, match=r"fits 64 bytes; the smallest, \w+, needs [1-9]\d* bytes|"
                                             r"fits 64 bytes; the smallest, \w+, needs 0\.[1-9] MiB"):
            experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=64, layout=layout)


@pytest.mark.parametrize("layout", ["auto", "contiguous", "masked_measured_cap"])
def test_an_empty_batch_is_not_refused_for_a_budget_it_does_not_need(layout):
    """M = 0: the plain call returns the empty output without an experts call, and a call with stats agrees (it
    asked the plan for one token's rows: fuzz37). The plan of no tokens is contiguous's empty run, which holds
    nothing, so a direct call is not refused either; a forced masked layout, whose measured cap allocates
    E x MASKED_ROUND_TO rows even then, says so. One token still meets the budget in both calls."""
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    moe = MoE(cfg, backend="grouped_mm", backend_options={"memory_budget_bytes": 64, "layout": layout}).eval()
    roomy = MoE(cfg, backend="grouped_mm", backend_options={"layout": layout}).eval()
    empty = torch.zeros(0, K)
    with torch.no_grad():
        assert torch.equal(moe(empty), torch.zeros(0, K))
        result = moe(empty, return_stats=True)
        assert torch.equal(result.out, torch.zeros(0, K)) and result.stats.num_tokens == 0
        assert result.stats.counts.tolist() == [0] * E and result.stats.dropped == 0
        assert result.stats.layout == roomy(empty, return_stats=True).stats.layout == (
            "contiguous" if layout == "auto" else layout)
        for stats in (False, True):
            with pytest.raises(ValueError, match="memory_budget_bytes=64 cannot hold even one token"):
                moe(torch.randn(1, K), return_stats=stats)
    x, w13, w2, ids, weights = problem(0, 2, torch.float32)
    if layout == "masked_measured_cap":
        with pytest.raises(ValueError, match="memory_budget_bytes=64 cannot hold the rows its layout allocates at "
                                             "M = 0"):
            experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=64, layout=layout)
        return
    plan = plan_grouped_mm(0, 2, E, K, N, torch.float32, memory_budget_bytes=64, layout=layout)
    assert (plan.layout, plan.chunk_tokens) == ("contiguous", 0)
    for cpu_gemm in ("auto", "grouped_mm"):
        out = experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=64, layout=layout, cpu_gemm=cpu_gemm)
        assert torch.equal(out, torch.zeros(0, K))


def test_traced_chunks_hold_their_outputs_in_x_dtype(tmp_path):
    """Under torch.compile the chunks' outputs are held until their cat: at most M*K in x's dtype beyond the budget
    and the result. A bf16 call used to hold them in float32 and cat them in float32 before the cast (over by
    ~20 KB here). 70 tokens in chunks of 16: four, then one overlapping its predecessor."""
    m, top_k, dtype = 70, 1, torch.bfloat16
    x, w13, w2, ids, weights = problem(m, top_k, dtype)
    budget = 16 * contiguous_token_bytes(top_k, K, N, dtype)  # the traced chunk: 16 tokens
    fn = torch.compile(lambda *a: experts_grouped_mm(*a, memory_budget_bytes=budget, cpu_gemm="grouped_mm"),
                       fullgraph=True, dynamic=True, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        out = fn(x, w13, w2, ids, weights)
        peak = peak_allocated(lambda: fn(x, w13, w2, ids, weights), tmp_path / "trace.json")
    assert peak <= budget + 2 * m * K * dtype.itemsize, (peak, budget)
    assert out.dtype == dtype and rel_l2(out, experts_loop(x, w13, w2, ids, weights)) < TOLERANCE[dtype]
