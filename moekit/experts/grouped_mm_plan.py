"""How ``experts_grouped_mm`` runs a call: the layout and the chunk size, from shapes and options alone.

    eager (M an int):  choose_layout(M) -> the layout with the fewest GEMM rows whose peak fits the budget;
                       none fits -> halve the chunk until one does (cached per call shape)
    traced (torch.compile): the contiguous layout, the one of this backend that needs no host sync, in
                       chunks of the most tokens whose peak fits: budget // contiguous_token_bytes

A traced call never reads M: with ``dynamic=True`` it is a SymInt, and ``choose_layout`` at M would take a
max over sizes made from it and sort by them (dynamo refuses both, even on constants), while every
comparison of M with a constant is a guard, a recompile per distinct plan. The traced plan is plain
arithmetic on the static facts (k, K, N, dtype, budget) with the contiguous run's byte model
(``contiguous_token_bytes``: with align 1 it holds exactly A rows), so the caller's ``M <= chunk`` is the
one guard, and a batch longer than a chunk adds one per chunk count.

Either way a contiguous chunk must fit its whole run, not only the layout's GEMM buffers that
``choose_layout`` models: the combine holds x_perm, y and their weighted copy in the accumulation dtype at
once (in bf16 12 bytes per element of [A, K], against the GEMM phase's 4K + 6N per row).

On the CPU in eager mode the call may instead run ``moekit.experts.cpu_packed``'s per-expert loop,
which keeps every expert's weighted rows ([A, K] in the accumulation dtype) until the combine: the
plan counts that loop's peak (``fused_loop_peak_bytes``) beside the layout's, so a chunk fits the
budget whichever of the two runs it.

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts.cpu_packed import fused_loop_peak_bytes
from moekit.layouts import LayoutChoice, choose_layout, grouped_row_bytes, size_text

# 1 GiB of activations per call. The contiguous layout needs (2K + 3N) * 4 bytes per routed row in fp32
# (25.6 KB at Qwen3-30B-A3B's K=2048, N=768), so one chunk holds ~5000 tokens at k=8: ~320 rows per
# expert, where the GEMMs already run at their full rate, while a long prefill stays bounded in memory.
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
GROUPED_MM_LAYOUTS = ("contiguous", "masked_measured_cap")  # what this backend implements, for choose_layout
MASKED_ROUND_TO = 8  # the measured cap's rounding: bmm computes every padding row, so round finely
# Where the grouped GEMM path rounds a bf16 / fp16 call only where its GEMMs force it (h + b13, the activation and its
# product in float32, one rounding into the second GEMM). Not on CUDA: there each of those eager elementwise passes
# moved twice the bytes (H100, session 39: the activation alone 1.9x, Mixtral / gpt-oss-20b experts at M = 4096
# 1.22x / 1.25x the whole call), so it rounds them in bf16 as transformers' grouped_mm does (``grouped_mm``).
FLOAT32_GLU_DEVICES = ("cpu",)


@dataclass(frozen=True)
class GroupedMMPlan:
    """How ``experts_grouped_mm`` runs a call; a function of the shapes and options only."""

    layout: str  # one of GROUPED_MM_LAYOUTS
    chunk_tokens: int  # tokens per chunk; >= M when the whole batch fits the budget (one chunk)
    reason: str  # choose_layout's explanation, plus the chunking when there is one


# (shapes, dtype, options) -> eager plan. A plain dict (traced calls plan by arithmetic and never touch it).
_PLANS: dict[tuple, GroupedMMPlan] = {}

TRACED_REASON = ("traced by torch.compile, M unread: contiguous, the layout that needs no host sync, in chunks of "
                 "the most tokens whose peak fits the budget")


def plan_grouped_mm(
    num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
    *, memory_budget_bytes: int | None = None, layout: str = "auto", allow_sync: bool = True,
    device_type: str = "cpu",
) -> GroupedMMPlan:
    """The layout and chunk size for M = ``num_tokens`` (cached per arguments). ``layout`` "auto" asks
    ``choose_layout`` (among GROUPED_MM_LAYOUTS; ``allow_sync=False`` leaves out the measured cap);
    a layout name forces it, still chunked to the budget. ``allow_sync=True`` (CPU eager) also counts
    the CPU per-expert loop's peak at ``torch.get_num_threads()`` workers. ``device_type``: the call's device
    (its float32 activation's bytes, ``glu_float_bytes``). While ``torch.compile`` traces (any size may be a
    SymInt) the call gets the plan of every M without reading M: ``traced_plan``."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    if torch.compiler.is_compiling():
        return traced_plan(top_k, hidden_size, intermediate_size, dtype, budget, layout, device_type)
    workers = torch.get_num_threads() if allow_sync else 0
    key = (num_tokens, top_k, num_experts, hidden_size, intermediate_size, dtype, budget, layout, allow_sync, workers,
           device_type)
    plan = _PLANS.get(key)
    if plan is None:
        dims = (top_k, num_experts, hidden_size, intermediate_size)
        plan = _PLANS[key] = _plan(num_tokens, dims, dtype, budget, layout, allow_sync, workers, device_type)
    return plan


# int64 row indices per row alive in a run (the grouping's ids, destinations, rows' sources and experts, the
# GEMM offsets' share): small beside a row of activations, counted so the bound is one
_INDEX_BYTES_PER_ROW = 6 * 8


def run_row_bytes(hidden_size, intermediate_size, dtype: torch.dtype, device_type: str):
    """Peak bytes per layout row of a contiguous or masked run of ``experts_grouped_mm``, the larger of its two
    phases: the GEMMs (the row's x, h, activation and y: ``grouped_row_bytes``, what ``choose_layout``
    models, plus, for a dtype narrower than its accumulation dtype, the activation's unrounded intermediates:
    ``glu_float_bytes``) and the combine (x and y, their weighted copy in the accumulation dtype, preceded by an
    upcast copy when y is narrower), plus the row's indices. Arithmetic only: the sizes may be SymInts."""
    b, acc = dtype.itemsize, _acc_bytes(dtype)
    gemms = grouped_row_bytes(hidden_size, intermediate_size, b) + glu_float_bytes(intermediate_size, dtype,
                                                                                 device_type)
    combine = hidden_size * (2 * b + acc + (acc if acc != b else 0))
    return _larger(gemms, combine) + _INDEX_BYTES_PER_ROW


def glu_float_bytes(intermediate_size, dtype: torch.dtype, device_type: str):
    """Bytes per row that ``grouped_mm.glu_operand`` holds beyond the bf16 / fp16 buffers ``grouped_row_bytes``
    counts, so that the second GEMM's operand is rounded once: a plain gated activation's act(gate) and its
    product [N] each in the accumulation dtype (float32) at once; none when the dtype is its own accumulation
    dtype (nothing rounded between the GEMMs: as before) or off FLOAT32_GLU_DEVICES. A bias or another activation
    also holds h + b13 in float32 [2N], outside the count as the bias gathers are."""
    acc = _acc_bytes(dtype)
    return 0 if acc == dtype.itemsize or device_type not in FLOAT32_GLU_DEVICES else 2 * intermediate_size * acc


def _larger(a, b):
    """max of two sizes that may be SymInts. Plain ints take Python's max: torch 2.11's Dynamo cannot trace
    ``torch.sym_max`` of two ints (it returns an int, "torch.* op returned non-Tensor"), 2.13 can."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_max(a, b)


def contiguous_token_bytes(top_k, hidden_size, intermediate_size, dtype: torch.dtype, device_type: str = "cpu"):
    """Peak bytes per token of the contiguous run (align 1: exactly k rows per token), its out [K] included."""
    return (top_k * run_row_bytes(hidden_size, intermediate_size, dtype, device_type)
            + hidden_size * _acc_bytes(dtype))


def _acc_bytes(dtype: torch.dtype) -> int:
    return torch.promote_types(dtype, torch.float32).itemsize


def traced_plan(top_k, hidden_size, intermediate_size, dtype: torch.dtype, budget: int, layout: str,
                device_type: str = "cpu") -> GroupedMMPlan:
    """The plan of every M: contiguous, chunks of budget // ``contiguous_token_bytes`` tokens. Arithmetic
    only, so the sizes may be SymInts (the chunk is then an expression of them, never of M)."""
    _check(budget, layout, allow_sync=False)
    chunk = budget // contiguous_token_bytes(top_k, hidden_size, intermediate_size, dtype, device_type)
    if chunk < 1:
        raise ValueError(f"memory_budget_bytes={budget} cannot hold even one token's rows in the contiguous layout")
    return GroupedMMPlan(layout="contiguous", chunk_tokens=chunk, reason=TRACED_REASON)


def _check(budget, layout, allow_sync) -> None:
    if layout != "auto" and layout not in GROUPED_MM_LAYOUTS:
        raise ValueError(f"layout must be 'auto' or one of {GROUPED_MM_LAYOUTS}, got {layout!r}")
    if layout == "masked_measured_cap" and not allow_sync:
        raise ValueError("layout='masked_measured_cap' reads the counts back to the host: CPU eager only")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive int or None, got {budget!r}")


def _chooser(dims, dtype, budget, layout, allow_sync, workers, device_type):
    """m tokens -> choose_layout's choice for them, where the chosen layout's whole run must fit too
    (``run_row_bytes``; for contiguous also the CPU per-expert loop's peak when ``workers`` > 0, since it may
    run that layout's call); a layout whose run does not fit leaves the others to compete."""
    top_k, num_experts, hidden, inter = dims
    candidates = GROUPED_MM_LAYOUTS if layout == "auto" else (layout,)
    args = dict(top_k=top_k, num_experts=num_experts, hidden_size=hidden, intermediate_size=inter,
                dtype_bytes=dtype.itemsize, memory_budget_bytes=budget, align=1, allow_sync=allow_sync,
                cap_round_to=MASKED_ROUND_TO)

    def run_bytes(m: int, choice: LayoutChoice) -> tuple[int, str]:
        """The chosen layout's whole run for m tokens, and what needs it."""
        if choice.name == "contiguous":
            run = m * contiguous_token_bytes(top_k, hidden, inter, dtype, device_type)
            loop = fused_loop_peak_bytes(m, top_k, hidden, inter, dtype, workers) if workers else 0
            return (loop, "the CPU per-expert loop") if loop > run else (run, "its combine")
        # masked_measured_cap: E experts of the measured cap, which the counts (unknown here) set; at most M
        # rounded up when a token's ids are distinct (route()'s, as the masked estimate assumes)
        rows = num_experts * -(-m // MASKED_ROUND_TO) * MASKED_ROUND_TO
        run = rows * run_row_bytes(hidden, inter, dtype, device_type) + m * hidden * _acc_bytes(dtype)
        return run, "its largest cap"

    def choose(m: int) -> LayoutChoice:
        left, why = candidates, []
        while left:
            choice = choose_layout(m, candidates=left, **args)
            if choice.name == "none":
                break
            need, what = run_bytes(m, choice)
            if need <= budget:
                return choice if not why else LayoutChoice(choice.name, f"{'; '.join(why)}; {choice.reason}",
                                                           choice.estimates)
            why.append(f"{choice.name}: {what} needs {size_text(need)} over the {size_text(budget)} budget")
            left = tuple(c for c in left if c != choice.name)
        return LayoutChoice("none", "; ".join(why) or choice.reason, choice.estimates)

    return choose


def _plan(num_tokens, dims, dtype, budget, layout, allow_sync, workers, device_type) -> GroupedMMPlan:
    _check(budget, layout, allow_sync)
    choose = _chooser(dims, dtype, budget, layout, allow_sync, workers, device_type)
    chunk = num_tokens  # M = 0 is planned as no tokens (its contiguous run holds nothing), not as one
    choice = choose(chunk)
    whole = choice.reason
    while choice.name == "none" and chunk > 1:  # halve until a chunk fits: the peak grows with the tokens
        chunk = (chunk + 1) // 2
        choice = choose(chunk)
    if choice.name == "none":
        held = "even one token's rows" if num_tokens else "the rows its layout allocates at M = 0"
        raise ValueError(f"memory_budget_bytes={budget} cannot hold {held}: {choice.reason}")
    reason = choice.reason if chunk >= num_tokens else f"{whole}; chunks of {chunk} tokens: {choice.reason}"
    return GroupedMMPlan(layout=choice.name, chunk_tokens=chunk, reason=reason)
