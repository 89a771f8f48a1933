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

No host synchronisation (the chunk maps are built on the device from shapes): CUDA-graph capturable.
Under Triton's interpreter the scratch is float32, as the workspaces are (``triton``'s docstring).

Torch twin: ``triton_wo.fused_experts_wo_torch`` (the same dequantization, a float32 per-expert loop).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, c experts per chunk.
"""

from __future__ import annotations

import torch

from moekit.experts.triton_align import run_align
from moekit.experts.triton_cache import WorkspaceSpec, descriptor_pair
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels
from moekit.experts.triton_plan import plan_for, sum_launch

# Batches of at least this many tokens take the scratch decode (where the scratch fits). H200, Triton
# 3.6, bf16 activations, scratch vs the fused tile decode (the lost first build of this path):
# Qwen3-30B-A3B int4 M=4096 1.51x faster, M=16384 1.05x; Mixtral-8x7B int4 M=4096 1.08x, M=16384 1.00x,
# mxfp4 M=16384 0.97x; at M=1024 the dequantization (every weight written once in bf16 and read back)
# is not yet paid back. ``benchmarks/wo_large_device_check.py`` re-measures all three M.
SCRATCH_MIN_TOKENS = 4096
# The largest scratch buffer (bytes) the path allocates: all experts at once up to this, else chunks.
# 2 GiB holds Mixtral-8x7B's w13 (8 x 28672 x 4096 bf16 = 1.88 GB: one chunk) and Qwen3-30B-A3B's
# (128 x 1536 x 2048 bf16 = 0.81 GB); DeepSeek-V3's (256 x 4096 x 7168 = 15 GB) runs in 8 chunks of 36.
SCRATCH_MAX_BYTES = 2 << 30
DEQUANT_TILE = (32, 128)  # BLOCK_R, BLOCK_C of the dequant kernel (one 4-warp program: 4096 weights)


def scratch_bytes_per_expert(n: int, hidden: int, itemsize: int) -> int:
    """The scratch one expert takes: its larger matrix, w13 [2N, K] (w2 [K, N] is half of it)."""
    return 2 * n * hidden * itemsize


def scratch_fits(n: int, hidden: int, itemsize: int, max_bytes: int = SCRATCH_MAX_BYTES) -> bool:
    """Whether one expert's dequantized matrix fits ``max_bytes`` (else the scratch decode cannot run)."""
    return scratch_bytes_per_expert(n, hidden, itemsize) <= max_bytes


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
    (BLOCK_R, BLOCK_C), powers of 2, BLOCK_C >= 32."""
    chunk, rows = out.shape[:2]
    block_r, block_c = tile
    stored = cols if scheme_id == 0 else w.q.shape[2]  # int8: one byte a weight, else two weights a byte
    span = block_c if scheme_id == 0 else min(block_c, w.group_size)
    kernels("dequant_wo").dequant_wo_kernel[(cdiv(rows, block_r), cdiv(cols, block_c), chunk)](
        w.q, w.scale, w.zero, out, rows, cols, stored, expert0, *w.strides, out.stride(0), out.stride(1),
        SCHEME=scheme_id, GROUP=w.group_size, SPAN=span, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )


def chunk_map(expert_map: torch.Tensor | None, num_experts: int, expert0: int, chunk: int,
              device: torch.device) -> torch.Tensor:
    """The expert map of one chunk: global id -> its index in [expert0, expert0 + chunk), -1 for every
    other expert (through ``expert_map`` where there is one; without one, global ids are local ids)."""
    local = torch.arange(num_experts, dtype=torch.int32, device=device) if expert_map is None else expert_map
    inside = (local >= expert0) & (local < expert0 + chunk)
    return torch.where(inside, local - expert0, torch.full_like(local, -1))


def run_experts_wo_scratch(
    x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, expert_map: torch.Tensor | None,
    scheme_id: int, activation: str, options: LaunchOptions = LaunchOptions(),
    max_scratch_bytes: int = SCRATCH_MAX_BYTES,
) -> torch.Tensor:
    """out [M, K] (x.dtype) through the scratch decode; ``w13`` / ``w2``: ``WeightArgs``; ``ids`` /
    ``weights`` [M, k] contiguous, at least one assignment; arguments already checked."""
    (num_experts, two_n), (num_tokens, top_k), hidden = w13.q.shape[:2], ids.shape, x.shape[1]
    n, num_assignments = two_n // 2, num_tokens * top_k
    work = torch.float32 if interpreting() else x.dtype  # the interpreter's bf16 rounding truncates
    per = experts_per_chunk(num_experts, n, hidden, work.itemsize, max_scratch_bytes)
    scratch = torch.empty(per * two_n * hidden, dtype=work, device=x.device)  # [c, 2N, K] or [c, K, N]
    h = torch.empty(num_assignments, n, dtype=work, device=x.device)  # [A, N]
    y = torch.empty(num_assignments, hidden, dtype=work, device=x.device)  # [A, K]
    if options.poison_workspace:
        h.fill_(float("nan"))
        y.fill_(float("nan"))
    for expert0 in range(0, num_experts, per):
        chunk = min(per, num_experts - expert0)
        w13_s = scratch[:chunk * two_n * hidden].view(chunk, two_n, hidden)
        w2_s = scratch[:chunk * hidden * n].view(chunk, hidden, n)
        cmap = expert_map if chunk == num_experts else chunk_map(expert_map, num_experts, expert0, chunk, x.device)
        plan = plan_for(x, w13_s, w2_s, ids, weights, cmap, activation, None, options)
        if plan.descriptor_key is None:
            w13_arg, w13_up_arg, w2_arg = w13_s, None, w2_s
        else:  # the scratch is fresh per call: its descriptors are too (never the per-weight cache)
            pair = descriptor_pair(w13_s, w2_s, plan.descriptor_key)
            w13_arg, w13_up_arg, w2_arg = pair.w13, pair.w13_up, pair.w2
        rows = (None, None, None)
        if plan.align is not None:
            b = WorkspaceSpec.of(list(plan.align.regions)).allocate(x.device)
            run_align(plan.align, ids, cmap, b)  # a folded alignment: the gate-up GEMM fills b
            rows = (b["sorted_ids"], b["expert_ids"], b["num_padded"])
        dequantize_experts(w13, scheme_id, hidden, w13_s, expert0)
        plan.gate_up(x, w13_arg, w13_up_arg, None, h, ids, *rows, cmap)
        dequantize_experts(w2, scheme_id, n, w2_s, expert0)
        plan.down(h, w2_arg, None, y, weights, ids, *rows, None, None, None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [M, K]
    ksum = sum_launch(num_tokens, hidden, top_k, num_experts, expert_map, plan.options, ordered=True)
    ksum(y, ids, expert_map if expert_map is not None else ids, out)
    return out
