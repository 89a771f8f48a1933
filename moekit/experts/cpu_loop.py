"""Which fused CPU loop an eager CPU call of the loops' ``cpu_gemm`` runs (``grouped_mm._run_contiguous``).

The split loop (``cpu_packed.experts_cpu_fused`` over ``torch.get_num_threads()`` single-threaded workers), the same
loop on one worker with multi-threaded GEMMs, or, for ``cpu_gemm="auto"`` below ``CHOSEN_BELOW`` tokens, the faster
of the split loop and the phased unsplit loop (``cpu_phased``) as ``cpu_split_choice`` times them online.

Shapes: M tokens, K hidden.
"""

from __future__ import annotations

import torch

from moekit.experts.cpu_packed import ExpertParams, blas_plain_rows, experts_cpu_fused
from moekit.experts.cpu_phased import experts_cpu_phased, phased_blas_rows
from moekit.experts.cpu_split_choice import CHOSEN_BELOW, SPLIT, UNSPLIT, split_chooser

# Below this many tokens ``auto``'s split loop runs experts of one row on BLAS where the phased loop does
# (``phased_blas_rows``: bf16 as ``torch.mv`` on an AMX CPU, else ``torch.mm``: ``cpu_packed.bf16_row_gemv``).
# Qwen3-30B-A3B widths, the Xeon (mv), each call after a 2-thread GEMM, 9 rounds (session 34): M = 1 0.77-0.86x, 8
# 0.58-0.89x, 16 0.87-0.99x (7/9 >= 3%) of oneDNN.
ONE_ROW_BLAS_BELOW = 16


def one_row_blas_rows(x: torch.Tensor, ex: ExpertParams) -> bool:
    """Whether ``auto``'s loops (both modes alike) run this call's experts of one row through torch's BLAS: below
    ``ONE_ROW_BLAS_BELOW`` tokens, on row-major weights where ``phased_blas_rows`` says, and on float32 experts stored
    transposed (``stored_transposed``: gpt-oss's [E, K, 2N] / [E, N, K] read as [E, 2N, K] / [E, K, N] views), where
    BLAS reads the stored [in, out] rows as they are. There, at gpt-oss-20b's widths on the AMD EPYC (biases, 3
    routings, each call after an LM-head GEMM; ``f6f35e93:benchmarks/cpu_transposed_rows.py``, session 42), experts
    of one row on BLAS took 0.47-0.59x oneDNN's time at M = 1 on 1 thread, and on 2 quiet threads 0.74-0.93x (phased)
    and 0.50-0.82x (split, M = 1-8), while BLAS at 2-3 rows on 2 threads was 8-21% slower than oneDNN: one row only."""
    if x.shape[0] >= ONE_ROW_BLAS_BELOW:
        return False
    row_major = all(isinstance(w, torch.Tensor) and w.stride(2) == 1 for w in (ex.w13, ex.w2))
    return (row_major and phased_blas_rows(x.dtype)) or (x.dtype == torch.float32 and stored_transposed(ex))


def stored_transposed(ex: ExpertParams) -> bool:
    """Both weights plain tensors whose [out, in] rows are strided and columns contiguous (views of [in, out])."""
    return all(isinstance(w, torch.Tensor) and w.stride(1) == 1 and w.stride(2) != 1 for w in (ex.w13, ex.w2))


def run_cpu_loop(x: torch.Tensor, ex: ExpertParams, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map,
                 cache, *, auto: bool, split: bool) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype). ``split``: whole experts over torch's threads, else one worker;
    ``auto``: experts of few rows through BLAS where ``blas_plain_rows`` says, and below CHOSEN_BELOW tokens split
    or phased, whichever is faster on this machine now (the same bits either way)."""
    threads = torch.get_num_threads()
    blas = auto and blas_plain_rows(x.dtype)
    one_row = auto and one_row_blas_rows(x, ex)

    def run(mode: str) -> torch.Tensor:
        if mode == UNSPLIT:
            return experts_cpu_phased(x, ex, topk_ids, topk_weights, expert_map, cache,
                                      blas_plain=phased_blas_rows(x.dtype), one_row_blas=one_row)
        return experts_cpu_fused(x, ex, topk_ids, topk_weights, expert_map, cache, workers=threads if split else 1,
                                 blas_plain=blas, one_row_blas=one_row)

    if auto and x.shape[0] < CHOSEN_BELOW and threads > 1:  # decode: timed online
        return split_chooser().call((x.shape[0].bit_length(), x.dtype, tuple(ex.w13.shape), threads), run)
    return run(SPLIT)
