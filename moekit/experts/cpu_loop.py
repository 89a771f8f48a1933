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


def run_cpu_loop(x: torch.Tensor, ex: ExpertParams, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map,
                 cache, *, auto: bool, split: bool) -> torch.Tensor:
    """x [M, K] -> [M, K] (accumulation dtype). ``split``: whole experts over torch's threads, else one worker;
    ``auto``: experts of few rows through BLAS where ``blas_plain_rows`` says, and below CHOSEN_BELOW tokens split
    or phased, whichever is faster on this machine now (the same bits either way)."""
    threads = torch.get_num_threads()
    blas = auto and blas_plain_rows(x.dtype)
    one_row = auto and x.shape[0] < ONE_ROW_BLAS_BELOW and phased_blas_rows(x.dtype)

    def run(mode: str) -> torch.Tensor:
        if mode == UNSPLIT:
            return experts_cpu_phased(x, ex, topk_ids, topk_weights, expert_map, cache,
                                      blas_plain=phased_blas_rows(x.dtype))
        return experts_cpu_fused(x, ex, topk_ids, topk_weights, expert_map, cache, workers=threads if split else 1,
                                 blas_plain=blas, one_row_blas=one_row)

    if auto and x.shape[0] < CHOSEN_BELOW and threads > 1:  # decode: timed online
        return split_chooser().call((x.shape[0].bit_length(), x.dtype, tuple(ex.w13.shape), threads), run)
    return run(SPLIT)
