"""Experts on torch's GEMMs, the pipeline's stages in plain sight (the CPU default; CUDA without Triton):

    [Group: a moekit.layouts layout] -> [Experts: w13 GEMM + b13, glu, w2 GEMM + b2]
      -> [Combine: the layout's weighted inverse]

| layout (``layout=``)    | group                                | experts                   | combine                |
| ----------------------- | ------------------------------------ | ------------------------- | ---------------------- |
| ``contiguous``          | ``permute_contiguous`` (align 1)     | grouped GEMM on A rows    | ``combine_contiguous`` |
| ``masked_measured_cap`` | ``masked_layout_measured_cap_syncs`` | ``torch.bmm`` on [E, cap] | ``combine_masked``     |

``layout="auto"`` lets ``moekit.layouts.choose_layout`` pick per call from the shapes alone (no host
sync): the layout with the fewest GEMM rows whose whole run (combine included) fits
``memory_budget_bytes`` (default ``DEFAULT_MEMORY_BUDGET_BYTES``). When none fits, the tokens run in
chunks of the largest size that does (``plan_grouped_mm`` says which, and why). Under ``torch.compile``
the plan never reads M (with ``dynamic=True`` a SymInt): contiguous, in chunks of a size fixed by the
static shapes (``moekit.experts.grouped_mm_plan``), so one graph serves every M of one chunk count.

The grouped GEMM is ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where it runs, with a loop over the
non-empty experts elsewhere; on the CPU, when no gradient is needed, a per-expert loop of oneDNN GEMMs
(``cpu_gemm``; measured faster, see ``moekit bench --cpu-experts``): by default ``moekit.experts.cpu_packed``'s,
which gathers, multiplies on prepacked weights and combines one expert at a time in place of the contiguous layout's
[A, K] copies, with whole experts split across ``torch.get_num_threads()`` single-threaded workers
(``"onednn_packed_split"``, whose oneDNN GEMMs ``auto`` swaps for torch's BLAS on experts of fewer than 4 rows where
``cpu_packed.blas_plain_rows`` says; ``"onednn_packed"`` runs the same loop serially with multi-threaded GEMMs; at
decode sizes ``auto`` times both and runs the faster, ``moekit.experts.cpu_split_choice``).
Under ``torch.compile`` such a call (CPU, no gradient, plain weights) runs as the custom op ``moekit::cpu_experts``
(``moekit.experts.cpu_op``): the compiled graph calls this eager loop, which no trace could follow; a call that
needs a gradient traces the grouped GEMM path (``moekit::group_gemm``). Weight-only quantized weights (int8_w8a16,
int4_w4a16, mxfp4) in a CPU call without autograd run the same loop, each touched expert dequantized on its worker
or run by an integer or weight-only kernel (``moekit.experts.cpu_quant``), compiled as the op
``moekit::cpu_quant_experts`` (``moekit.experts.cpu_quant_op``); elsewhere all E are dequantized per call.

Variants (``moekit.activations.ActivationSpec``, biases) are data read by the same code: the glu is
``apply_glu``; a bias is added per routed row before the combine weights it (the grouped GEMM takes no
bias: a gather of the row's expert bias; ``torch.baddbmm`` in the masked layout; oneDNN's or
``torch.addmm``'s fused bias in the CPU loop). Strided weights (transposed storage) are read as views:
``_grouped_mm`` takes a row- or column-major B, ``bmm``/``mm`` pass strides to BLAS, oneDNN's linear
takes the view with no torch-side copy (measured at [64, 2048] x [1536, 2048]^T fp32 on 2 shared cores:
oneDNN 19 ms contiguous, 25 ms on the transposed view, torch.mm 53-56 ms either way).
bf16 / fp16 rounding: y + b2 is summed in float32 into the float32 combine; on the CPU (``FLOAT32_GLU_DEVICES``)
h + b13, the activation and its product are too, rounded once as the second GEMM's operand (``glu_operand``); on
CUDA they stay in x's dtype, where float32 cost up to 1.25x the call (``tests/test_bf16_rounding.py`` has the points).

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated)
w13 rows, T layout rows.
"""

from __future__ import annotations

import torch

from moekit.activations import ActivationSpec, apply_glu, as_spec, get_activation, spec_fields
from moekit.experts.cpu_op import cpu_experts_op
from moekit.func_ops import transforming
from moekit.experts.cpu_packed import (
    ExpertParams, experts_cpu_fused, fused_loop_supported, glu_rounded_once, onednn_linear, packed_weight_cache,
)
from moekit.experts.cpu_loop import run_cpu_loop
from moekit.experts.cpu_quant import weight_only
from moekit.experts.cpu_quant_op import cpu_quant_experts
from moekit.experts.grouped_mm_plan import (  # noqa: F401  (DEFAULT_MEMORY_BUDGET_BYTES, GroupedMMPlan: re-exported)
    DEFAULT_MEMORY_BUDGET_BYTES, FLOAT32_GLU_DEVICES, GROUPED_MM_LAYOUTS, MASKED_ROUND_TO, GroupedMMPlan,
    plan_grouped_mm,
)
from moekit.experts.torch_grouped import grouped_mm_fn, grouped_mm_takes
from moekit.layouts import combine_contiguous, combine_masked, masked_layout_measured_cap_syncs, permute_contiguous
from moekit.quant import QuantizedWeight, run_quantized

# "onednn_packed": moekit.experts.cpu_packed's per-expert loop on cached packed weights, each GEMM on
# torch's intra-op threads; "onednn_packed_split": the same loop with whole experts split across
# torch.get_num_threads() workers of one thread each (moekit.experts.cpu_workers); "onednn_fused": the
# loop on the plain weights; "auto" = "onednn_packed_split", but for experts of fewer than PACKED_MIN_ROWS rows
# through torch's BLAS where ``cpu_packed.blas_plain_rows`` says (float32, MKL, Intel); the others run inside the
# contiguous layout.
CPU_GEMMS = ("auto", "onednn_packed_split", "onednn_packed", "onednn_fused", "onednn_loop", "mm_loop", "grouped_mm")
_FUSED_GEMMS = ("auto", "onednn_packed_split", "onednn_packed", "onednn_fused")
# "auto" splits from M = cpu_split_choice.CHOSEN_BELOW on; below, ``cpu_loop`` times the split against the phased
# loop and runs the faster: unsplit, 2-thread GEMMs win when the cores are free (the phased loop by 20-40% at M = 1
# on the Xeon after a 2-thread op) but lost 8-16x when other processes shared them (the EPYC).
_SPLIT_GEMMS = ("auto", "onednn_packed_split")


def _expert_mlp(xs, ex: ExpertParams, offs, segment_ids, cpu_gemm) -> torch.Tensor:
    """xs [T, K] grouped by expert (rows offs[e-1]:offs[e], ``segment_ids`` [T] the expert of each row, -1
    past offs[-1]) -> w2[e] @ glu(w13[e] @ xs[r] + b13[e]) + b2[e] [T, K]."""
    inference = not (torch.is_grad_enabled() and (xs.requires_grad or ex.need_grad())) and not transforming()
    if xs.device.type == "cpu" and inference and cpu_gemm != "grouped_mm" and not torch.compiler.is_compiling():
        return _expert_mlp_cpu_loop(xs, ex, offs.tolist(), cpu_gemm)  # no sync on the CPU
    rows_expert = None  # [T]; E on rows of no expert
    if ex.b13 is not None or ex.b2 is not None:
        rows_expert = torch.where(segment_ids >= 0, segment_ids, ex.w13.shape[0])
    acc = torch.promote_types(xs.dtype, torch.float32)
    in_acc = xs.device.type in FLOAT32_GLU_DEVICES  # else h + b13 and the activation in xs's dtype (measured cost)
    h = _group_gemm(xs, ex.w13, offs)  # [T, R] in xs's dtype: the GEMM's own rounding
    # _grouped_mm takes no bias: a gather of the row's expert bias, [T, R]
    b13 = None if ex.b13 is None else _bias_rows(ex.b13, rows_expert, acc if in_acc else xs.dtype)
    a = glu_operand(h, ex.spec, b13) if in_acc else apply_glu(h if b13 is None else h + b13, ex.spec)  # [T, N]
    y = _group_gemm(a, ex.w2, offs)  # [T, K] in xs's dtype
    # + b2 in acc on every device: the combine upcasts y anyway (the same bytes)
    return y if ex.b2 is None else y + _bias_rows(ex.b2, rows_expert, acc)  # [T, K] acc


def _bias_rows(bias: torch.Tensor, rows_expert: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bias [E, D] -> [T, D] in ``dtype`` (the accumulation dtype: a sum with a GEMM's output is not rounded back),
    each row's expert's bias; 0 on rows of no expert (rows_expert == E): the grouped GEMM's backward leaves those
    rows' gradients unspecified, and they must reach no bias."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1], dtype=dtype)])[rows_expert]  # cat promotes to dtype


def glu_operand(h: torch.Tensor, spec: ActivationSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The second GEMM's operand: h [.., R], the first GEMM's output, (+ bias, broadcast to h, in the accumulation
    dtype) -> glu [.., N] in h's dtype, the bias, the activation and its product computed in the accumulation
    dtype (float32 for bf16 / fp16) and rounded once, where a bf16 GEMM forces it (a bf16 activation rounded
    act(gate), then its product). For float32 and float64 h: ``apply_glu(h + bias)``, as before."""
    acc = torch.promote_types(h.dtype, torch.float32)
    if bias is not None:
        return apply_glu(h + bias.to(acc), spec).to(h.dtype)
    if not spec.plain:
        return apply_glu(h.to(acc), spec).to(h.dtype)
    gate, up = h.chunk(2, dim=-1)  # [.., N] each
    act = get_activation(spec.name).fn(gate.to(acc))  # [.., N] acc; up stays h's dtype, the product promotes it
    return (act * up).to(h.dtype)


def _expert_mlp_cpu_loop(xs, ex: ExpertParams, ends: list[int], cpu_gemm) -> torch.Tensor:
    """The inference loop over the non-empty experts: both GEMMs of an expert back to back (its [m, R]
    stays in cache for the activation), the activation rounded once (``glu_rounded_once``), the outputs
    written into one preallocated [T, K]. Rows past ends[-1] are left unwritten."""
    linear = onednn_linear(xs.dtype) if cpu_gemm in (*_FUSED_GEMMS, "onednn_loop") else None
    acc = torch.promote_types(xs.dtype, torch.float32)
    y = xs.new_empty(xs.shape[0], ex.w2.shape[1])  # [T, K]
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            b13 = None if ex.b13 is None else ex.b13[expert]
            b2 = None if ex.b2 is None else ex.b2[expert]
            h = _cpu_linear(xs[rows], ex.w13[expert], b13, linear)  # [m, R], the bias fused: one rounding
            a = glu_rounded_once(h, ex.spec, acc)  # [m, N] contiguous: oneDNN would copy a strided view first
            _cpu_linear(a, ex.w2[expert], b2, linear, out=y[rows])
        start = end
    return y


def _cpu_linear(a, w, bias, linear, out=None) -> torch.Tensor:
    """a [m, in] @ w [out, in]^T (+ bias [out], fused) through oneDNN's ``linear`` when given, else BLAS;
    ``w`` may be strided; written into ``out`` [m, out] when given."""
    if linear is not None:
        result = linear(a, w, bias, "none", [], "")
        return result if out is None else out.copy_(result)
    if bias is None:
        return torch.mm(a, w.t(), out=out)
    return torch.addmm(bias, a, w.t(), out=out)


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
    # under a torch.func transform the loop: torch._grouped_mm has no forward-mode derivative (torch 2.13)
    if grouped_mm_takes(a, w) and not transforming():
        return grouped_mm_fn()(a.contiguous(), w.transpose(1, 2), offs=offs)
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
    w13: torch.Tensor,  # [E, R, K], any strides
    w2: torch.Tensor,  # [E, K, N], any strides
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, R]
    b2: torch.Tensor | None = None,  # [E, K]
    memory_budget_bytes: int | None = None,
    layout: str = "auto",
    cpu_gemm: str = "auto",
) -> torch.Tensor:
    """The experts contract (``moekit.experts``) through a ``moekit.layouts`` layout: group, GEMMs, combine.

    ``memory_budget_bytes`` bounds the activation buffers of one call (None = DEFAULT_MEMORY_BUDGET_BYTES;
    the biases' per-row gathers are not in its count; chunked under ``torch.compile``, the chunks' outputs,
    [M, K] in x's dtype in all, are also held until their cat: ``_run_chunks_traced``);
    ``layout`` "auto" or one of GROUPED_MM_LAYOUTS;
    ``cpu_gemm`` one of CPU_GEMMS ("auto" = the measured best). ``plan_grouped_mm`` tells which layout
    and chunk size a call gets.
    """
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm must be one of {CPU_GEMMS}, got {cpu_gemm!r}")
    options = dict(memory_budget_bytes=memory_budget_bytes, layout=layout, cpu_gemm=cpu_gemm)
    # weight-only QuantizedWeights in the CPU inference loop: per touched expert (``cpu_quant``); elsewhere
    # dequantized to x.dtype per call (correct, not fast); fp8_block: moekit.quant's recipe
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
        if _runs_quantized_loop(x, w13, w2, topk_weights, b13, b2, layout, cpu_gemm):
            if torch.compiler.is_compiling():  # the eager loop inside one opaque op (``cpu_quant_op``)
                return cpu_quant_experts(x, w13, w2, topk_ids, topk_weights, activation=activation,
                                         expert_map=expert_map, b13=b13, b2=b2,
                                         memory_budget_bytes=memory_budget_bytes, cpu_gemm=cpu_gemm)
            return _experts_quantized_loop(x, ExpertParams(w13, w2, b13, b2, as_spec(activation)), topk_ids,
                                           topk_weights, expert_map, memory_budget_bytes, cpu_gemm)
        return run_quantized(_experts_dense, x, w13, w2, topk_ids, topk_weights, activation=activation,
                             expert_map=expert_map, b13=b13, b2=b2, weight_dtype=x.dtype, dense_options=options)
    if _runs_cpu_op(x, w13, w2, topk_weights, b13, b2, cpu_gemm):  # compiled: the eager CPU loop, opaque
        t13, t2 = _transposed_storage(w13), _transposed_storage(w2)  # cross as stored (cpu_op says why)
        return cpu_experts_op(x, w13.transpose(1, 2) if t13 else w13, w2.transpose(1, 2) if t2 else w2, topk_ids,
                              topk_weights, expert_map, b13, b2, *spec_fields(activation), memory_budget_bytes, layout,
                              cpu_gemm, t13, t2)
    return _experts_dense(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map, b13=b13,
                          b2=b2, **options)


def _runs_cpu_op(x, w13, w2, topk_weights, b13, b2, cpu_gemm) -> bool:
    """Whether a call runs as ``moekit::cpu_experts`` (``cpu_op``): traced by torch.compile, on the CPU, a
    ``cpu_gemm`` of the eager loops, no gradient needed (the op has none; the traced path does)."""
    if not torch.compiler.is_compiling() or x.device.type != "cpu" or cpu_gemm == "grouped_mm":
        return False
    if not torch.is_grad_enabled():
        return True
    for t in (x, w13, w2, topk_weights, b13, b2):
        if t is not None and t.requires_grad:
            return False
    return True


def _runs_quantized_loop(x, w13, w2, topk_weights, b13, b2, layout, cpu_gemm) -> bool:
    """Whether a quantized call runs ``cpu_packed``'s loop, dequantizing per touched expert: CPU, both weights of
    one weight-only scheme, no gradient needed, the contiguous layout's fused GEMMs, x's dtype there (traced: as
    ``moekit::cpu_quant_experts``, whose eager call checks the dtype)."""
    if x.device.type != "cpu" or w13.device.type != "cpu":
        return False
    if not (weight_only(w13) and weight_only(w2) and w13.scheme == w2.scheme):
        return False
    if cpu_gemm not in _FUSED_GEMMS or layout not in ("auto", "contiguous"):
        return False
    # weight-only linears need no packed weights: without a oneDNN linear of x's dtype (bf16 on an AVX2 CPU)
    # they multiply on torch's BLAS (``cpu_packed.blas_linear``)
    if not torch.compiler.is_compiling() and not (x.dtype in (torch.float32, torch.bfloat16)
                                                  or fused_loop_supported(x.dtype)):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, topk_weights, b13, b2))
                or transforming())  # no autograd, no forward-mode derivative (as _run_contiguous's loop)


def _experts_quantized_loop(x, ex: ExpertParams, topk_ids, topk_weights, expert_map, memory_budget_bytes,
                            cpu_gemm) -> torch.Tensor:
    """x [M, K] -> [M, K] (x.dtype) by ``experts_cpu_fused`` on quantized weights, in the plan's chunks."""
    num_tokens, top_k = topk_ids.shape
    plan = plan_grouped_mm(num_tokens, top_k, ex.w13.shape[0], ex.w13.shape[2], ex.w2.shape[2], x.dtype,
                           memory_budget_bytes=memory_budget_bytes, layout="contiguous", allow_sync=True)
    workers = torch.get_num_threads() if cpu_gemm in _SPLIT_GEMMS else 1
    out = x.new_empty(x.shape)  # [M, K]
    for s in range(0, num_tokens, max(plan.chunk_tokens, 1)):
        e = s + plan.chunk_tokens
        out[s:e] = experts_cpu_fused(x[s:e], ex, topk_ids[s:e], topk_weights[s:e], expert_map, None, workers=workers)
    return out


def _transposed_storage(w: torch.Tensor) -> bool:
    """Whether w [E, out, in] is a transposed view of [E, in, out] storage (transformers' gpt-oss layout)."""
    return w.stride(1) == 1 and w.stride(2) != 1


def _experts_dense(x, w13, w2, topk_ids, topk_weights, *, activation, expert_map, b13, b2, memory_budget_bytes,
                   layout, cpu_gemm) -> torch.Tensor:
    """``experts_grouped_mm`` on plain weight tensors: plan, then the layout's run (per chunk)."""
    num_tokens, top_k = topk_ids.shape
    ex = ExpertParams(w13, w2, b13, b2, as_spec(activation))
    allow_sync = x.device.type == "cpu" and not torch.compiler.is_compiling()
    plan = plan_grouped_mm(num_tokens, top_k, w13.shape[0], w13.shape[2], w2.shape[2], x.dtype,
                           memory_budget_bytes=memory_budget_bytes, layout=layout, allow_sync=allow_sync,
                           device_type=x.device.type)
    run = _run_contiguous if plan.layout == "contiguous" else _run_masked
    if plan.chunk_tokens >= num_tokens:
        return run(x, ex, topk_ids, topk_weights, expert_map, cpu_gemm).to(x.dtype)
    if torch.compiler.is_compiling():
        return _run_chunks_traced(run, plan.chunk_tokens, x, ex, topk_ids, topk_weights, expert_map, cpu_gemm)
    out = x.new_empty(x.shape)  # [M, K]: each chunk's rows land here (a list of chunks then cat held M*K twice)
    for s in range(0, num_tokens, plan.chunk_tokens):
        e = s + plan.chunk_tokens
        out[s:e] = run(x[s:e], ex, topk_ids[s:e], topk_weights[s:e], expert_map, cpu_gemm)
    return out


def _run_chunks_traced(run, chunk: int, x, ex: ExpertParams, topk_ids, topk_weights, expert_map, cpu_gemm):
    """M > ``chunk`` tokens under torch.compile, in chunks of exactly ``chunk`` tokens, the last one ending at
    M and overlapping its predecessor (the overlap's rows are computed twice and kept once; a token's row
    depends on that token alone). Every run traces at the static size ``chunk``, so with a symbolic M the
    graph depends on M only through the chunk count (guards: M in ((n-1)*chunk, n*chunk]), never on a
    remainder's size (a one-token remainder would be specialised). Unlike eager, every chunk's output is held
    until the cat, cast to x's dtype first (M*K of it beyond the budget, not twice that in float32 for a
    bf16 x): writing each into one [M, K] as eager does was measured no lower under inductor and higher under
    aot_eager (functionalised, each write copies the whole [M, K])."""
    num_tokens = x.shape[0]
    count = (num_tokens + chunk - 1) // chunk  # >= 2
    starts = [i * chunk for i in range(count - 1)] + [num_tokens - chunk]
    outs = [run(x.narrow(0, s, chunk), ex, topk_ids.narrow(0, s, chunk), topk_weights.narrow(0, s, chunk), expert_map,
                cpu_gemm).to(x.dtype) for s in starts]  # each [chunk, K]
    outs[-1] = outs[-1][count * chunk - num_tokens:]  # drop the rows the previous chunk already holds
    return torch.cat(outs)  # [M, K]


def _run_contiguous(x, ex: ExpertParams, topk_ids, topk_weights, expert_map, cpu_gemm) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype) through the contiguous layout (on the CPU without
    autograd, the fused per-expert loop of ``moekit.experts.cpu_packed`` for its GEMM strategies)."""
    # the loop has no autograd: it serves only calls where nothing needs a gradient, the routed weights
    # included (a frozen-experts call still owes the router dL/dtopk_weights), and no torch.func transform
    # is active (its oneDNN GEMMs have no forward-mode derivative: under jvp the tangent came out zero)
    inference = (not (torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad or ex.need_grad()))
                 and not transforming())
    if (not torch.compiler.is_compiling() and cpu_gemm in _FUSED_GEMMS and x.device.type == "cpu" and inference
            and fused_loop_supported(x.dtype)):
        cache = None if cpu_gemm == "onednn_fused" else packed_weight_cache()
        return run_cpu_loop(x, ex, topk_ids, topk_weights, expert_map, cache, auto=cpu_gemm == "auto",
                            split=cpu_gemm in _SPLIT_GEMMS)
    # [Group] static_rows = A: the exact size for align 1, so no host sync; unrouted rows trail, src A.
    layout = permute_contiguous(x, topk_ids, ex.w13.shape[0], align=1, expert_map=expert_map,
                                static_rows=topk_ids.numel())
    offs = layout.offsets[1:].to(torch.int32)  # [E] end row of each expert
    # [Experts] rows past offs[-1] may hold anything: combine never adds them.
    y = _expert_mlp(layout.x_perm, ex, offs, layout.segment_ids, cpu_gemm)  # [A, K]
    return combine_contiguous(y, layout, topk_weights)  # [Combine] [M, K]


def _run_masked(x, ex: ExpertParams, topk_ids, topk_weights, expert_map, cpu_gemm) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype) through the masked layout with the measured cap (syncs)."""
    layout = masked_layout_measured_cap_syncs(x, topk_ids, ex.w13.shape[0], round_to=MASKED_ROUND_TO,
                                              expert_map=expert_map)  # [Group] x_masked [E, cap, K]
    h = _batched_linear(layout.x_masked, ex.w13, ex.b13)  # [Experts] [E, cap, R], the bias fused: one rounding
    y = _batched_linear(glu_operand(h, ex.spec), ex.w2, ex.b2)  # [E, cap, K] (the CPU only: the cap syncs)
    return combine_masked(y, layout, topk_weights)  # [Combine] [M, K]


def _batched_linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a [E, cap, in] @ w[e] [out, in]^T (+ bias[e] [out]) -> [E, cap, out]; w read through its strides."""
    if bias is None:
        return torch.bmm(a, w.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), a, w.transpose(1, 2))
