"""The CPU branch's "direct" experts on a ``cpu_runner.ChunkPool``: each weight cut into row blocks, one GEMM
a block, taken by whichever pool thread is free (``CpuOptions(runner="pool")``).

    x [M, K], ids [M, k], weights [M, k], experts E_cpu  ->  [M, K]   (``cpu_direct.experts_direct``'s contract)
    phase 1: for e in E_cpu, rows r of w13[e] [R, K] in blocks:  h_e[:, r] = x_e @ w13[e, r].T (+ b13[e, r])
    glu:     a_e = glu(h_e)  [m_e, N]  (the caller's thread: a few thousand elements)
    phase 2: for e in E_cpu, rows c of w2[e] [K, N] in blocks:   y_e[:, c] = a_e @ w2[e, c].T (+ b2[e, c])
    sum:     out[t] += weight(t, e) * y_e[t] in float32, experts ascending, rounded once to x's dtype

A block reads ``BLOCK_BYTES`` of weights or less: at M <= 32 a block's GEMM is a read of its weight bytes
(~0.1 ms a block on one core), so a job has a few dozen blocks, and a pool thread held up (preempted,
woken late) costs the job one block run again by another thread (``ChunkPool``'s backup), not its share.
Each output element is one dot product over K as in the direct path; the blocks' GEMMs run on one
thread, so their sums may round differently from the direct path's multithreaded ones (bf16: same tolerance).
"""

from __future__ import annotations

import torch

from moekit.activations import ActivationSpec, apply_glu
from moekit.offload.cpu_direct import _add, _checked, _rows, _tokens_of
from moekit.offload.cpu_runner import ChunkPool

BLOCK_BYTES = 1 << 20  # weight bytes a block reads at most (Qwen3-30B-A3B bf16: an expert's w13 in 6 blocks, w2 in 4)


def block_rows(rows: int, cols: int, itemsize: int, block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int]]:
    """[lo, hi) row blocks of a [rows, cols] weight, each at most ``block_bytes`` (at least one row), as even
    as the count allows."""
    per_block = max(1, block_bytes // max(1, cols * itemsize))  # rows a block may hold
    count = max(1, -(-rows // per_block))  # so no block holds more than per_block (ceil(rows / count) <= it)
    return [(rows * i // count, rows * (i + 1) // count) for i in range(count)]


def experts_pooled(
    x: torch.Tensor,  # [M, K], CPU
    w13: torch.Tensor,  # [E, R, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k] integer, CPU
    topk_weights: torch.Tensor,  # [M, k] float, CPU
    experts: list[int],
    pool: ChunkPool,
    *,
    activation: str | ActivationSpec = "silu",
    b13: torch.Tensor | None = None,  # [E, R]
    b2: torch.Tensor | None = None,  # [E, K]
    block_bytes: int = BLOCK_BYTES,
) -> torch.Tensor:
    """``experts``' share of the experts contract for x's tokens (module docstring), in x's dtype."""
    wanted = _checked(x, w13, w2, topk_ids, topk_weights, experts)
    rows = _rows(topk_ids, topk_weights, wanted)
    order = sorted(rows)
    xs = {e: _tokens_of(x, rows[e][0]) for e in order}  # [m_e, K] each
    h = _blocked(pool, w13, b13, xs, order, block_bytes)  # [m_e, R] each
    a = {e: apply_glu(h[e], activation) for e in order}  # [m_e, N] each
    y = _blocked(pool, w2, b2, a, order, block_bytes)  # [m_e, K] each
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))  # [M, K]
    for e in order:
        _add(out, y[e], *rows[e])
    return out.to(x.dtype)


def _blocked(pool: ChunkPool, w: torch.Tensor, b: torch.Tensor | None, inputs: dict[int, torch.Tensor],
             order: list[int], block_bytes: int) -> dict[int, torch.Tensor]:
    """e -> inputs[e] @ w[e].T (+ b[e]) for e in ``order``, the rows of each w[e] [rows, cols] in blocks on the pool."""
    tasks, spans = [], []
    for e in order:
        blocks = block_rows(w.shape[1], w.shape[2], w.element_size(), block_bytes)
        spans.append((e, len(tasks), len(tasks) + len(blocks)))
        tasks.extend(_task(inputs[e], w[e, lo:hi], None if b is None else b[e, lo:hi]) for lo, hi in blocks)
    results = pool.map(tasks)
    return {e: torch.cat(results[lo:hi], dim=1) for e, lo, hi in spans}


def _task(v: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """v [m, cols] @ w [rows, cols].T (+ b [rows]) -> [m, rows], a pure call (a backup may run it twice)."""
    if b is None:
        return lambda: v @ w.t()
    return lambda: torch.addmm(b, v, w.t())
