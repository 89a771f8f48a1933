"""A pure read of exactly the bytes the words gate-up (``moekit/experts/_kernels/gluon_wo_words.py``) reads, in its
geometry: the same grid, program rows, word layout and 16-byte loads two steps an iteration, the words xor-folded
and nothing decoded (``benchmarks/w4g45_device_check.py``'s "read": the cap this geometry gives the kernel). Each
thread stores its fold to out [programs * 32 * num_warps] int32 (so nothing is dropped); ``read_fold_twin`` is the
same fold in torch, for the check.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def read_words_kernel(q_ptr, ids_ptr, expert_ids_ptr, num_padded_ptr, out_ptr, N, K, stride_qe, stride_qr,
                      BM: gl.constexpr, NAIVE: gl.constexpr, num_warps: gl.constexpr):
    """xor of every word the words gate-up program reads (its 8 num_warps gate rows and their up rows), per thread.
    stride_qe / stride_qr in words; K a multiple of 512."""
    R: gl.constexpr = 16 * num_warps
    w_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    num_pid_n = N // (8 * num_warps)
    pid_m = gl.program_id(0) // num_pid_n
    n0 = (gl.program_id(0) % num_pid_n) * (8 * num_warps)
    if NAIVE:
        expert = gl.load(ids_ptr + pid_m).to(gl.int32)
    else:
        expert = gl.where(pid_m * BM < gl.load(num_padded_ptr), gl.load(expert_ids_ptr + pid_m), -1)
    u = gl.arange(0, R, layout=gl.SliceLayout(1, w_layout))
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, w_layout))
    fold = gl.zeros([R, 32], gl.int32, w_layout)
    if expert >= 0:
        rows = n0 + 8 * (u // 8 % num_warps) + u % 8 + (u // (8 * num_warps)) * N
        ptrs = (q_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert.to(gl.int64) * stride_qe
                + (rows * stride_qr)[:, None] + cols[None, :])
        for s in range(0, K // 256, 2):
            fold = fold ^ gl.load(ptrs + s * 32) ^ gl.load(ptrs + (s + 1) * 32)
    folded = gl.xor_sum(gl.reshape(fold, [R // 8, 8, 32]), 0)  # [8, 32]: a thread's own values (rows u % 8)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, num_warps], [1, 0])
    folded = gl.convert_layout(gl.xor_sum(gl.reshape(folded, [8, 4, 8]), 2), out_layout)  # [8, 4]
    i = gl.arange(0, 8, layout=gl.SliceLayout(1, out_layout))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, out_layout))
    gl.store(out_ptr + gl.program_id(0) * 32 + i[:, None] * 4 + j[None, :], folded)


def _xor_last(t: torch.Tensor) -> torch.Tensor:
    """The xor over t's last dim (int32), by halves."""
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = torch.cat([t, torch.zeros_like(t[..., :1])], -1)
        t = t[..., 0::2] ^ t[..., 1::2]
    return t[..., 0]


def read_fold_twin(q: torch.Tensor, experts: list, n: int, num_warps: int) -> torch.Tensor:
    """[programs, 32] int32: each program's fold as the kernel stores it, at [row % 8, (word of the step) // 8]
    (``experts``: each block's expert or -1, in program order)."""
    words = q.view(torch.int32)  # [E, 2N, K / 8]
    tiles, rows_a = n // (8 * num_warps), 8 * num_warps
    out = []
    for e in experts:
        for t in range(tiles):
            if e < 0:
                out.append(torch.zeros(32, dtype=torch.int32, device=q.device))
                continue
            rows = torch.cat([words[e, t * rows_a:(t + 1) * rows_a], words[e, n + t * rows_a:n + (t + 1) * rows_a]])
            cols = rows.view(rows.shape[0] // 8, 8, -1, 4, 8)  # [rows / 8, row % 8, step, word // 8, word % 8]
            out.append(_xor_last(cols.permute(1, 3, 0, 2, 4).reshape(8, 4, -1)).reshape(32))
    return torch.stack(out)
