"""The words decode's operand order in torch (issue #16, session 45; moved here from ``triton_wo_words`` in session
46): the gate-up kernel's steps mirrored op for op (``gluon_wo_words._operand_halves``' joins, reshape, permute and
split on the int4 decode's bf16x2 pairs, ``_exact_half``, ``x_halves``) and its arithmetic in float64, for the CPU
tests (Gluon does not run in the interpreter) and the device check's smoke run.

Shapes: R rows, BM tokens, a step 256 columns (32 int32 words a row), N intermediate, K hidden.
"""

from __future__ import annotations

import torch

from moekit.experts.triton_wo_words import STEP, x_words_torch


def weight_halves_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gluon_wo_words._weight_halves`` in torch: a step's words [R, 32] int32 -> the two half steps' A operands
    [R, 128] float32 (128 + code) in the dot order, by the kernel's joins, reshape, permute and split."""
    r = words.shape[0]
    o = [(((words >> (4 * t)) & 0x000F000F) | 0x43004300) for t in range(4)]  # bf16x2 bits of 128 + code
    halves = [torch.stack([(v & 0xFFFF) - 0x4300, ((v >> 16) & 0xFFFF) - 0x4300], -1) + 128 for v in o]  # [R, 32, 2]
    v = torch.stack([torch.stack([halves[0], halves[1]], -1), torch.stack([halves[2], halves[3]], -1)], -1)
    v = v.reshape(r, 2, 2, 2, 2, 2, 2, 2, 2).permute(0, 4, 5, 8, 7, 2, 3, 6, 1).reshape(r, 128, 2)
    return v[..., 0].float(), v[..., 1].float()


def exact_half_torch(words: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``gluon_wo_words._exact_half`` in torch: one half step's words [R, 16] int32 and the rows' zero points [R] ->
    code - zero [R, 128] float32 in the dot order, by the kernel's joins, reshape and permute."""
    r = words.shape[0]
    o = [((words >> (4 * t)) & 0x000F000F) for t in range(4)]  # the codes the lop3 places, before the fma
    halves = [torch.stack([v & 0xFFFF, (v >> 16) & 0xFFFF], -1) - zero[:, None, None] for v in o]  # [R, 16, 2]
    v = torch.stack([torch.stack([halves[0], halves[1]], -1), torch.stack([halves[2], halves[3]], -1)], -1)
    return v.reshape(r, 2, 2, 2, 2, 2, 2, 2).permute(0, 3, 4, 7, 6, 1, 2, 5).reshape(r, 128).float()


def x_halves_torch(xp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gluon_wo_words._x_halves`` in torch: a step's stored activations [BM, 256] -> the B operands [128, BM]."""
    bm = xp.shape[0]
    v = xp.reshape(bm, 2, 2, 2, 2, 2, 2, 2, 2).permute(4, 5, 6, 7, 1, 2, 8, 0, 3).reshape(128, bm, 2)
    return v[..., 0], v[..., 1]


def gate_up_words_torch(x: torch.Tensor, w13, topk_ids: torch.Tensor) -> torch.Tensor:
    """h [A, N] float32 as the kernel computes it (tiny-batch form: one assignment at a time), from its operands in
    its order (``weight_halves_torch``, ``x_halves_torch`` on ``x_words_torch``), float64 sums: each half step's
    sum_d (128 + code) x, corrected by (128 + zero) * the half step's x sum, times the group's scale."""
    num_experts, two_n, half_k = w13.q.shape
    n, k, g = two_n // 2, 2 * half_k, w13.group_size
    xw = x_words_torch(x)
    ids = topk_ids.reshape(-1)
    h = torch.empty(ids.numel(), n, dtype=torch.float64, device=x.device)
    for a, e in enumerate(ids.tolist()):
        t = a // topk_ids.shape[1]
        words = w13.q[e].contiguous().view(torch.int32).long()  # [2N, K / 8]
        acc = torch.zeros(two_n, dtype=torch.float64, device=x.device)
        for s in range(k // STEP):
            parts = zip(weight_halves_torch(words[:, 32 * s:32 * s + 32]),
                        x_halves_torch(xw.x[t:t + 1, STEP * s:STEP * s + STEP].double()))
            for c, (a_op, b_op) in enumerate(parts):
                grp = (STEP * s + 128 * c) // g
                part = a_op.double() @ b_op[:, 0]  # [2N]
                zero = w13.zero[e, :, grp].double() + 128
                acc += (part - zero * xw.sums[t, 2 * s + c].double()) * w13.scale[e, :, grp].double()
        h[a] = torch.nn.functional.silu(acc[:n]) * acc[n:]
    return h
