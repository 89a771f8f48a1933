"""How ``experts_grouped_mm`` runs a call: the layout and the chunk size, from shapes and options alone.

    eager (M an int):  choose_layout(M) -> the layout with the fewest GEMM rows whose peak fits the budget;
                       none fits -> halve the chunk until one does (cached per call shape)
    traced (torch.compile): the contiguous layout, the one of this backend that needs no host sync, in
                       chunks of the most tokens whose peak fits the budget: budget // (k * row bytes)

A traced call never reads M: with ``dynamic=True`` it is a SymInt, and ``choose_layout`` at M would take a
max over sizes made from it and sort by them (dynamo refuses both, even on constants), while every
comparison of M with a constant is a guard, a recompile per distinct plan. The traced plan is plain
arithmetic on the static facts (k, K, N, dtype, budget) with the contiguous layout's byte model
(``grouped_row_bytes``: with align 1 it holds exactly A rows), so the caller's ``M <= chunk`` is the one
guard, and a batch longer than a chunk adds one per chunk count.

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
from moekit.layouts import LayoutChoice, choose_layout, grouped_row_bytes

# 1 GiB of activations per call. The contiguous layout needs (2K + 3N) * 4 bytes per routed row in fp32
# (25.6 KB at Qwen3-30B-A3B's K=2048, N=768), so one chunk holds ~5000 tokens at k=8: ~320 rows per
# expert, where the GEMMs already run at their full rate, while a long prefill stays bounded in memory.
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
GROUPED_MM_LAYOUTS = ("contiguous", "masked_measured_cap")  # what this backend implements, for choose_layout
MASKED_ROUND_TO = 8  # the measured cap's rounding: bmm computes every padding row, so round finely


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
) -> GroupedMMPlan:
    """The layout and chunk size for M = ``num_tokens`` (cached per arguments). ``layout`` "auto" asks
    ``choose_layout`` (among GROUPED_MM_LAYOUTS; ``allow_sync=False`` leaves out the measured cap);
    a layout name forces it, still chunked to the budget. ``allow_sync=True`` (CPU eager) also counts
    the CPU per-expert loop's peak at ``torch.get_num_threads()`` workers. While ``torch.compile`` traces
    (any size may be a SymInt) the call gets the plan of every M without reading M: ``traced_plan``."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    if torch.compiler.is_compiling():
        return traced_plan(top_k, hidden_size, intermediate_size, dtype, budget, layout)
    workers = torch.get_num_threads() if allow_sync else 0
    key = (num_tokens, top_k, num_experts, hidden_size, intermediate_size, dtype, budget, layout, allow_sync, workers)
    plan = _PLANS.get(key)
    if plan is None:
        dims = (top_k, num_experts, hidden_size, intermediate_size)
        plan = _PLANS[key] = _plan(num_tokens, dims, dtype, budget, layout, allow_sync, workers)
    return plan


def traced_plan(top_k, hidden_size, intermediate_size, dtype: torch.dtype, budget: int, layout: str) -> GroupedMMPlan:
    """The plan of every M: contiguous, chunks of budget // (k * ``grouped_row_bytes``) tokens. Arithmetic
    only, so the sizes may be SymInts (the chunk is then an expression of them, never of M)."""
    _check(budget, layout, allow_sync=False)
    chunk = budget // (top_k * grouped_row_bytes(hidden_size, intermediate_size, dtype.itemsize))
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


def _chooser(dims, dtype, budget, layout, allow_sync, workers):
    """m tokens -> choose_layout's choice for them, where contiguous also needs the CPU per-expert loop
    (``workers`` > 0: it may run that layout's call) to fit; when it does not, the other candidates compete."""
    top_k, num_experts, hidden, inter = dims
    candidates = GROUPED_MM_LAYOUTS if layout == "auto" else (layout,)
    args = dict(top_k=top_k, num_experts=num_experts, hidden_size=hidden, intermediate_size=inter,
                dtype_bytes=dtype.itemsize, memory_budget_bytes=budget, align=1, allow_sync=allow_sync,
                cap_round_to=MASKED_ROUND_TO)

    def choose(m: int) -> LayoutChoice:
        choice = choose_layout(m, candidates=candidates, **args)
        if choice.name != "contiguous" or not workers:
            return choice
        loop = fused_loop_peak_bytes(m, top_k, hidden, inter, dtype, workers)
        if loop <= budget:
            return choice
        why = f"the CPU per-expert loop needs {loop / 2**20:.1f} MiB over the {budget / 2**20:.1f} MiB budget"
        others = tuple(c for c in candidates if c != "contiguous")
        if not others:
            return LayoutChoice("none", f"{choice.reason}, but {why}", choice.estimates)
        other = choose_layout(m, candidates=others, **args)
        return LayoutChoice(other.name, f"contiguous: {why}; {other.reason}", choice.estimates)

    return choose


def _plan(num_tokens, dims, dtype, budget, layout, allow_sync, workers) -> GroupedMMPlan:
    _check(budget, layout, allow_sync)
    choose = _chooser(dims, dtype, budget, layout, allow_sync, workers)
    chunk = max(num_tokens, 1)
    choice = choose(chunk)
    whole = choice.reason
    while choice.name == "none" and chunk > 1:  # halve until a chunk fits: the peak grows with the tokens
        chunk = (chunk + 1) // 2
        choice = choose(chunk)
    if choice.name == "none":
        raise ValueError(f"memory_budget_bytes={budget} cannot hold even one token's rows: {choice.reason}")
    reason = choice.reason if chunk >= num_tokens else f"{whole}; chunks of {chunk} tokens: {choice.reason}"
    return GroupedMMPlan(layout=choice.name, chunk_tokens=chunk, reason=reason)
