"""grad_gate_up on dout and x permuted into the layout's rows (``_kernels/gemm_backward_sorted.py``): the
launch ``experts_backward`` takes when the grad tile is ``contiguous`` (and both weight grads are, so the
same permuted x and dout feed dW13 and dW2: the permutation is paid once for all three GEMMs).

    fused (``dg_cols`` 0):  one kernel, three accumulators (dY @ W2, gate, up) over the same K loop.
    split (``dg_cols`` > 0): dg = dout_p W2[e] ([P, N] float32, a one-accumulator GEMM that takes a wide tile),
                             then the gate-up recompute with dg read in its epilogue (two accumulators).
                             Costs a [P, N] float32 round trip (DeepSeek-V3 at M=16384: 1.1 GB each way).

Shapes: M tokens, A = M*k assignments, P rows of the layout, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import torch

from moekit.activations import get_activation
from moekit.experts.triton_backward_launch import KernelTiles, Layout, _precision, _work_dtype, descriptor
from moekit.experts.triton_launch import cdiv, kernels
from moekit.triton_bind import COMPILE_OPTIONS


def grad_gate_up_sorted(dout_p: torch.Tensor, x_p: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, layout: Layout, tile: KernelTiles, activation: str):
    """(dh [P, 2N], w*g [P, N] in the layout's rows (padding rows 0, rows past the ones in use unwritten),
    d weight partials [A, N tiles] fp32); gate and up recomputed. dout_p, x_p [P, K] from ``permute_rows``
    (contiguous); weights [A] contiguous. ``tile``: rows (the M-block, dividing the layout's; 0 = it),
    cols, red, group, dg_cols; ``desc``: every operand through TMA where ``descriptor`` allows all four."""
    (_, two_n, hidden), n = w13.shape, w13.shape[1] // 2
    block = tile.rows or layout.block_m
    if layout.block_m % block:
        raise ValueError(f"grad_gate_up's M-block (rows={block}) must divide the layout's block ({layout.block_m})")
    num_rows, work = layout.sorted_ids.numel(), _work_dtype(x_p)
    dh = torch.empty(num_rows, two_n, dtype=work, device=x_p.device)
    gw = torch.empty(num_rows, n, dtype=work, device=x_p.device)
    num_pid_m, num_pid_n = num_rows // block, cdiv(n, tile.cols)
    parts = torch.zeros(layout.num_assignments, num_pid_n, dtype=torch.float32, device=x_p.device)  # unrouted: 0
    dg_cols = tile.dg_cols or tile.cols
    ops = (x_p, w13, dout_p, w2)
    if tile.desc:
        pair = (descriptor(x_p[None], [block, tile.red]), descriptor(w13, [tile.cols, tile.red]),
                descriptor(dout_p[None], [block, tile.red]), descriptor(w2, [tile.red, dg_cols], tile.red))
        ops = pair if None not in pair else ops
    use_desc = ops[0] is not x_p
    common = dict(BLOCK_M=block, BLOCK_K=tile.red, GROUP_M=tile.group, DESC=use_desc, num_warps=tile.num_warps,
                  num_stages=tile.num_stages, **_precision(x_p.dtype))
    dg = dh  # unread unless split
    if tile.dg_cols:
        dg = torch.empty(num_rows, n, dtype=torch.float32, device=x_p.device)
        kernels("gemm_backward_sorted").sorted_gemm_kernel[(num_pid_m * cdiv(n, tile.dg_cols),)](
            ops[2], ops[3], dg, layout.expert_ids, layout.num_padded, layout.sorted_ids,
            n, hidden, num_pid_m, layout.block_m, layout.num_assignments, dout_p.stride(0), *w2.stride(), dg.stride(0),
            BLOCK_N=tile.dg_cols, SCATTER=False, **common, **COMPILE_OPTIONS)
    kernels("gemm_backward_sorted").grad_gate_up_sorted_kernel[(num_pid_m * num_pid_n,)](
        ops[2], ops[0], ops[1], ops[3], dg, weights, dh, gw, parts,
        layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, hidden, layout.num_assignments, num_pid_m, layout.block_m,
        x_p.stride(0), *w13.stride(), *w2.stride(),
        BLOCK_N=tile.cols, ACT=get_activation(activation).kernel_id, DG_IN=tile.dg_cols > 0, **common,
        **COMPILE_OPTIONS)
    return dh, gw, parts


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
