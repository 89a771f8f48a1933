"""The "scratch" decode of the weight-only Triton experts (``triton_wo``): dequantize each packed weight
once into a dense scratch buffer, then run moekit's 16-bit grouped GEMMs (``triton_plan``: the bf16
kernels, tuned bf16 configs, TMA weight descriptors) on it. At large batches the fused decodes pay
their dequantization in every tile's inner loop, on tensor-core time; here it is paid once per weight.

    per chunk of experts [e0, e0 + c):
        [dequant w13 -> scratch [c, 2N, K]] -> [align (chunk map)] -> [bf16 gate-up GEMM, act-and-mul -> h]
        -> [dequant w2 -> the same scratch, as [c, K, N]] -> [bf16 down GEMM, x routed weight -> y]
    then [sum over the k slots of y -> out]

Memory: the scratch holds one matrix of one chunk of experts, c x max(2N*K, K*N) elements of x's dtype
(w2 overwrites w13 once the gate-up GEMM has read it). All experts are one chunk while that is at
most ``SCRATCH_MAX_BYTES``; beyond it the experts run in chunks of as many as fit, each chunk through
the bf16 path with an expert map that routes only its experts here (the others' assignments are skipped
by that chunk's GEMMs and written by their own chunk's), and one k-sum at the end. A single expert's
matrix above the cap: the chooser (``scratch_fits``) keeps the fused decodes, and an explicit
``decode="scratch"`` is an error naming the cap. Every expert is dequantized, routed or not: at the
batch sizes where this decode is chosen (``SCRATCH_MIN_TOKENS``) every expert receives tokens.

With ``overlap`` (SCRATCH_OVERLAP; CUDA only) each dequant runs on a side stream while the GEMM before
it runs (``_pipelined``): at least two chunks, w2 in a buffer of its own, so only the first chunk's w13
dequant is not hidden behind a compute-bound GEMM.

Expert biases and the activation variant (gpt-oss as it ships): each chunk's bf16 GEMMs add its experts' rows of
b13 [E, 2N] / b2 [E, K] (``_chunk_bias``: a view, indexed as the chunk's scratch is) and run the spec's constexprs
(interleaved gate/up rows read from the scratch as w13 stores them, alpha, the clamp, up_shift); the call's kind
(``scratch_key``) and each chunk's bf16 plan are keyed by them, their values are each call's pointers.

No host synchronisation in a call: CUDA-graph capturable. What a call launches besides its chunks' bf16
plans is kept per kind of call (``triton_wo_scratch_plan.ScratchPlan``: the dequant and k-sum launches
bound once, the chunk maps built once from the host), and a repeated eager call without a map runs from
a recorded sequence on a kept scratch (``triton_quant_fast``, ``scratch_lean_inputs``). Under Triton's
interpreter the scratch is float32, as the workspaces are (``triton``'s docstring).

Torch twin: ``triton_wo.fused_experts_wo_torch`` (the same dequantization, a float32 per-expert loop).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, c experts per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec
from moekit.experts.triton_align import run_align
from moekit.experts.triton_cache import WorkspaceSpec
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting
from moekit.experts.triton_plan import DTYPES, Plan, plan_for
from moekit.experts.triton_wo_scratch_plan import (
    DEQUANT_TILE, ScratchChunk, ScratchPlan, chunk_map_of, dequant_launch, lean_spec, scratch_key, scratch_plan_for,
    scratch_weights,
)

# Batches of at least this many tokens take the scratch decode (where the scratch fits). H200, Triton
# 3.6, bf16 activations, fused tile decode -> scratch, time over moekit's bf16 (results/raw/
# NVIDIA_H200-2026-12-01-87d0e52-wo_large.log): M=4096 Qwen3-30B-A3B int4 1.79 -> 1.55, mxfp4 2.05 ->
# 1.52, int8 1.48 -> 1.66 (the one cell where the fused decode stays faster), Mixtral-8x7B 2.18-2.42 ->
# 1.21-1.28; M=16384 every scheme 1.40-2.33 -> 0.96-1.10. At M=1024 the dequantization (every weight
# written once in bf16 and read back: 0.4-1.1 ms) is not paid back: scratch 1.56-2.20 against tile 1.19-2.47.
SCRATCH_MIN_TOKENS = 4096
# Calls with expert biases or an activation variant (gpt-oss) of these (scheme, E, N, K) take the scratch decode from
# this M (and on, as any call from SCRATCH_MIN_TOKENS): one H100, Triton 3.6, session 39, benchmarks/
# scr39_device_check.py at a2e93db9 (results/scr39/scr39.log), gpt-oss-20b's experts with b13 / b2 and its spec, graph
# µs scratch / the fused tile decode (the route's before) / bf16, 5 settled rounds: mxfp4 M=512 1346.3 / 1042.3 /
# 601.0 (the tile decode faster: not taken), M=1024 1431.6 / 1556.5 / 687.1 (x1.09, >= 3% in 5/5), M=4096 2298.0 /
# 4421.8 / 1554.4 (x1.92, 5/5); int4 g128 1353.5 / 1044.1, 1439.5 / 1565.3 (x1.09, 5/5), 2358.8 / 4510.5 (x1.91,
# 5/5). Unmeasured and so left to SCRATCH_MIN_TOKENS: int8, other shapes (gpt-oss-120b's E = 128), plain calls of
# this shape; int4 of other group sizes follows the g128 row.
VARIANT_SCRATCH_FROM: dict[tuple[str, int, int, int], int] = {
    ("mxfp4", 32, 2880, 2880): 1024,
    ("int4_w4a16", 32, 2880, 2880): 1024,
}
# The largest scratch buffer (bytes) the path allocates: all experts at once up to this, else chunks.
# 2 GiB holds Mixtral-8x7B's w13 (8 x 28672 x 4096 bf16 = 1.88 GB: one chunk) and Qwen3-30B-A3B's
# (128 x 1536 x 2048 bf16 = 0.81 GB); DeepSeek-V3's (256 x 4096 x 7168 = 15 GB) runs in 8 chunks of 36.
SCRATCH_MAX_BYTES = 2 << 30
# Dequantize the next matrix on a side stream while the current GEMM runs (at least two chunks, w2 its own
# buffer: 1.5x the scratch of a chunk). Off until the device check (``wo_large_device_check``, its
# "overlap" column) measures it faster.
SCRATCH_OVERLAP = False


def scratch_bytes_per_expert(n: int, hidden: int, itemsize: int) -> int:
    """The scratch one expert takes: its larger matrix, w13 [2N, K] (w2 [K, N] is half of it)."""
    return 2 * n * hidden * itemsize


def scratch_fits(n: int, hidden: int, itemsize: int, max_bytes: int = SCRATCH_MAX_BYTES) -> bool:
    """Whether one expert's dequantized matrix fits ``max_bytes`` (else the scratch decode cannot run)."""
    return scratch_bytes_per_expert(n, hidden, itemsize) <= max_bytes


def variant_takes_scratch(scheme: str, num_tokens: int, num_experts: int, n: int, hidden: int, itemsize: int) -> bool:
    """Whether a call with biases or an activation variant takes the scratch decode below SCRATCH_MIN_TOKENS: from
    its shape's VARIANT_SCRATCH_FROM M, where one expert's scratch fits (``scratch_fits``)."""
    start = VARIANT_SCRATCH_FROM.get((scheme, num_experts, n, hidden))
    return start is not None and num_tokens >= start and scratch_fits(n, hidden, itemsize)


def experts_per_chunk(num_experts: int, n: int, hidden: int, itemsize: int, max_bytes: int = SCRATCH_MAX_BYTES) -> int:
    """As many experts as fit ``max_bytes`` of scratch (all of them where they do); an error naming the
    cap where not even one does."""
    per_expert = scratch_bytes_per_expert(n, hidden, itemsize)
    if per_expert > max_bytes:
        raise ValueError(f"decode='scratch' needs {per_expert} bytes of scratch for one expert's w13 [2N={2 * n}, "
                         f"K={hidden}], above max_scratch_bytes={max_bytes} (use another decode)")
    return min(num_experts, max_bytes // per_expert)


def dequantize_experts(w, scheme_id: int, cols: int, out: torch.Tensor, expert0: int,
                       tile: tuple[int, int] = DEQUANT_TILE) -> None:
    """out [c, R, C] (rows contiguous) = experts [expert0, expert0 + c) of the packed weight ``w`` (a
    ``triton_wo_plan.WeightArgs``) dequantized, rounded once to out's dtype; ``cols`` = C; ``tile``:
    (BLOCK_R, BLOCK_C), powers of 2, BLOCK_C >= 32. A launch bound for this call (a plan's are kept:
    ``triton_wo_scratch_plan.dequant_launch``)."""
    chunk, rows = out.shape[:2]
    launch = dequant_launch(w, scheme_id, rows, cols, chunk, expert0, (out.stride(0), out.stride(1)), tile=tile)
    launch(w.q, w.scale, w.zero, out)


@dataclass(frozen=True, eq=False)
class _Chunk:
    """What one chunk of experts launches with this call (built on the host before anything launches)."""

    kept: ScratchChunk  # its dequant launches
    expert_map: torch.Tensor | None  # the chunk's (kept or built now), or the caller's for a single chunk
    plan: Plan  # the bf16 plan over the scratch views
    weights: tuple  # w13 (or its gate descriptor), the up descriptor or None, w2 (or its descriptor)
    align_buffers: dict | None  # the alignment's regions (None in the naive shortcut)
    rows: tuple  # sorted_ids, expert_ids, num_padded of align_buffers (None x 3 in the naive shortcut)
    w13_view: torch.Tensor  # [c, 2N, K] scratch
    w2_view: torch.Tensor  # [c, K, N] scratch
    b13: torch.Tensor | None  # [c, 2N]: the chunk's rows of the call's b13 (a view), or None
    b2: torch.Tensor | None  # [c, K]: the chunk's rows of the call's b2 (a view), or None


def run_experts_wo_scratch(
    x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, expert_map: torch.Tensor | None,
    scheme_id: int, activation: str | ActivationSpec, options: LaunchOptions = LaunchOptions(),
    max_scratch_bytes: int | None = None, overlap: bool | None = None, b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, K] (x.dtype) through the scratch decode; ``w13`` / ``w2``: ``WeightArgs``; ``ids`` /
    ``weights`` [M, k] contiguous, at least one assignment; arguments already checked. ``activation``: a name
    or an ``ActivationSpec`` (the bf16 kernels' variant: interleaved rows read from the scratch as stored);
    b13 [E, 2N] (w13's row order) / b2 [E, K] or None: each chunk's GEMMs add its experts' rows (``_chunk_bias``).
    ``overlap`` (CUDA only): see SCRATCH_OVERLAP; it and ``max_scratch_bytes``: None for the module's settings."""
    max_scratch_bytes = SCRATCH_MAX_BYTES if max_scratch_bytes is None else max_scratch_bytes
    (num_experts, two_n), (num_tokens, top_k), hidden = w13.q.shape[:2], ids.shape, x.shape[1]
    n, num_assignments = two_n // 2, num_tokens * top_k
    per, overlap = scratch_chunking(x, num_experts, n, hidden, max_scratch_bytes, overlap)
    b13, b2 = _bias_arg(b13), _bias_arg(b2)
    key = scratch_key(x, w13, w2, ids, weights, expert_map, scheme_id, activation, options, per, overlap, b13, b2)
    kept = scratch_plan_for(key, x, w13, w2, top_k, expert_map, scheme_id, per, options)
    work = kept.work_dtype
    up_buffer = torch.empty(per * two_n * hidden, dtype=work, device=x.device)  # [c, 2N, K]
    down_buffer = torch.empty(per * hidden * n, dtype=work, device=x.device) if overlap else up_buffer  # [c, K, N]
    h = torch.empty(num_assignments, n, dtype=work, device=x.device)  # [A, N]
    y = torch.empty(num_assignments, hidden, dtype=work, device=x.device)  # [A, K]
    if options.poison_workspace:
        h.fill_(float("nan"))
        y.fill_(float("nan"))
    chunks = [_chunk(x, ids, weights, expert_map, activation, options, up_buffer, down_buffer, n, kept, chunk,
                     b13, b2) for chunk in kept.chunks]
    if kept.workspace is None and not overlap:  # what the lean form keeps (``triton_wo_scratch_plan.lean_spec``)
        kept.workspace = lean_spec(kept, [chunk.plan for chunk in chunks], num_assignments, n, hidden)
    steps = [(chunk, up) for chunk in chunks for up in (True, False)]  # gate-up then down, chunk by chunk

    def dequant(chunk: _Chunk, up: bool) -> None:
        if up:
            chunk.kept.dequant13(w13.q, w13.scale, w13.zero, chunk.w13_view)
        else:
            chunk.kept.dequant2(w2.q, w2.scale, w2.zero, chunk.w2_view)

    def gemm(chunk: _Chunk, up: bool) -> None:
        w13_arg, w13_up_arg, w2_arg = chunk.weights
        if up:
            if chunk.plan.align is not None:  # a folded alignment launches nothing: the gate-up GEMM fills rows
                run_align(chunk.plan.align, ids, chunk.expert_map, chunk.align_buffers)
            chunk.plan.gate_up(x, w13_arg, w13_up_arg, chunk.b13, h, ids, *chunk.rows, chunk.expert_map)
        else:
            chunk.plan.down(h, w2_arg, chunk.b2, y, weights, ids, *chunk.rows, None, None, None)

    if overlap:
        _pipelined(steps, dequant, gemm, x.device)
    else:
        for step in steps:
            dequant(*step)
            gemm(*step)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [M, K]
    kept.ksum(y, ids, expert_map if expert_map is not None else ids, out)
    return out


def scratch_chunking(x: torch.Tensor, num_experts: int, n: int, hidden: int, max_scratch_bytes: int | None = None,
                     overlap: bool | None = None) -> tuple[int, bool]:
    """(experts per chunk, whether the dequants overlap the GEMMs) of a call: the module's settings for None."""
    max_scratch_bytes = SCRATCH_MAX_BYTES if max_scratch_bytes is None else max_scratch_bytes
    overlap = SCRATCH_OVERLAP if overlap is None else overlap
    work = torch.float32 if interpreting() else x.dtype  # the interpreter's bf16 rounding truncates
    per = experts_per_chunk(num_experts, n, hidden, work.itemsize, max_scratch_bytes)
    overlap = overlap and x.device.type == "cuda" and num_experts > 1
    if overlap:  # two chunks at least, and w2 its own buffer: each dequant has a GEMM to hide behind
        per = min(per, cdiv(num_experts, 2))
    return per, overlap


def _bias_arg(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the bf16 kernels read it: contiguous (a strided one copied), of a dtype they take (another
    float dtype, e.g. float64, as float32: the kernels add it in float32)."""
    if bias is None:
        return None
    return (bias if bias.dtype in DTYPES else bias.float()).contiguous()


def _chunk_bias(bias: torch.Tensor | None, chunk: ScratchChunk) -> torch.Tensor | None:
    """The rows of experts [expert0, expert0 + count) of a bias [E, R]: the chunk's GEMMs index it by the
    expert's index in the chunk (its chunk map's value), as they index the chunk's scratch."""
    return None if bias is None else bias[chunk.expert0:chunk.expert0 + chunk.count]


def _chunk(x, ids, weights, expert_map, activation: str | ActivationSpec, options: LaunchOptions,
           up_buffer: torch.Tensor, down_buffer: torch.Tensor, n: int, plan: ScratchPlan, kept: ScratchChunk,
           b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> _Chunk:
    """The bf16 plan, scratch views, weight descriptors, alignment buffers and bias rows of one chunk."""
    hidden, count = x.shape[1], kept.count
    w13_view = up_buffer[:count * 2 * n * hidden].view(count, 2 * n, hidden)
    w2_view = down_buffer[:count * hidden * n].view(count, hidden, n)
    cmap = chunk_map_of(plan, kept, expert_map, x.device)
    bias13, bias2 = _chunk_bias(b13, kept), _chunk_bias(b2, kept)
    bf16 = plan_for(x, w13_view, w2_view, ids, weights, cmap, activation, None, options, bias13, bias2)
    buffers, rows = None, (None, None, None)
    if bf16.align is not None:
        buffers = WorkspaceSpec.of(list(bf16.align.regions)).allocate(x.device)
        rows = (buffers["sorted_ids"], buffers["expert_ids"], buffers["num_padded"])
    return _Chunk(kept, cmap, bf16, scratch_weights(bf16, w13_view, w2_view), buffers, rows, w13_view, w2_view,
                  bias13, bias2)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the stream the overlapped dequants run on


def _pipelined(steps: list, dequant, gemm, device: torch.device) -> None:
    """Each step's dequant on a side stream, its GEMM on the current one: step j + 1's dequant runs while
    step j's GEMM does. The gate-up steps write one buffer and the down steps the other, so step j + 1's
    dequant waits only for step j - 1's GEMM (the last reader of its buffer). Forked from and joined back
    into the current stream (CUDA-graph capturable: the events become the graph's edges)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(device))
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)  # x, ids and the weights are ready; the fork of a capture
    dequantized, read = [], []  # per step: its dequant's event (side), its GEMM's event (main)
    for j, step in enumerate(steps):
        if j == 0:
            with torch.cuda.stream(side):
                dequant(*step)
                dequantized.append(side.record_event())
        main.wait_event(dequantized[j])
        gemm(*step)
        read.append(main.record_event())
        if j + 1 < len(steps):
            if j >= 1:
                side.wait_event(read[j - 1])  # step j - 1's GEMM read the buffer step j + 1 writes
            with torch.cuda.stream(side):
                dequant(*steps[j + 1])
                dequantized.append(side.record_event())
    main.wait_stream(side)  # the join
