"""The launch of the persistent weight-gradient GEMM (``_kernels/wgrad_persistent.py``): what
``triton_backward_launch.weight_grad`` runs for a contiguous tile with ``persistent`` > 0 when both
permuted operands go through TMA and the expert's rows are not split.

Shapes: P layout rows, E experts, R x C one expert's weight grad.
"""

from __future__ import annotations

import torch

from moekit.experts.triton_launch import cdiv, interpreting, kernels
from moekit.triton_bind import COMPILE_OPTIONS

INTERPRETED_SMS = 3  # the "SMs" under the interpreter: few programs, so each walks several tiles and experts


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def weight_grad_persistent(l_desc, r_desc, rows: int, cols: int, counts: torch.Tensor, block_m: int,
                           out: torch.Tensor, tile) -> torch.Tensor:
    """out [E, R, C] (contiguous, filled): out[e] = sum over e's rows of L^T R, with ``l_desc`` / ``r_desc``
    TMA descriptors over the permuted operands ([P, R] block [red, rows], [P, C] block [red, cols]).
    ``tile`` a ``KernelTiles``: ``persistent`` programs per SM (at most one per output tile), ``store_desc``
    the output through a TMA descriptor where its rows are 16-byte aligned, ``flat`` one loop over
    tiles x steps per expert (else nested loops)."""
    if tile.persistent < 1:
        raise ValueError(f"the persistent weight grad needs tile.persistent >= 1, got {tile.persistent}")
    num_experts = out.shape[0]
    num_tiles = num_experts * cdiv(rows, tile.rows) * cdiv(cols, tile.cols)
    num_programs = max(1, min(num_tiles, tile.persistent * _num_sms(out.device)))
    out_arg = out
    if tile.store_desc and out.element_size() * cols % 16 == 0 and out.data_ptr() % 16 == 0:
        from triton.tools.tensor_descriptor import TensorDescriptor

        out_arg = TensorDescriptor.from_tensor(out, [1, tile.rows, tile.cols])
    padded = (counts + block_m - 1) // block_m * block_m
    starts = (torch.cumsum(padded, 0) - padded).to(torch.int32)  # [E] each expert's first layout row
    kernels("wgrad_persistent").weight_grad_persistent_kernel[(num_programs,)](
        l_desc, r_desc, out_arg, counts, starts, rows, cols, num_experts, num_programs, rows * cols, cols,
        BLOCK_R=tile.rows, BLOCK_C=tile.cols, BLOCK_K=tile.red, GROUP_R=tile.group,
        OUT_DESC=out_arg is not out, FLAT=tile.flat, UPCAST=interpreting(), PRECISION="tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages, **COMPILE_OPTIONS)
    return out
