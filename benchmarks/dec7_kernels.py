"""Rungs of the weight-only decode ladder (issue 16, session 27, ``dec7_device_check.py``): the word decode's
(``gemm_wo_gemv``) own launch geometry and loads with less and less of its work, so the rung where the stream
rate drops shows what limits the real kernel. Measurement code only; ``tests/test_dec7_kernels.py`` holds each
kernel to its torch twin and to a reference written there.

``geom_read_kernel`` is one GEMM's launch of the gemv decode: program (p, s) reads, for expert ids[p // tiles],
rows t·BN .. t·BN + BN (t = p % tiles) of that expert's packed words [E, R, KW] int32, and where PAIR the same rows
+ half (the gate-up's up rows), words [s·split_words, (s + 1)·split_words) in steps of BKW words, each step's tile
[BN, BKW] loaded AHEAD steps before it is used (the gemv's ``load_words`` and its loop; HALVES: as two loads of BKW / 2
words a row issued back to back, what a step of two 64-byte sub-steps would issue). What it does with a tile:
    LEVEL 0  xor-fold the words (a pure read with our geometry); parts[s·P + p] = the xor of every word it read
    LEVEL 1  decode every value of the words as the int4 gemv does (``wo_words.word_values``: 1 + q/128 at even
             positions, 1 + q/2048 at odd) and add them up in float32 (no activations, no scales); the words a
             step's tile holds past a row's end or the last row load as 0 and count 8.0 each
Shapes: E experts, R rows of a weight, KW words a row, P programs on grid axis 0 (experts read · tiles), S splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from moekit.experts._kernels.wo_words import load_words, word_values


@triton.jit
def _fold(acc, fsum, w, LEVEL: tl.constexpr, ASM: tl.constexpr):
    """acc [BN, BKW] int32 ^= w (LEVEL 0), or fsum [BN, BKW] float32 += the sum of w's eight int4 values."""
    if LEVEL == 0:
        acc ^= w
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = word_values(w, 1, ASM)
        fsum += ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
    return acc, fsum


@triton.jit
def _tile(rows, w0, w_end, ok, BN: tl.constexpr, BKW: tl.constexpr, LOAD: tl.constexpr, HALVES: tl.constexpr):
    """A step's words of the rows [BN] where LOAD, else zeros (nothing loaded): [BN, BKW], or with HALVES two loads of
    BKW / 2 words issued back to back, joined [BN, BKW / 2, 2] (no data moved: the new dim is a thread's own)."""
    if not LOAD:
        w = tl.zeros([BN, BKW // 2, 2] if HALVES else [BN, BKW], tl.int32)
    elif HALVES:
        w = tl.join(load_words(rows, w0, w_end, ok, BKW // 2), load_words(rows, w0 + BKW // 2, w_end, ok, BKW // 2))
    else:
        w = load_words(rows, w0, w_end, ok, BKW)
    return w


@triton.jit
def geom_read_kernel(q_ptr, ids_ptr, part_ptr, rows, half, kw, stride_e, stride_r, tiles, split_words,
                     BN: tl.constexpr, BKW: tl.constexpr, PAIR: tl.constexpr, AHEAD: tl.constexpr,
                     LEVEL: tl.constexpr, ASM: tl.constexpr, HALVES: tl.constexpr = False):
    """One GEMM launch's reads in the gemv decode's geometry (module doc); q_ptr int32 words [E, R, KW]."""
    pid, s = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pid // tiles).to(tl.int64)
    offs = (pid % tiles) * BN + tl.arange(0, BN)
    ok = offs < rows
    first = q_ptr + expert * stride_e + offs.to(tl.int64) * stride_r  # [BN] the rows' first words
    second = first + half * stride_r  # PAIR: the up rows
    w_start = s * split_words
    w_end = tl.minimum(w_start + split_words, kw)
    g = _tile(first, w_start, w_end, ok, BN, BKW, True, HALVES)
    u = _tile(second, w_start, w_end, ok, BN, BKW, PAIR, HALVES)
    acc, fsum = tl.zeros_like(g), tl.zeros_like(g).to(tl.float32)
    if AHEAD > 1:
        ng = _tile(first, w_start + BKW, w_end, ok, BN, BKW, True, HALVES)
        nu = _tile(second, w_start + BKW, w_end, ok, BN, BKW, PAIR, HALVES)
    for w0 in range(w_start, w_end, BKW):
        far_g = _tile(first, w0 + AHEAD * BKW, w_end, ok, BN, BKW, True, HALVES)
        far_u = _tile(second, w0 + AHEAD * BKW, w_end, ok, BN, BKW, PAIR, HALVES)
        acc, fsum = _fold(acc, fsum, g, LEVEL, ASM)
        if PAIR:
            acc, fsum = _fold(acc, fsum, u, LEVEL, ASM)
        if AHEAD > 1:
            g, u, ng, nu = ng, nu, far_g, far_u
        else:
            g, u = far_g, far_u
    out = part_ptr + s * tl.num_programs(0) + pid
    if LEVEL == 0:
        tl.store(out, tl.xor_sum(tl.reshape(acc, [BN * BKW]), 0))
    else:
        tl.store(out, tl.sum(tl.reshape(fsum, [BN * BKW]), 0))


@dataclass(frozen=True)
class GeomPlan:
    """One launch of ``geom_read_kernel``: the rows it covers, its tile, warps, splits and what it does."""

    rows: int  # rows a program's first tiles index (gate-up: N; down: R)
    half: int  # PAIR: the offset of the second rows (gate-up: N), else 0
    bn: int  # BN rows a program
    bkw: int  # BKW words a step (a power of two)
    warps: int = 2
    split: int = 1  # S: the reduction's splits
    ahead: int = 1  # AHEAD: steps of words loaded before the one in use (1 or 2)
    level: int = 0  # LEVEL (module doc)
    halves: bool = False  # HALVES: each step's words as two loads of bkw / 2 words issued back to back

    def tiles(self) -> int:
        return triton.cdiv(self.rows, self.bn)

    def split_words(self, kw: int) -> int:
        """Words a split: a whole number of steps, as the gemv's ``up_splits``."""
        return triton.cdiv(triton.cdiv(kw, self.bkw), self.split) * self.bkw

    def parts(self, num_ids: int, dev) -> torch.Tensor:
        """The output buffer: [S · P] int32 (LEVEL 0) or float32 (LEVEL 1)."""
        return torch.zeros(self.split * num_ids * self.tiles(), device=dev,
                           dtype=torch.int32 if self.level == 0 else torch.float32)


def launch_geom(words: torch.Tensor, ids: torch.Tensor, plan: GeomPlan, parts: torch.Tensor,
                asm: bool = False, warmup: bool = False) -> torch.Tensor:
    """parts <- ``geom_read_kernel`` over words [E, R, KW] int32 (a packed weight's ``q.view(torch.int32)``) for the
    experts ids [S] int32; ``asm``: the inline-PTX decode (NVIDIA); ``warmup``: compile only (nothing runs)."""
    if words.dtype != torch.int32 or words.dim() != 3 or words.stride(2) != 1:
        raise ValueError(f"words must be [E, R, KW] int32 with unit stride along KW, got {tuple(words.shape)}")
    if plan.half + plan.rows > words.shape[1] or plan.bkw & (plan.bkw - 1) or plan.bn & (plan.bn - 1):
        raise ValueError(f"rows {plan.rows} + {plan.half} past R {words.shape[1]}, or BN {plan.bn} / BKW {plan.bkw} "
                         "not a power of 2")
    grid = (ids.numel() * plan.tiles(), plan.split)
    args = (words, ids, parts, plan.rows, plan.half, words.shape[2], words.stride(0), words.stride(1), plan.tiles(),
            plan.split_words(words.shape[2]))
    meta = dict(BN=plan.bn, BKW=plan.bkw, PAIR=plan.half > 0, AHEAD=plan.ahead, LEVEL=plan.level, ASM=asm,
                HALVES=plan.halves, num_warps=plan.warps)
    if warmup:
        geom_read_kernel.warmup(*args, grid=grid, **meta)
    else:
        geom_read_kernel[grid](*args, **meta)
    return parts


def int4_values(words: np.ndarray) -> np.ndarray:
    """[..., 8] float64: the gemv's placed int4 values of each word (1 + q/128 at even t, 1 + q/2048 at odd t)."""
    q = (words.astype(np.int64)[..., None] >> (4 * np.arange(8))) & 0xF
    return 1.0 + q / np.where(np.arange(8) % 2 == 0, 128.0, 2048.0)


def geom_torch(words: torch.Tensor, ids: torch.Tensor, plan: GeomPlan) -> torch.Tensor:
    """The twin of ``launch_geom``: parts by the same schedule, on the host (LEVEL 1 in float64, cast)."""
    w = words.cpu().numpy()
    experts = ids.cpu().numpy().astype(np.int64)
    kw, tiles, sw = w.shape[2], plan.tiles(), plan.split_words(w.shape[2])
    out = np.zeros((plan.split, len(experts) * tiles), dtype=np.int32 if plan.level == 0 else np.float64)
    for p in range(len(experts) * tiles):
        lo = (p % tiles) * plan.bn
        rows = list(range(lo, min(lo + plan.bn, plan.rows)))
        rows += [r + plan.half for r in rows] if plan.half else []
        for s in range(plan.split):
            block = w[experts[p // tiles], rows, s * sw:min((s + 1) * sw, kw)]
            if plan.level == 0:
                out[s, p] = np.bitwise_xor.reduce(block.reshape(-1))
            else:  # the masked words of each step's tiles count 8.0 each (code 0)
                tile_words = plan.bn * plan.bkw * (2 if plan.half else 1)
                padded = -(-max(0, min((s + 1) * sw, kw) - s * sw) // plan.bkw) * tile_words - block.size
                out[s, p] = int4_values(block).sum() + 8.0 * padded
    return torch.from_numpy(out.reshape(-1)).to(torch.int32 if plan.level == 0 else torch.float32)
