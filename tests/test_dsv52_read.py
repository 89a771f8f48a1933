"""The pure-read bound's kernel (``benchmarks/dsv52_read.py``) under the interpreter: it reads exactly the touched
experts' words of every part (a wrapping int32 sum against a float64-free integer loop over the tensors), parts
before the first in memory included, chunk tails masked, nothing of an untouched expert."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import dsv52_read  # noqa: E402


def loop_sum(parts, ids) -> int:
    """Every int32 word of the touched experts' slices, one by one in Python integers, mod 2**32."""
    total = 0
    for e in ids:
        for p in parts:
            for word in p[e].reshape(-1).view(torch.int32).tolist():
                total += word
    return total % 2**32


def test_reads_the_touched_slices_of_every_part(monkeypatch):
    monkeypatch.setattr(dsv52_read, "BLOCK", 64)  # slices of 96 and 40 words: a full chunk and a masked tail each
    g = torch.Generator().manual_seed(0)
    w2 = torch.randint(-2**15, 2**15, (6, 4, 20), generator=g, dtype=torch.int16).view(torch.bfloat16)  # first alloc
    w13 = torch.randint(-2**31, 2**31 - 1, (6, 96), generator=g, dtype=torch.int64).to(torch.int32)
    ids = [4, 1, 5]
    table = dsv52_read.read_table([w13, w2], ids)
    assert table.nbytes == 3 * (96 * 4 + 80 * 2)
    assert table.starts.numel() == 3 * (2 + 1)
    sums = dsv52_read.read_bound(table)
    expect = loop_sum([w13, w2], ids)
    assert dsv52_read.parts_sum(sums) == expect
    assert dsv52_read.words_sum([w13, w2], ids) == expect
    # an untouched expert changed: the same sum; a touched one: another
    w13[0] += 1
    assert dsv52_read.parts_sum(dsv52_read.read_bound(table)) == expect
    w2.view(torch.int16)[5, 3, 19] += 1  # the high half of the slice's last word
    assert dsv52_read.parts_sum(dsv52_read.read_bound(table)) == (expect + 2**16) % 2**32 == loop_sum([w13, w2], ids)


def test_fp8_bytes_and_bad_tables():
    q = torch.randint(0, 255, (3, 8, 16), dtype=torch.uint8)  # 128 bytes an expert: 32 words
    table = dsv52_read.read_table([q], [2])
    assert dsv52_read.parts_sum(dsv52_read.read_bound(table)) == loop_sum([q], [2])
    with pytest.raises(ValueError, match="distinct"):
        dsv52_read.read_table([q], [2, 2])
    with pytest.raises(ValueError, match="parts\\[0\\]"):
        dsv52_read.read_table([q[:, :, :4].contiguous()[:, :, :2]], [0])
    with pytest.raises(ValueError, match="at least one"):
        dsv52_read.read_table([], [0])
