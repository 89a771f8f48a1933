"""The forwards of ``experts_triton_train`` that keep something for the backward (``triton_backward``):

    sorted_forward  x permuted into the layout's rows (kept: the backward's grad_gate_up and dW13 read it
                    there), the gate-up GEMM with act-and-mul in its epilogue on it ([P, N]), the down GEMM
                    times the routing weight scattered to the assignments' rows, the forward's k-sum
                    (``_kernels/gemm_train_forward.py``). Used when the tiles carry ``fwd13`` / ``fwd2``, and
                    for ``BackwardOptions(recompute=False)`` (``keep_h``), which also keeps the gate-up
                    pre-activation h_p [P, 2N] that the backward then reads instead of recomputing it
                    (``triton_backward_sorted.kept_tiles``).

Memory: sorted_forward keeps x_p [P, K] (DeepSeek-V3 at M=16384: P ~ 164k rows, 2.3 GB bf16) from the
forward to the backward, which allocated the same permutation itself before; g_p [P, N] is transient.
``keep_h`` adds h_p [P, 2N] in x's dtype: 4N bytes a layout row in bf16, kept from the forward to the backward;
P is allocated at its bound A + E (B - 1), rounded to B (Mixtral-8x7B, N 14336, B 128: P 9216 at M=4096, h_p 504 MiB;
at M=8192 952 MiB; DeepSeek-V2-Lite at M=1024: P 14336 for A 6144, h_p 77 MiB).

Shapes: M tokens, k slots, A = M*k, P layout rows, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import get_activation
from moekit.experts.triton_backward_launch import (BackwardTiles, KernelTiles, Layout, _precision, _work_dtype, align,
                                                   descriptor, permute_rows, sum_slots)
from moekit.experts.triton_launch import cdiv, kernels
from moekit.layouts.grouping import max_padded_rows
from moekit.triton_bind import COMPILE_OPTIONS


def layout_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """P: the rows of the layout ``align`` builds (and of x_p), from the shapes alone."""
    return cdiv(max_padded_rows(num_assignments, num_experts, block_m), block_m) * block_m


def _rows_desc(p: torch.Tensor, block: int, red: int, tile: KernelTiles):
    return descriptor(p[None], [block, red]) if tile.desc else None


@dataclass
class TrainForward:
    """What ``sorted_forward`` returns: the output and what the backward reads."""

    out: torch.Tensor  # [M, K] x.dtype
    x_p: torch.Tensor  # [P, K] x permuted into the layout's rows (padding rows 0)
    h_p: torch.Tensor | None  # [P, 2N] x.dtype (float32 under the interpreter): [gate, up] of each layout row
    # (``keep_h``), else None


def sorted_forward(x, w13, w2, ids, weights, expert_map, activation: str, tiles: BackwardTiles,
                   keep_h: bool = False) -> TrainForward:
    """The experts forward on x permuted into the layout's rows with ``tiles.fwd13`` (gate-up) and
    ``tiles.fwd2`` (down); ``rows`` of each divides the layout's block. ``keep_h``: the gate-up product kept
    too. Arguments checked; A > 0."""
    num_experts, two_n, hidden = w13.shape
    n, top_k = two_n // 2, ids.shape[1]
    ids, x = ids.contiguous(), x.contiguous()
    expert_map = expert_map.contiguous() if expert_map is not None else None
    layout = align(ids, expert_map, num_experts, tiles.block_m)
    x_p = permute_rows(x, top_k, layout)
    g_p = torch.empty(x_p.shape[0], n, dtype=x.dtype, device=x.device)  # x.dtype: TMA under the interpreter too
    h_p = torch.empty(x_p.shape[0], two_n, dtype=_work_dtype(x), device=x.device) if keep_h else None
    _gate_up(x_p, w13, g_p, h_p, layout, tiles.fwd13, activation)
    per_slot = torch.empty(ids.numel(), hidden, dtype=_work_dtype(x), device=x.device)
    _down(g_p, w2, weights.contiguous(), per_slot, layout, tiles.fwd2)
    return TrainForward(sum_slots(per_slot, ids, expert_map, num_experts, x.dtype), x_p, h_p)


def _check_rows(tile: KernelTiles, layout: Layout) -> int:
    block = tile.rows or layout.block_m
    if layout.block_m % block:
        raise ValueError(f"the training forward's M-block (rows={block}) must divide the layout's block "
                         f"({layout.block_m})")
    return block


def _gate_up(x_p, w13, g_p, h_p, layout: Layout, tile: KernelTiles, activation: str) -> None:
    n, hidden = w13.shape[1] // 2, w13.shape[2]
    block = _check_rows(tile, layout)
    pair = (_rows_desc(x_p, block, tile.red, tile), descriptor(w13, [tile.cols, tile.red]) if tile.desc else None)
    use_desc = None not in pair
    num_pid_m = x_p.shape[0] // block
    kernels("gemm_train_forward").gate_up_train_kernel[(num_pid_m * cdiv(n, tile.cols),)](
        *(pair if use_desc else (x_p, w13)), g_p, h_p if h_p is not None else g_p, layout.expert_ids,
        layout.num_padded, n, hidden, num_pid_m, layout.block_m, x_p.stride(0), *w13.stride(), g_p.stride(0),
        h_p.stride(0) if h_p is not None else 0, BLOCK_M=block, BLOCK_N=tile.cols, BLOCK_K=tile.red,
        GROUP_M=tile.group, ACT=get_activation(activation).kernel_id, DESC=use_desc, H_OUT=h_p is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(x_p.dtype), **COMPILE_OPTIONS)


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
