"""The unsplit CPU loop at decode sizes, in phases: every GEMM of a kind back to back, the rest once over all rows.

    rows: the routed (token, slot) assignments sorted by expert (stably) -> xs [A', K] (one gather)
    -> h [A', R]: each expert's gate-up GEMM into its rows -> glu (``glu_rows``) and the combine weight
    -> y [A', K]: each expert's down GEMM into its rows -> out [M, K] = one index_add_ over the rows

Where every expert's GEMMs would be BLAS on plain weights (fewer than ``PACKED_MIN_ROWS`` rows each; bf16 on
oneDNN: up to ``BF16_GROUPED_MAX_ROWS``, whose packed GEMMs have the same bits) and there are no biases, each phase is
one call of torch's grouped GEMM over all experts (the same per-expert GEMMs and bits, without ~11 us of Python an
expert: at M = 8, 32-50 experts, 3-5% of the call; session 32).

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
import itertools
from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec, apply_glu, get_activation
from moekit.experts.cpu_packed import (
    PACKED_MIN_ROWS, ExpertParams, PackedWeightCache, blas_plain_rows, expert_weights, linear_rows, onednn_linear,
)
from moekit.experts.cpu_quant import QuantKernels, weight_only
from moekit.experts.torch_grouped import grouped_mm_fn, grouped_mm_takes
from moekit.layouts.grouping import to_local_ids


# experts in a call from which each phase is one grouped GEMM: it visits all E experts (empty ones too), so at M = 1
# (8 experts of Qwen3-30B-A3B) it ran 1.5% slower than the loop; from 15 experts (M = 2) 1.5% faster, 30 (M = 4) 3.4%,
# ~50 (M = 8) 5.3% (bf16; fp32 at M = 8 3.4%) on the Xeon, after a 2-thread GEMM (session 32)
GROUPED_MIN_EXPERTS = 12
# bf16 on oneDNN: torch.mm, the grouped GEMM and the linear on the packed weight gave the same bits for 1-32 rows, on
# 1 and 2 threads, at four expert shapes (Qwen3-30B-A3B's, gpt-oss-20b's); from 33 rows on 2 threads they differ
BF16_GROUPED_MAX_ROWS = 32


@functools.cache
def phased_blas_rows(dtype: torch.dtype) -> bool:
    """Whether ``auto``'s phased loop runs experts of fewer than ``PACKED_MIN_ROWS`` rows through torch's BLAS: where
    ``cpu_packed.blas_plain_rows`` says (float32, MKL, an Intel CPU), and bf16 where oneDNN runs bf16 natively
    (``torch.mm``'s bf16 is oneDNN's matmul there, its primitives cached: ~4 us a call before any work against
    ``_linear_pointwise``'s ~16, 16 calls at M = 1 on Qwen3-30B-A3B). In the split loop BLAS measured slower in bf16
    (session 30), so only the phased loop takes it."""
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
                       grouped_gemm: bool = True) -> torch.Tensor:
    """x [M, K] -> [M, K] in float32 (bf16 / fp16 accumulate there too): ``experts_cpu_fused`` with ``workers=1``,
    the same bits, its GEMMs on the caller's intra-op threads, in phases (the module's docstring). ``grouped_gemm``
    False keeps the per-expert GEMMs where the grouped GEMM could run (an A/B: ``benchmarks/cpu_phased_grouped.py``)."""
    top_k = topk_ids.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(x.shape[0], x.shape[1], dtype=acc)  # [M, K]
    order, runs = expert_runs(to_local_ids(topk_ids, ex.w13.shape[0], expert_map).tolist(), ex.w13.shape[0])
    if not order:
        return out
    src = torch.tensor(order, dtype=torch.long)  # [A'] assignment of each sorted row
    tokens = src // top_k  # [A']
    scale = topk_weights.reshape(-1).to(acc)[src].unsqueeze(1)  # [A', 1] combine weight of each row
    blas = blas_plain and not weight_only(ex.w13)  # quantized experts bring their own GEMM
    xs = x.index_select(0, tokens)  # [A', K]
    grouped = grouped_offsets(xs, ex, runs, grouped_max_rows(x.dtype)) if blas and grouped_gemm else None
    weights = {} if grouped is not None else phase_weights(ex, runs, cache, quant, x.dtype, blas)
    h = phase_gemm(xs, ex.w13, "w13", runs, weights, grouped)  # [A', R]
    a = glu_rows(h, runs, ex.spec, ex.w2.shape[2])  # [A', N]
    scale_first = ex.b2 is None and a.dtype == acc  # as ``cpu_packed._expert``: weight the [A', N] activation
    if scale_first:
        a.mul_(scale)
    y = phase_gemm(a, ex.w2, "w2", runs, weights, grouped)  # [A', K]
    if not scale_first:
        y = y.to(acc).mul_(scale)
    with one_thread():  # a serial index_add_: the rows' additions in order (``_ExpertLoop.combine``)
        out.index_add_(0, tokens, y)
    return out


def phase_weights(ex: ExpertParams, runs: list[ExpertRun], cache: PackedWeightCache | None, quant: QuantKernels,
                  dtype: torch.dtype, blas: bool) -> dict:
    """Each run's expert -> what its GEMMs read (``cpu_packed.expert_weights``): packed from ``PACKED_MIN_ROWS`` rows,
    BLAS on the plain weight below where ``blas``, else oneDNN's linear."""
    linear = onednn_linear(dtype)
    return {r.expert: expert_weights(ex, r.expert, cache if r.end - r.start >= PACKED_MIN_ROWS else None, quant,
                                     dtype, None if blas and r.end - r.start < PACKED_MIN_ROWS else linear,
                                     r.end - r.start)
            for r in runs}


def grouped_max_rows(dtype: torch.dtype) -> int:
    """The most rows an expert may have for ``grouped_offsets``: the split loop's BLAS rows (below
    ``PACKED_MIN_ROWS``), or ``BF16_GROUPED_MAX_ROWS`` for bf16 on oneDNN, where its packed GEMMs have the same bits."""
    return BF16_GROUPED_MAX_ROWS if dtype == torch.bfloat16 and not blas_plain_rows(dtype) else PACKED_MIN_ROWS - 1


def grouped_offsets(xs: torch.Tensor, ex: ExpertParams, runs: list[ExpertRun], max_rows: int) -> torch.Tensor | None:
    """offs [E] int32 (rows offs[e-1]:offs[e] are expert e's) where the call has ``GROUPED_MIN_EXPERTS`` experts or
    more, each of at most ``max_rows`` rows, without biases, and torch's grouped GEMM takes both matrices: it runs
    the per-expert GEMMs in one call (the loop's bits, in fp32 and bf16; ``tests/test_cpu_phased.py``), without
    ~11 us of Python an expert. None otherwise."""
    if len(runs) < GROUPED_MIN_EXPERTS or ex.b13 is not None or ex.b2 is not None:
        return None
    if any(r.end - r.start > max_rows for r in runs):
        return None
    if not (grouped_mm_takes(xs, ex.w13) and grouped_mm_takes(xs.new_empty(0, ex.w2.shape[2]), ex.w2)):
        return None
    counts = [0] * ex.w13.shape[0]
    for r in runs:
        counts[r.expert] = r.end - r.start
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)


def phase_gemm(a: torch.Tensor, w: torch.Tensor, name: str, runs: list[ExpertRun], weights: dict,
               grouped: torch.Tensor | None) -> torch.Tensor:
    """a [A', in] (rows grouped by expert) @ w[e] [out, in]^T (+ its bias) -> [A', out] in a's dtype: one grouped
    GEMM over offs ``grouped`` (no biases), else each run's expert's GEMM into its rows (``weights[e]``'s ``name``,
    "w13" or "w2", and its bias "b13" / "b2")."""
    if grouped is not None:
        return grouped_mm_fn()(a.contiguous(), w.transpose(1, 2), offs=grouped)
    out = a.new_empty(a.shape[0], w.shape[1])
    for r in runs:
        ew = weights[r.expert]
        linear_rows(ew.linear, a[r.start:r.end], getattr(ew, name), getattr(ew, "b" + name[1:]),
                    out=out[r.start:r.end])
    return out


def glu_rows(h: torch.Tensor, runs: list[ExpertRun], spec: ActivationSpec, n_dim: int) -> torch.Tensor:
    """h [A', R] -> glu(h) [A', N], every element with the bits the split loop gives it (``cpu_packed._expert`` on a
    worker of one intra-op thread, one expert's [m, R] at a time). On one thread here too: two would split a large
    iteration at a point that moves the boundary between the vector body and the scalar tail of exp (1 ulp apart). A
    plain activation over all rows at once (h[:, :N] is a strided view: one loop a row, as for one expert's rows);
    any other (gpt-oss's, over contiguous temporaries that iterate as one flat range) one expert's rows at a time."""
    with one_thread():
        if spec.plain:
            a = get_activation(spec.name).fn(h[:, :n_dim])  # [A', N], contiguous
            return a.mul_(h[:, n_dim:])
        a = h.new_empty(h.shape[0], n_dim)  # [A', N]
        for r in runs:
            a[r.start:r.end] = apply_glu(h[r.start:r.end], spec)
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
