"""The forwards of ``experts_triton_train`` that keep something for the backward (``triton_backward``):

    sorted_forward  x permuted into the layout's rows (kept: the backward's grad_gate_up and dW13 read it
                    there), the gate-up GEMM with act-and-mul in its epilogue on it ([P, N]), the down GEMM
                    times the routing weight scattered to the assignments' rows, the forward's k-sum
                    (``_kernels/gemm_train_forward.py``). Used when the tiles carry ``fwd13`` / ``fwd2``.
    saving_forward  the gate-up product h_pre [A, 2N] kept (``BackwardOptions(recompute=False)``); unfused.

Memory: sorted_forward keeps x_p [P, K] (DeepSeek-V3 at M=16384: P ~ 164k rows, 2.3 GB bf16) from the
forward to the backward, which allocated the same permutation itself before; g_p [P, N] is transient.

Shapes: M tokens, k slots, A = M*k, P layout rows, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import torch

from moekit.activations import act_and_mul, get_activation
from moekit.experts.triton_backward_launch import (BackwardTiles, KernelTiles, Layout, _precision, _work_dtype, align,
                                                   backward_tiles, descriptor, gather_gemm, permute_rows, sum_slots)
from moekit.experts.triton_launch import cdiv, kernels
from moekit.layouts.grouping import max_padded_rows
from moekit.triton_bind import COMPILE_OPTIONS


def layout_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """P: the rows of the layout ``align`` builds (and of x_p), from the shapes alone."""
    return cdiv(max_padded_rows(num_assignments, num_experts, block_m), block_m) * block_m


def _rows_desc(p: torch.Tensor, block: int, red: int, tile: KernelTiles):
    return descriptor(p[None], [block, red]) if tile.desc else None


def sorted_forward(x, w13, w2, ids, weights, expert_map, activation: str,
                   tiles: BackwardTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, K], x_p [P, K]): the experts forward on x permuted into the layout's rows with
    ``tiles.fwd13`` (gate-up) and ``tiles.fwd2`` (down); ``rows`` of each divides the layout's block.
    Arguments checked; A > 0."""
    num_experts, two_n, hidden = w13.shape
    n, top_k = two_n // 2, ids.shape[1]
    ids, x = ids.contiguous(), x.contiguous()
    expert_map = expert_map.contiguous() if expert_map is not None else None
    layout = align(ids, expert_map, num_experts, tiles.block_m)
    x_p = permute_rows(x, top_k, layout)
    g_p = torch.empty(x_p.shape[0], n, dtype=x.dtype, device=x.device)  # x.dtype: TMA under the interpreter too
    _gate_up(x_p, w13, g_p, layout, tiles.fwd13, activation)
    per_slot = torch.empty(ids.numel(), hidden, dtype=_work_dtype(x), device=x.device)
    _down(g_p, w2, weights.contiguous(), per_slot, layout, tiles.fwd2)
    return sum_slots(per_slot, ids, expert_map, num_experts, x.dtype), x_p


def _check_rows(tile: KernelTiles, layout: Layout) -> int:
    block = tile.rows or layout.block_m
    if layout.block_m % block:
        raise ValueError(f"the training forward's M-block (rows={block}) must divide the layout's block "
                         f"({layout.block_m})")
    return block


def _gate_up(x_p, w13, g_p, layout: Layout, tile: KernelTiles, activation: str) -> None:
    n, hidden = w13.shape[1] // 2, w13.shape[2]
    block = _check_rows(tile, layout)
    pair = (_rows_desc(x_p, block, tile.red, tile), descriptor(w13, [tile.cols, tile.red]) if tile.desc else None)
    use_desc = None not in pair
    num_pid_m = x_p.shape[0] // block
    kernels("gemm_train_forward").gate_up_train_kernel[(num_pid_m * cdiv(n, tile.cols),)](
        *(pair if use_desc else (x_p, w13)), g_p, layout.expert_ids, layout.num_padded,
        n, hidden, num_pid_m, layout.block_m, x_p.stride(0), *w13.stride(), g_p.stride(0),
        BLOCK_M=block, BLOCK_N=tile.cols, BLOCK_K=tile.red, GROUP_M=tile.group,
        ACT=get_activation(activation).kernel_id,
        DESC=use_desc, num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(x_p.dtype), **COMPILE_OPTIONS)


def _down(g_p, w2, weights, per_slot, layout: Layout, tile: KernelTiles) -> None:
    hidden, n = w2.shape[1], w2.shape[2]
    block = _check_rows(tile, layout)
    pair = (_rows_desc(g_p, block, tile.red, tile), descriptor(w2, [tile.cols, tile.red]) if tile.desc else None)
    use_desc = None not in pair
    num_pid_m = g_p.shape[0] // block
    kernels("gemm_train_forward").down_train_kernel[(num_pid_m * cdiv(hidden, tile.cols),)](
        *(pair if use_desc else (g_p, w2)), per_slot, weights, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        hidden, n, layout.num_assignments, num_pid_m, layout.block_m, g_p.stride(0), *w2.stride(), per_slot.stride(0),
        BLOCK_M=block, BLOCK_N=tile.cols, BLOCK_K=tile.red, GROUP_M=tile.group, DESC=use_desc,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(g_p.dtype), **COMPILE_OPTIONS)


def saving_forward(x, w13, w2, ids, weights, expert_map, activation: str,
                   tiles: BackwardTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, K], h_pre [A, 2N]): the experts forward that keeps the gate-up product for the backward.
    Unfused (gate-up GEMM, torch act-and-mul, down GEMM x weight, k-sum): it writes h_pre anyway. Rows
    of h_pre of assignments not routed here hold garbage that nothing reads. Arguments checked; A > 0."""
    num_experts, two_n, hidden = w13.shape
    ids, x = ids.contiguous(), x.contiguous()
    expert_map = expert_map.contiguous() if expert_map is not None else None
    tiles = tiles or backward_tiles(ids.numel(), num_experts, w2.shape[2], x.dtype, x.device)
    layout = align(ids, expert_map, num_experts, tiles.block_m)
    work = _work_dtype(x)
    h_pre = torch.empty(ids.numel(), two_n, dtype=work, device=x.device)
    gather_gemm(x, ids.shape[1], w13, 1, 2, h_pre, layout, tiles.dx)  # x [M, K] @ w13[e]^T -> [A, 2N]
    g = act_and_mul(h_pre, activation)  # [A, N]
    per_slot = torch.empty(ids.numel(), hidden, dtype=work, device=x.device)
    gather_gemm(g, 1, w2, 1, 2, per_slot, layout, tiles.dx, scale=weights.contiguous())  # w * g @ w2[e]^T
    return sum_slots(per_slot, ids, expert_map, num_experts, x.dtype), h_pre
