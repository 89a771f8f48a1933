"""The unsplit CPU loop at decode sizes, in phases: every GEMM of a kind back to back, the rest once over all rows.

    rows: the routed (token, slot) assignments sorted by expert (stably) -> xs [A', K] (one gather)
    -> h [A', R]: each expert's gate-up GEMM into its rows -> glu (``glu_rows``) and the combine weight
    -> y [A', K]: each expert's down GEMM into its rows -> out [M, K] = one index_add_ over the rows

Why: ``cpu_packed``'s loop runs ~10 small ops an expert between its two GEMMs (a gather, slices, the activation,
the combine weight, an index_add_), each a few µs of host time during which the 2 OpenMP threads of the
GEMMs idle. At M = 1 (8 experts of one row, Qwen3-30B-A3B widths) on the 2-core Xeon, right after a 2-thread op,
this ran 4.0 / 5.0 ms (bf16 / fp32) where that loop unsplit ran 5.1 / 5.6 and transformers' ``grouped_mm`` 4.4 /
5.4; at M = 4 and 8 it was level with ``grouped_mm`` and 7-12% ahead of the split.
``moekit.experts.cpu_split_choice`` times it against the split loop (it is the "unsplit" mode).

The same bits as ``cpu_packed.experts_cpu_fused``: each expert's GEMMs read the same weights (packed from
``PACKED_MIN_ROWS`` rows, BLAS below where ``blas_plain``, else oneDNN) on the same rows (views of one buffer; the
GEMMs of 1 and 2 threads measured equal here, see ``cpu_split_choice``), the activation runs on one thread as the
split loop's workers run it (``glu_rows``), the combine weight is a product (exact), and one ``index_add_`` over the
rows in expert order on one thread makes the same additions in the same order as its one ``index_add_`` an expert.
The rows are grouped on the host (A = M*k ids through ``tolist``): no device here, and at decode sizes the
sort of a few dozen ids in Python costs less than the grouping's tensor ops.

Shapes: M tokens, k slots, A' routed assignments (ids in [0, E) after the expert map), E experts, K hidden,
N intermediate, R = 2N (gated) or N rows of w13.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec
from moekit.experts.cpu_packed import (
    PACKED_MIN_ROWS, ExpertParams, PackedWeightCache, blas_plain_rows, expert_weights, glu_rounded_once, linear_rows,
    onednn_linear,
)
from moekit.experts.cpu_quant import QuantKernels, weight_only
from moekit.layouts.grouping import to_local_ids


@functools.cache
def phased_blas_rows(dtype: torch.dtype) -> bool:
    """Whether ``auto``'s phased loop runs experts of fewer than ``PACKED_MIN_ROWS`` rows through torch's BLAS: where
    ``cpu_packed.blas_plain_rows`` says (float32, MKL, an Intel CPU), and bf16 where oneDNN runs bf16 natively
    (``torch.mm``'s bf16 is oneDNN's matmul there, its primitives cached: ~4 us a call before any work against
    ``_linear_pointwise``'s ~16, 16 calls at M = 1 on Qwen3-30B-A3B; one row as ``torch.mv`` on an AMX CPU,
    ``cpu_packed.bf16_row_gemv``, ~27% faster again on the Xeon). In the split loop BLAS (mm) measured slower in bf16
    (session 30); there only experts of one row take it, below ``cpu_loop.ONE_ROW_BLAS_BELOW`` tokens (session 34)."""
    if blas_plain_rows(dtype):
        return True
    supported = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and supported is not None and bool(supported())


@dataclass(frozen=True)
class ExpertRun:
    """One expert's rows in the sorted order: rows [start, end) of xs / h / y."""

    expert: int
    start: int
    end: int


def expert_runs(local_ids: list[int], num_experts: int) -> tuple[list[int], list[ExpertRun]]:
    """local_ids [A] (E: not routed here) -> the routed assignments sorted by expert, stably (a-order within an
    expert), and each expert's run of them, in expert order."""
    order = sorted((a for a, e in enumerate(local_ids) if e < num_experts), key=local_ids.__getitem__)
    runs: list[ExpertRun] = []
    for row, a in enumerate(order):
        if runs and runs[-1].expert == local_ids[a]:
            runs[-1] = ExpertRun(runs[-1].expert, runs[-1].start, row + 1)
        else:
            runs.append(ExpertRun(local_ids[a], row, row + 1))
    return order, runs


def experts_cpu_phased(x: torch.Tensor, ex: ExpertParams, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       expert_map: torch.Tensor | None, cache: PackedWeightCache | None,
                       quant: QuantKernels = QuantKernels(), blas_plain: bool = False,
                       one_row_blas: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, K] in float32 (bf16 / fp16 accumulate there too): ``experts_cpu_fused`` with ``workers=1``
    (and the same ``blas_plain`` / ``one_row_blas``), the same bits, its GEMMs on the caller's intra-op threads, in
    phases (the module's docstring)."""
    top_k = topk_ids.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(x.shape[0], x.shape[1], dtype=acc)  # [M, K]
    order, runs = expert_runs(to_local_ids(topk_ids, ex.w13.shape[0], expert_map).tolist(), ex.w13.shape[0])
    if not order:
        return out
    src = torch.tensor(order, dtype=torch.long)  # [A'] assignment of each sorted row
    tokens = src // top_k  # [A']
    scale = topk_weights.reshape(-1).to(acc)[src].unsqueeze(1)  # [A', 1] combine weight of each row
    linear = onednn_linear(x.dtype)
    blas = blas_plain and not weight_only(ex.w13)  # quantized experts bring their own GEMM
    one_row = one_row_blas and not weight_only(ex.w13)
    weights = {r.expert: expert_weights(ex, r.expert, cache if r.end - r.start >= PACKED_MIN_ROWS else None, quant,
                                        x.dtype, None if (blas and r.end - r.start < PACKED_MIN_ROWS)
                                        or (one_row and r.end - r.start == 1) else linear, r.end - r.start)
               for r in runs}
    xs = x.index_select(0, tokens)  # [A', K]
    h = x.new_empty(len(order), ex.w13.shape[1])  # [A', R]
    for r in runs:
        w = weights[r.expert]
        linear_rows(w.linear, xs[r.start:r.end], w.w13, w.b13, out=h[r.start:r.end])
    a = glu_rows(h, runs, ex.spec, ex.w2.shape[2])  # [A', N]
    scale_first = ex.b2 is None and a.dtype == acc  # as ``cpu_packed._expert``: weight the [A', N] activation
    if scale_first:
        a.mul_(scale)
    y = x.new_empty(len(order), ex.w2.shape[1])  # [A', K]
    for r in runs:
        w = weights[r.expert]
        linear_rows(w.linear, a[r.start:r.end], w.w2, w.b2, out=y[r.start:r.end])
    if not scale_first:
        y = y.to(acc).mul_(scale)
    with one_thread():  # a serial index_add_: the rows' additions in order (``_ExpertLoop.combine``)
        out.index_add_(0, tokens, y)
    return out


def glu_rows(h: torch.Tensor, runs: list[ExpertRun], spec: ActivationSpec, n_dim: int) -> torch.Tensor:
    """h [A', R] -> glu(h) [A', N] in h's dtype, rounded once (``glu_rounded_once``), every element with the bits
    the split loop gives it (``cpu_packed._expert`` on a worker of one intra-op thread, one expert's [m, R] at a
    time). On one thread here too: two would split a large iteration at a point that moves the boundary between the
    vector body and the scalar tail of exp (1 ulp apart). A plain activation over all rows at once (its gate a
    strided view: one loop a row, as for one expert's rows); any other (gpt-oss's, over contiguous temporaries that
    iterate as one flat range) one expert's rows at a time."""
    acc = torch.promote_types(h.dtype, torch.float32)
    with one_thread():
        if spec.plain:
            return glu_rounded_once(h, spec, acc)  # [A', N]
        a = h.new_empty(h.shape[0], n_dim)  # [A', N]
        for r in runs:
            a[r.start:r.end] = glu_rounded_once(h[r.start:r.end], spec, acc)
        return a


@contextlib.contextmanager
def one_thread():
    """The calling thread's intra-op threads set to 1 inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
