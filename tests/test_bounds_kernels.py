"""The read-bound probes of ``benchmarks/bounds_kernels.py`` (run on the H200 by ``bounds_device_check.py``) under
Triton's interpreter, against their torch twins and against references written here: the xor of every word a call
must read (numpy's reduce over the selected slabs), a float64 loop for the gate and the k-sum."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bounds_kernels as bk  # noqa: E402


def slabs_of(num_experts: int, words: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (num_experts, words), generator=g, dtype=torch.int32)  # [E, W]


def xor_of_reads(slabs: torch.Tensor, ids: list[int], first: int, words: int) -> int:
    """Every word of rows ids, columns [first, first + words), folded by xor: what the whole call must read."""
    return int(np.bitwise_xor.reduce(slabs.numpy()[ids, first:first + words].reshape(-1)))


def fold(parts: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(parts.numpy()))


@pytest.mark.parametrize("block,programs", [(64, 3), (128, 1), (32, 7), (256, 40)])
@pytest.mark.parametrize("first,words", [(0, 512), (512, 256), (0, 768)])
def test_read_parts_reads_every_word_once(block, programs, first, words):
    slabs = slabs_of(9, 768)
    ids = [7, 2, 5, 0]
    ids_t = torch.tensor(ids, dtype=torch.int32)
    plan = bk.ReadPlan(first=first, words=words, block=block, programs=programs)
    parts = bk.launch_read(slabs, ids_t, plan, torch.full((programs,), -1, dtype=torch.int32))
    assert torch.equal(parts, bk.read_parts_torch(slabs, ids_t, plan))  # the schedule, program by program
    assert fold(parts) == xor_of_reads(slabs, ids, first, words)  # and the whole read, exactly


@pytest.mark.parametrize("block,tma,programs", [(64, 16, 3), (128, 32, 2), (256, 64, 5)])
def test_read_parts_tma_same_schedule(block, tma, programs):
    """The TMA read: the pointer read's schedule and words, program by program (its boxes [block / tma, tma])."""
    slabs = slabs_of(6, 512, seed=4)
    ids_t = torch.tensor([5, 0, 3], dtype=torch.int32)
    plan = bk.ReadPlan(first=256, words=256, block=block, programs=programs, tma=tma)
    parts = bk.launch_read(slabs, ids_t, plan, torch.full((programs,), -1, dtype=torch.int32))
    assert torch.equal(parts, bk.read_parts_torch(slabs, ids_t, plan))
    assert fold(parts) == xor_of_reads(slabs, [5, 0, 3], 256, 256)
    with pytest.raises(ValueError, match="TMA"):
        bk.launch_read(slabs, ids_t, plan, parts, dep=parts)


def test_read_parts_twin_is_its_own_schedule():
    """The twin is held to the closed form too (a program reads chunks p, p + G, ..)."""
    slabs = slabs_of(4, 256, seed=3)
    plan = bk.ReadPlan(first=0, words=256, block=64, programs=3)
    parts = bk.read_parts_torch(slabs, torch.tensor([3, 1], dtype=torch.int32), plan).numpy()
    chunks = [slabs.numpy()[e, c * 64:(c + 1) * 64] for e in (3, 1) for c in range(4)]  # chunk order of the call
    for p in range(3):
        assert parts[p] == np.bitwise_xor.reduce(np.concatenate(chunks[p::3]))


def test_read_parts_dependency_word():
    slabs = slabs_of(3, 128)
    ids = torch.tensor([1], dtype=torch.int32)
    dep = torch.tensor([11, -5], dtype=torch.int32)
    plan = bk.ReadPlan(first=0, words=128, block=32, programs=3)
    parts = bk.launch_read(slabs, ids, plan, torch.zeros(3, dtype=torch.int32), dep=dep)
    plain = bk.read_parts_torch(slabs, ids, plan)
    assert parts.tolist() == [plain[0] ^ 11, plain[1] ^ -5, plain[2] ^ 11]
    assert torch.equal(parts, bk.read_parts_torch(slabs, ids, plan, dep=dep))


def test_read_plan_errors():
    slabs = slabs_of(2, 128)
    ids = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of block"):
        bk.launch_read(slabs, ids, bk.ReadPlan(0, 96, 64, 1), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside"):
        bk.launch_read(slabs, ids, bk.ReadPlan(64, 128, 64, 1), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="parts must be"):
        bk.launch_read(slabs, ids, bk.ReadPlan(0, 128, 64, 2), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        bk.launch_read(slabs.float(), ids, bk.ReadPlan(0, 128, 64, 1), torch.zeros(1, dtype=torch.int32))


def test_read_parts_copies_the_ids():
    """The gate stage: a read of the gate weight's words whose program 0 then writes the ids the experts read."""
    gate = slabs_of(1, 256, seed=6)
    zero = torch.zeros(1, dtype=torch.int32)
    src = torch.tensor([9, 4, 7], dtype=torch.int32)
    dst = torch.full((3,), -1, dtype=torch.int32)
    plan = bk.ReadPlan(first=0, words=256, block=32, programs=3)
    parts = bk.launch_read(gate, zero, plan, torch.zeros(3, dtype=torch.int32), copy=(src, dst))
    assert dst.tolist() == [9, 4, 7]
    assert torch.equal(parts, bk.read_parts_torch(gate, zero, plan))
    assert fold(parts) == xor_of_reads(gate, [0], 0, 256)
    with pytest.raises(ValueError, match="copy must be"):
        bk.launch_read(gate, zero, plan, parts, copy=(src, dst[:2]))


def test_ksum_against_float64_loop():
    g = torch.Generator().manual_seed(2)
    m, top_k, k = 3, 4, 200
    y = torch.randn(m * top_k, k, generator=g).to(torch.bfloat16)  # [M·k, K]
    out = torch.zeros(m, k, dtype=torch.bfloat16)
    dep = torch.tensor([5, bk.MAGIC], dtype=torch.int32)  # token 1 reads the MAGIC word: +1
    bk.launch_ksum(y, out, dep, top_k, block_k=64)
    yd = y.double().numpy()
    want = np.array([[sum(yd[t * top_k + j, c] for j in range(top_k)) + (t % 2 == 1) for c in range(k)]
                     for t in range(m)])
    assert np.allclose(out.double().numpy(), want, rtol=1e-2, atol=1e-2)
    # one bf16 step apart at most: the interpreter rounds float32 -> bf16 its own way
    assert torch.allclose(out.float(), bk.ksum_torch(y, top_k, dep).float(), rtol=8e-3, atol=1e-2)
    with pytest.raises(ValueError, match="y must be"):
        bk.launch_ksum(y[:-1], out, dep, top_k)
