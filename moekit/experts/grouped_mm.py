"""Experts on torch's GEMMs, the pipeline's stages in plain sight (the CPU default; CUDA without Triton):

    [Group: a moekit.layouts layout] -> [Experts: w13 GEMM, act-and-mul, w2 GEMM] -> [Combine: the layout's weighted inverse]

| layout (``layout=``)    | group                                | experts                          | combine              |
| ----------------------- | ------------------------------------ | -------------------------------- | -------------------- |
| ``contiguous``          | ``permute_contiguous`` (align 1)     | grouped GEMM over the A rows     | ``combine_contiguous`` |
| ``masked_measured_cap`` | ``masked_layout_measured_cap_syncs`` | ``torch.bmm`` over [E, cap] rows | ``combine_masked``   |

``layout="auto"`` lets ``moekit.layouts.choose_layout`` pick per call from the shapes alone (no host
sync, so ``torch.compile`` traces it): the layout with the fewest GEMM rows whose peak activation bytes
fit ``memory_budget_bytes`` (default ``DEFAULT_MEMORY_BUDGET_BYTES``). When none fits, the tokens run in
chunks of the largest size that does (``plan_grouped_mm`` says which, and why).

The grouped GEMM is ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where it runs, with a
loop over the non-empty experts elsewhere; on the CPU, when no gradient is needed, a per-expert loop of
oneDNN GEMMs (``cpu_gemm``; measured faster, see ``benchmarks/cpu_experts.py``).

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate, T layout rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit.activations import act_and_mul, get_activation
from moekit.layouts import (
    choose_layout, combine_contiguous, combine_masked, masked_layout_measured_cap_syncs, permute_contiguous,
)
from moekit.quant import QuantizedWeight, run_quantized

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


# (shapes, dtype, options) -> plan. A plain dict: a hit traces as a lookup under torch.compile.
_PLANS: dict[tuple, GroupedMMPlan] = {}


def plan_grouped_mm(
    num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
    *, memory_budget_bytes: int | None = None, layout: str = "auto", allow_sync: bool = True,
) -> GroupedMMPlan:
    """The layout and chunk size for M = ``num_tokens`` (cached per arguments). ``layout`` "auto" asks
    ``choose_layout`` (among GROUPED_MM_LAYOUTS; ``allow_sync=False`` leaves out the measured cap);
    a layout name forces it, still chunked to the budget."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    key = (num_tokens, top_k, num_experts, hidden_size, intermediate_size, dtype, budget, layout, allow_sync)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(num_tokens, top_k, (num_experts, hidden_size, intermediate_size), dtype, budget,
                                   layout, allow_sync)
    return plan


def _plan(num_tokens, top_k, dims, dtype, budget, layout, allow_sync) -> GroupedMMPlan:
    if layout != "auto" and layout not in GROUPED_MM_LAYOUTS:
        raise ValueError(f"layout must be 'auto' or one of {GROUPED_MM_LAYOUTS}, got {layout!r}")
    if layout == "masked_measured_cap" and not allow_sync:
        raise ValueError("layout='masked_measured_cap' reads the counts back to the host: CPU eager only")
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive int or None, got {budget!r}")
    candidates = GROUPED_MM_LAYOUTS if layout == "auto" else (layout,)
    args = dict(top_k=top_k, num_experts=dims[0], hidden_size=dims[1], intermediate_size=dims[2],
                dtype_bytes=torch.empty((), dtype=dtype).element_size(), memory_budget_bytes=budget, align=1,
                allow_sync=allow_sync, candidates=candidates,
                cap_round_to=MASKED_ROUND_TO)
    chunk = max(num_tokens, 1)
    choice = choose_layout(chunk, **args)
    whole = choice.reason
    while choice.name == "none" and chunk > 1:  # halve until a chunk fits: the peak grows with the tokens
        chunk = (chunk + 1) // 2
        choice = choose_layout(chunk, **args)
    if choice.name == "none":
        raise ValueError(f"memory_budget_bytes={budget} cannot hold even one token's rows: {choice.reason}")
    reason = choice.reason if chunk >= num_tokens else f"{whole}; chunks of {chunk} tokens: {choice.reason}"
    return GroupedMMPlan(layout=choice.name, chunk_tokens=chunk, reason=reason)


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs a grouped GEMM of ``dtype`` on ``device_type`` (probed once)."""
    fn = _grouped_mm_fn()
    if fn is None:
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        fn(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


CPU_GEMMS = ("auto", "onednn_loop", "mm_loop", "grouped_mm")


def _expert_mlp(xs, w13, w2, offs, activation, cpu_gemm) -> torch.Tensor:
    """xs [T, K] grouped by expert (rows offs[e-1]:offs[e]) -> w2[e] @ act_and_mul(w13[e] @ xs[r]) [T, K]."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm must be one of {CPU_GEMMS}, got {cpu_gemm!r}")
    inference = not (torch.is_grad_enabled() and (xs.requires_grad or w13.requires_grad or w2.requires_grad))
    if xs.device.type == "cpu" and inference and cpu_gemm != "grouped_mm" and not torch.compiler.is_compiling():
        return _expert_mlp_cpu_loop(xs, w13, w2, offs.tolist(), activation, cpu_gemm)  # no sync on the CPU
    h = _group_gemm(xs, w13, offs)  # [T, 2N]
    return _group_gemm(act_and_mul(h, activation), w2, offs)  # [T, K]


def _expert_mlp_cpu_loop(xs, w13, w2, ends: list[int], activation, cpu_gemm) -> torch.Tensor:
    """The inference loop over the non-empty experts: both GEMMs of an expert back to back (its [m, 2N]
    stays in cache for the activation), the activation's product in place, the outputs written into one
    preallocated [T, K]. Rows past ends[-1] are left unwritten."""
    linear = _onednn_linear(xs.dtype) if cpu_gemm in ("auto", "onednn_loop") else None
    act = get_activation(activation).fn
    n_dim = w2.shape[2]
    y = xs.new_empty(xs.shape[0], w2.shape[1])  # [T, K]
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            if linear is None:
                h = torch.mm(xs[rows], w13[expert].t())  # [m, 2N]
            else:
                h = linear(xs[rows], w13[expert], None, "none", [], "")
            a = act(h[:, :n_dim])  # [m, N], contiguous: oneDNN would copy a strided view of h first
            a.mul_(h[:, n_dim:])  # in place: one [m, N] buffer, not two as act_and_mul allocates
            if linear is None:
                torch.mm(a, w2[expert].t(), out=y[rows])
            else:
                y[rows] = linear(a, w2[expert], None, "none", [], "")
        start = end
    return y


@functools.cache
def _onednn_linear(dtype: torch.dtype):
    """oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, what inductor calls for CPU linears) if
    this torch has it and it runs ``dtype``; None otherwise (then the loop uses ``torch.mm``)."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        a, w = torch.ones(3, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
        return op if torch.equal(op(a, w, None, "none", [], ""), a @ w.t()) else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _group_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [A, in] grouped by expert (rows offs[e-1]:offs[e]) times w[e] [out, in]^T -> [A, out].

    Under ``torch.compile`` it runs as the custom op ``moekit::group_gemm``: the compiler sees only
    its fake (a shape), never ``_grouped_mm``'s meta, which accepts bf16 alone although the CPU kernel
    runs fp32 and fp16 too, nor the support probe or the fallback loop's host sync. Eager calls skip
    the op's dispatch, so eager speed is unchanged.
    """
    if torch.compiler.is_compiling():
        return group_gemm_op(a, w, offs)
    return _group_gemm_eager(a, w, offs)


def _group_gemm_eager(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # torch's grouped GEMM needs 16-byte aligned row strides on both operands.
    aligned = (a.shape[1] * a.element_size()) % 16 == 0 and (w.shape[1] * w.element_size()) % 16 == 0
    if aligned and grouped_mm_supported(a.device.type, a.dtype):
        return _grouped_mm_fn()(a.contiguous(), w.transpose(1, 2), offs=offs)
    out = a.new_zeros(a.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):  # host sync: the fallback loops over experts
        if end > start:
            out[start:end] = a[start:end] @ w[expert].t()
        start = end
    return out


@torch.library.custom_op("moekit::group_gemm", mutates_args=())
def group_gemm_op(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``_group_gemm`` as one opaque op: a [A, in], w [E, out, in], offs [E] int32 -> [A, out]
    (rows past offs[-1] are unspecified, as with ``_grouped_mm``)."""
    return _group_gemm_eager(a, w, offs)


@group_gemm_op.register_fake
def _(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], w.shape[1])


@torch.library.custom_op("moekit::group_gemm_weight_grad", mutates_args=())
def group_gemm_weight_grad_op(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dL/dw of ``group_gemm_op``: grad [A, out], a [A, in], offs [E] -> [E, out, in],
    w_grad[e] = grad[rows of e]^T @ a[rows of e]."""
    out = grad.new_zeros(offs.shape[0], grad.shape[1], a.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):  # host sync: only the compiled backward comes here
        if end > start:
            out[expert] = grad[start:end].t() @ a[start:end]
        start = end
    return out


@group_gemm_weight_grad_op.register_fake
def _(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offs.shape[0], grad.shape[1], a.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    a, w, offs = ctx.saved_tensors
    grad_a = group_gemm_op(grad, w.transpose(1, 2).contiguous(), offs) if ctx.needs_input_grad[0] else None  # [A, in]
    grad_w = group_gemm_weight_grad_op(grad, a, offs) if ctx.needs_input_grad[1] else None  # [E, out, in]
    return grad_a, grad_w, None


group_gemm_op.register_autograd(_backward, setup_context=_setup_context)


def experts_grouped_mm(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    memory_budget_bytes: int | None = None,
    layout: str = "auto",
    cpu_gemm: str = "auto",
) -> torch.Tensor:
    """The experts contract (``moekit.experts``) through a ``moekit.layouts`` layout: group, GEMMs, combine.

    ``memory_budget_bytes`` bounds the activation buffers of one call (None = DEFAULT_MEMORY_BUDGET_BYTES);
    ``layout`` "auto" or one of GROUPED_MM_LAYOUTS; ``cpu_gemm`` one of CPU_GEMMS ("auto" = the measured
    best). ``plan_grouped_mm`` tells which layout and chunk size a call gets.
    """
    # QuantizedWeights: dequantized to x.dtype per call (correct, not fast); fp8_block: moekit.quant's recipe
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
        return run_quantized(experts_grouped_mm, x, w13, w2, topk_ids, topk_weights, activation=activation,
                             expert_map=expert_map, weight_dtype=x.dtype, dense_options=dict(
                                 memory_budget_bytes=memory_budget_bytes, layout=layout, cpu_gemm=cpu_gemm))
    num_tokens, top_k = topk_ids.shape
    allow_sync = x.device.type == "cpu" and not torch.compiler.is_compiling()
    plan = plan_grouped_mm(num_tokens, top_k, w13.shape[0], x.shape[1], w2.shape[2], x.dtype,
                           memory_budget_bytes=memory_budget_bytes, layout=layout, allow_sync=allow_sync)
    run = _run_contiguous if plan.layout == "contiguous" else _run_masked
    if plan.chunk_tokens >= num_tokens:
        return run(x, w13, w2, topk_ids, topk_weights, activation, expert_map, cpu_gemm).to(x.dtype)
    chunks = [
        run(x[s:s + plan.chunk_tokens], w13, w2, topk_ids[s:s + plan.chunk_tokens],
            topk_weights[s:s + plan.chunk_tokens], activation, expert_map, cpu_gemm)
        for s in range(0, num_tokens, plan.chunk_tokens)
    ]
    return torch.cat(chunks).to(x.dtype)  # [M, K]


def _run_contiguous(x, w13, w2, topk_ids, topk_weights, activation, expert_map, cpu_gemm) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype) through the contiguous layout."""
    # [Group] static_rows = A: the exact size for align 1, so no host sync; unrouted rows trail, src A.
    layout = permute_contiguous(x, topk_ids, w13.shape[0], align=1, expert_map=expert_map,
                                static_rows=topk_ids.numel())
    offs = layout.offsets[1:].to(torch.int32)  # [E] end row of each expert
    # [Experts] rows past offs[-1] may hold anything: combine never adds them.
    y = _expert_mlp(layout.x_perm, w13, w2, offs, activation, cpu_gemm)  # [A, K]
    return combine_contiguous(y, layout, topk_weights)  # [Combine] [M, K]


def _run_masked(x, w13, w2, topk_ids, topk_weights, activation, expert_map, cpu_gemm) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype) through the masked layout with the measured cap (syncs)."""
    layout = masked_layout_measured_cap_syncs(x, topk_ids, w13.shape[0], round_to=MASKED_ROUND_TO,
                                              expert_map=expert_map)  # [Group] x_masked [E, cap, K]
    h = torch.bmm(layout.x_masked, w13.transpose(1, 2))  # [Experts] [E, cap, 2N]
    y = torch.bmm(act_and_mul(h, activation), w2.transpose(1, 2))  # [E, cap, K]
    return combine_masked(y, layout, topk_weights)  # [Combine] [M, K]
