"""The pure-read bound of a call's weight bytes (session 52, issues 15 and 19): one launch that streams exactly the
touched experts' w13 and w2 bytes and computes nothing but a wrapping int32 sum of the words (so no load is dropped),
shaped as session 26's ``bounds`` found fastest on the H200 (many short programs, 4 warps, two 8 KB chunks a
program, both loads issued before either is summed: 4.65 TB/s once running, 1.11x the copy rate).

    table = read_table([w13, w2], touched)          # the chunks of every touched expert's parts, relative to w13
    sums = read_bound(table)                        # [programs] int32, one launch
    assert words_sum([w13, w2], touched) == parts_sum(sums)   # the torch twin: the same words summed mod 2**32

Shapes: P parts (tensors [E, ...], contiguous, one expert's part a run of whole int32 words), S touched experts, C
chunks of at most BLOCK words (C = S * sum over parts of ceil(words a part / BLOCK)), G = ceil(C / PER) programs.
The table's starts are in 16-byte units from the first part's data pointer (a later part's may be negative), so the
loads stay 16 bytes wide: the compiler knows start * 4 words is a multiple of 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.triton_bind import COMPILE_OPTIONS

BLOCK = 2048  # int32 words a chunk (8 KB)
PER = 2  # chunks a program
WARPS = 4


@triton.jit
def _chunk(base_ptr, starts_ptr, counts_ptr, c, num_chunks, offs, BLOCK: tl.constexpr):
    """The [BLOCK] int32 words of chunk c (0 past its count, and everywhere past the last chunk)."""
    cc = tl.minimum(c, num_chunks - 1)
    start = tl.load(starts_ptr + cc)  # int64, 16-byte units from base_ptr
    count = tl.load(counts_ptr + cc) * 4  # words of this chunk (<= BLOCK): a multiple of 4, so the mask is constant
    live = offs < count * (c < num_chunks).to(tl.int32)  # over 4 words and the loads stay 16 bytes wide; past the
    # last chunk: nothing read
    return tl.load(base_ptr + start * 4 + offs, mask=live, other=0)


@triton.jit(do_not_specialize=["num_chunks"])
def read_chunks_kernel(base_ptr, starts_ptr, counts_ptr, parts_ptr, num_chunks, BLOCK: tl.constexpr,
                       PER: tl.constexpr):
    """parts[p] = the wrapping int32 sum of the words of chunks p*PER .. p*PER + PER - 1 (those < num_chunks); the
    PER loads are independent, so all are in flight before the first add."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    acc = _chunk(base_ptr, starts_ptr, counts_ptr, pid * PER, num_chunks, offs, BLOCK)
    for i in tl.static_range(1, PER):
        acc += _chunk(base_ptr, starts_ptr, counts_ptr, pid * PER + i, num_chunks, offs, BLOCK)
    tl.store(parts_ptr + pid, tl.sum(acc, 0))


@dataclass(frozen=True)
class ReadTable:
    """What one read launch streams: chunk c is ``counts[c]`` 16-byte units from ``base`` + 16 * ``starts[c]`` bytes."""

    base: torch.Tensor  # the first part, viewed as int32 words (its data pointer is the launch's base)
    starts: torch.Tensor  # [C] int64, 16-byte units from base's data pointer
    counts: torch.Tensor  # [C] int32, 16-byte units (<= BLOCK / 4)
    nbytes: int  # the bytes the chunks cover


def read_table(parts: list[torch.Tensor], expert_ids) -> ReadTable:
    """The chunks of ``parts`` (each [E, ...], contiguous, 16-byte aligned, an expert's slice a multiple of 16 bytes)
    for each expert of ``expert_ids`` (distinct ids, any order), parts in order within an expert."""
    if not parts:
        raise ValueError("parts must name at least one tensor")
    base_ptr = parts[0].data_ptr()
    starts, counts = [], []
    for i, p in enumerate(parts):
        if not p.is_contiguous() or p.data_ptr() % 16:
            raise ValueError(f"parts[{i}] must be contiguous and 16-byte aligned")
        per_expert = p[0].numel() * p.element_size()
        if per_expert % 16:
            raise ValueError(f"parts[{i}]: an expert's slice must be a multiple of 16 bytes, got {per_expert}")
    ids = [int(e) for e in torch.as_tensor(expert_ids).reshape(-1).tolist()]
    if len(set(ids)) != len(ids):
        raise ValueError("expert_ids must be distinct")
    for e in ids:
        for p in parts:
            per_expert = p[0].numel() * p.element_size()
            first = (p.data_ptr() - base_ptr + e * per_expert) // 16
            offsets = torch.arange(0, per_expert // 4, BLOCK, dtype=torch.int64)  # words from the slice's start
            starts.append(first + offsets // 4)
            counts.append(((per_expert // 4 - offsets).clamp(max=BLOCK) // 4).to(torch.int32))
    dev = parts[0].device
    counts = torch.cat(counts)
    return ReadTable(parts[0].reshape(-1).view(torch.int32), torch.cat(starts).to(dev), counts.to(dev),
                     int(counts.sum()) * 16)


def read_bound(table: ReadTable, parts: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``read_chunks_kernel`` over ``table``: [G] int32 partial sums (into ``parts`` where given)."""
    num_chunks = table.starts.numel()
    grid = triton.cdiv(num_chunks, PER)
    if parts is None:
        parts = torch.empty(grid, dtype=torch.int32, device=table.starts.device)
    read_chunks_kernel[(grid,)](table.base, table.starts, table.counts, parts, num_chunks, BLOCK=BLOCK, PER=PER,
                                num_warps=WARPS, **COMPILE_OPTIONS)
    return parts


def words_sum(parts: list[torch.Tensor], expert_ids) -> int:
    """The torch twin: every word of the touched experts' slices of ``parts``, summed mod 2**32 (from the tensors
    themselves, not the table)."""
    total = 0
    for e in torch.as_tensor(expert_ids).reshape(-1).tolist():
        for p in parts:
            total += p[int(e)].reshape(-1).view(torch.int32).long().sum().item()
    return total % 2**32


def parts_sum(parts: torch.Tensor) -> int:
    """The kernel's partial sums, summed mod 2**32."""
    return parts.long().sum().item() % 2**32
