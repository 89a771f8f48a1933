"""grad_gate_up on dout and x permuted into the layout's rows (``_kernels/gemm_backward_sorted.py``): the
launch ``experts_backward`` takes when the grad tile is ``contiguous`` (and both weight grads are, so the
same permuted x and dout feed dW13 and dW2: the permutation is paid once for all three GEMMs).

    fused (``dg_cols`` 0):  one kernel, three accumulators (dY @ W2, gate, up) over the same K loop.
    split (``dg_cols`` > 0): dg = dout_p W2[e] ([P, N] float32, a one-accumulator GEMM that takes a wide tile),
                             then the gate-up recompute with dg read in its epilogue (two accumulators).
                             Costs a [P, N] float32 round trip (DeepSeek-V3 at M=16384: 1.1 GB each way).
    kept (``h_p`` given):    gate and up read from the forward's h_p [P, 2N] (``BackwardOptions(recompute=
                             False)``, ``triton_train_forward``): dY @ W2 alone in the K loop (one accumulator,
                             ``cols`` wide; ``dg_cols`` unused), the act-and-mul backward in its epilogue.

Shapes: M tokens, A = M*k assignments, P rows of the layout, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moekit.activations import get_activation
from moekit.experts.triton_backward_launch import (BackwardTiles, KernelTiles, Layout, _precision, _work_dtype,
                                                   descriptor)
from moekit.experts.triton_launch import cdiv, interpreting, kernels
from moekit.triton_bind import COMPILE_OPTIONS


def grad_gate_up_sorted(dout_p: torch.Tensor, x_p: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, layout: Layout, tile: KernelTiles, activation: str,
                        h_p: torch.Tensor | None = None):
    """(dh [P, 2N], w*g [P, N] in the layout's rows (padding rows 0, rows past the ones in use unwritten),
    d weight partials [A, N tiles] fp32); gate and up recomputed, or read from ``h_p`` [P, 2N] (the
    forward's, contiguous). dout_p, x_p [P, K] from ``permute_rows`` (contiguous); weights [A] contiguous.
    ``tile``: rows (the M-block, dividing the layout's; 0 = it), cols, red, group, dg_cols (not with h_p);
    ``desc``: every operand through TMA where ``descriptor`` allows all four."""
    (_, two_n, hidden), n = w13.shape, w13.shape[1] // 2
    block = tile.rows or layout.block_m
    if layout.block_m % block:
        raise ValueError(f"grad_gate_up's M-block (rows={block}) must divide the layout's block ({layout.block_m})")
    num_rows, work = layout.sorted_ids.numel(), _work_dtype(x_p)
    dh = torch.empty(num_rows, two_n, dtype=work, device=x_p.device)
    gw = torch.empty(num_rows, n, dtype=work, device=x_p.device)
    num_pid_m, num_pid_n = num_rows // block, cdiv(n, tile.cols)
    parts = torch.zeros(layout.num_assignments, num_pid_n, dtype=torch.float32, device=x_p.device)  # unrouted: 0
    split_dg = tile.dg_cols if h_p is None else 0
    dg_cols = split_dg or tile.cols
    ops = (x_p, w13, dout_p, w2)
    if tile.desc:
        pair = (descriptor(x_p[None], [block, tile.red]), descriptor(w13, [tile.cols, tile.red]),
                descriptor(dout_p[None], [block, tile.red]), descriptor(w2, [tile.red, dg_cols], tile.red))
        ops = pair if None not in pair else ops
    use_desc = ops[0] is not x_p
    common = dict(BLOCK_M=block, BLOCK_K=tile.red, GROUP_M=tile.group, DESC=use_desc, num_warps=tile.num_warps,
                  num_stages=tile.num_stages, **_precision(x_p.dtype))
    dg = dh  # unread unless split
    if split_dg:
        dg = torch.empty(num_rows, n, dtype=torch.float32, device=x_p.device)
        kernels("gemm_backward_sorted").sorted_gemm_kernel[(num_pid_m * cdiv(n, split_dg),)](
            ops[2], ops[3], dg, layout.expert_ids, layout.num_padded, layout.sorted_ids,
            n, hidden, num_pid_m, layout.block_m, layout.num_assignments, dout_p.stride(0), *w2.stride(), dg.stride(0),
            BLOCK_N=split_dg, SCATTER=False, **common, **COMPILE_OPTIONS)
    if h_p is not None and (h_p.shape != (num_rows, two_n) or not h_p.is_contiguous()):
        raise ValueError(f"h_p must be the forward's contiguous [P, 2N] = [{num_rows}, {two_n}], got "
                         f"{tuple(h_p.shape)}")
    kernels("gemm_backward_sorted").grad_gate_up_sorted_kernel[(num_pid_m * num_pid_n,)](
        ops[2], ops[0], ops[1], ops[3], dg, h_p if h_p is not None else dh, weights, dh, gw, parts,
        layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, hidden, layout.num_assignments, num_pid_m, layout.block_m,
        x_p.stride(0), *w13.stride(), *w2.stride(),
        BLOCK_N=tile.cols, ACT=get_activation(activation).kernel_id, DG_IN=split_dg > 0, H_IN=h_p is not None,
        **common, **COMPILE_OPTIONS)
    return dh, gw, parts


# The forward tiles of the kept path where the shape's tiles carry none: "wide/many"'s gate-up tile (Mixtral at M=16384
# on the H200, the only forward tiles measured before; the kept steps of trn51-ck1 / ck2 ran with it at every class)
# with the layout's block as the M-block; the interpreter's small tiles. ``desc`` as the shape's weight grads.
KEPT_FORWARD = KernelTiles(128, 64, 8, 4, contiguous=True, group=8)
KEPT_FORWARD_INTERPRETED = KernelTiles(16, 16, 1, 1, contiguous=True)


def kept_tiles(tiles: BackwardTiles) -> BackwardTiles:
    """The tiles of the kept path (``BackwardOptions(recompute=False)``): the forward on x permuted keeps
    x_p and h_p in the layout's rows, so the grad tile and both weight grads read the layout's rows
    (``contiguous``) whatever ``tiles`` had, and the forward tiles are ``KEPT_FORWARD`` where ``tiles`` has
    none. TMA (``desc``) for the grad and forward tiles where the weight grads have it (``TUNED``, sm_90; the
    heuristic's tiles of other GPUs and dtypes keep pointer loads). Sizes, block and dX are ``tiles``', but a
    gathering weight grad's row step that does not divide the block becomes their gcd (a contiguous step
    must not cross into the next expert's rows)."""
    desc = tiles.dw13.desc
    fwd = dataclasses.replace(KEPT_FORWARD_INTERPRETED if interpreting() else KEPT_FORWARD, desc=desc)

    def on_rows(tile: KernelTiles) -> KernelTiles:
        return dataclasses.replace(tile, contiguous=True, red=math.gcd(tile.red, tiles.block_m))

    return dataclasses.replace(tiles, grad=dataclasses.replace(tiles.grad, contiguous=True,
                                                               desc=tiles.grad.desc or desc),
                               dw13=on_rows(tiles.dw13), dw2=on_rows(tiles.dw2), fwd13=tiles.fwd13 or fwd,
                               fwd2=tiles.fwd2 or fwd)


def dx_sorted(dh: torch.Tensor, w13: torch.Tensor, per_slot: torch.Tensor, layout: Layout, tile: KernelTiles) -> None:
    """per_slot[a] = dh_p[p] w13[e] for the layout's rows p of assignments a (per_slot [A, K], rows of
    assignments not routed here unwritten): dX before its k-sum, dh [P, 2N] in the layout's rows read
    through TMA (``tile.desc``, where ``descriptor`` allows dh and w13 with 2N % red == 0)."""
    (_, two_n, hidden), block = w13.shape, tile.rows or layout.block_m
    if layout.block_m % block:
        raise ValueError(f"dX's M-block (rows={block}) must divide the layout's block ({layout.block_m})")
    num_pid_m = dh.shape[0] // block
    ops = (dh, w13)
    if tile.desc:
        pair = (descriptor(dh[None], [block, tile.red]), descriptor(w13, [tile.red, tile.cols], tile.red))
        ops = pair if None not in pair else ops
    kernels("gemm_backward_sorted").sorted_gemm_kernel[(num_pid_m * cdiv(hidden, tile.cols),)](
        *ops, per_slot, layout.expert_ids, layout.num_padded, layout.sorted_ids,
        hidden, two_n, num_pid_m, layout.block_m, layout.num_assignments, dh.stride(0), *w13.stride(),
        per_slot.stride(0), BLOCK_M=block, BLOCK_N=tile.cols, BLOCK_K=tile.red, GROUP_M=tile.group,
        DESC=ops[0] is not dh, SCATTER=True, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **_precision(dh.dtype), **COMPILE_OPTIONS)
