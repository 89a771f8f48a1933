"""The decode ladder's read kernel (``benchmarks/dec7_kernels.py``, run on the H200 by ``dec7_device_check.py``)
under Triton's interpreter: against its torch twin, and against references written here (the xor of every word a
launch must read; a float64 loop over the words' nibbles for the decoding level)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import dec7_kernels as dk  # noqa: E402


def words_of(e: int, r: int, kw: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (e, r, kw), generator=g, dtype=torch.int32)  # [E, R, KW]


def xor_rows(words: torch.Tensor, ids: list[int], rows: int, pair: bool) -> int:
    """Every word of rows [0, rows) (and [rows, 2 rows) where pair) of each expert read, folded by xor."""
    block = words.numpy()[ids, :2 * rows if pair else rows].reshape(-1)
    return int(np.bitwise_xor.reduce(block))


def nibble_sum(words: torch.Tensor, ids: list[int], rows: int, pair: bool) -> float:
    """The gemv's placed int4 values summed in float64, one nibble at a time: value t of a word is 1 + q/128
    (even t) or 1 + q/2048 (odd t), q its bits 4t .. 4t+3."""
    total = 0.0
    for e in ids:
        for w in words[e, :2 * rows if pair else rows].reshape(-1).tolist():
            for t in range(8):
                total += 1 + ((w >> (4 * t)) & 15) / (128 if t % 2 == 0 else 2048)
    return total


def run(words, ids, plan):
    return dk.launch_geom(words, torch.tensor(ids, dtype=torch.int32), plan, plan.parts(len(ids), "cpu"))


@pytest.mark.parametrize("bn,bkw,split,ahead,halves", [(8, 16, 1, 1, False), (4, 32, 3, 2, False), (16, 8, 2, 1, True),
                                                      (2, 64, 1, 2, False), (4, 32, 3, 2, True)])
@pytest.mark.parametrize("pair", [False, True])
def test_pure_read_reads_every_word_once(bn, bkw, split, ahead, halves, pair):
    words = words_of(5, 40, 52)
    ids, rows = [3, 1, 4], 20 if pair else 37  # 37: a last tile past the rows; 52 words: a step past the row
    plan = dk.GeomPlan(rows, rows if pair else 0, bn, bkw, split=split, ahead=ahead, halves=halves)
    parts = run(words, ids, plan)
    assert torch.equal(parts, dk.geom_torch(words, torch.tensor(ids), plan))
    assert int(np.bitwise_xor.reduce(parts.numpy())) == xor_rows(words, ids, rows, pair)


@pytest.mark.parametrize("bn,bkw,split,ahead,pair,halves", [(4, 16, 2, 1, True, False), (8, 8, 1, 2, False, False),
                                                             (4, 16, 1, 2, True, True)])
def test_decoding_read_sums_the_values(bn, bkw, split, ahead, pair, halves):
    # 32 words a row, 16 rows: every tile full, so the parts sum to the values alone
    words = words_of(4, 32, 32, seed=3)
    ids = [2, 0]
    plan = dk.GeomPlan(16, 16 if pair else 0, bn, bkw, split=split, ahead=ahead, level=1, halves=halves)
    parts = run(words, ids, plan)
    assert torch.allclose(parts, dk.geom_torch(words, torch.tensor(ids), plan), rtol=1e-6)
    assert abs(parts.double().sum().item() - nibble_sum(words, ids, 16, pair)) < 1e-6 * parts.double().sum().item()


def test_decoding_read_counts_masked_words():
    # 37 rows in 8-row tiles and 52 words in 16-word steps: the twin adds 8.0 a masked word, as the kernel decodes 0
    words = words_of(3, 40, 52, seed=4)
    plan = dk.GeomPlan(37, 0, 8, 16, level=1)
    parts = run(words, [1], plan)
    padded = (5 * 8 * 64 - 37 * 52) * 8.0
    assert abs(parts.double().sum().item() - nibble_sum(words, [1], 37, False) - padded) < 1e-3
