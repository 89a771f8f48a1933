"""Probes of the H200's own bound at decode sizes (issues 13, 15, 16, 19): how fast one launch, or a chain of
dependent launches, streams the touched experts' bytes when it computes nothing. Measurement code only
(``bounds_device_check.py``); the kernels read, fold the words into an xor (so no load is optimised away) and write
one word per program. Torch twins beside each kernel; ``tests/test_bounds_kernels.py`` holds them together.

Shapes: E experts, W int32 words per expert, S experts read per call, G programs, M tokens, k slots, K hidden.
- slabs [E, W] int32: expert e's gate-up part is words [0, W13), its down part [W13, W) (the bytes of w13 and w2 of
  whatever format: bf16 pairs, e4m3 quads + scales, packed int4 + scales / zeros), each part padded to a multiple
  of PAD_WORDS;
- ids [S] int32 on the device: the experts a call reads, loaded by every program as the experts kernels load
  topk_ids (so a read's addresses depend on a load, as ours do).
Schedule of ``read_parts_kernel``: the S parts [first, first + words) cut into chunks of BLOCK words (chunk c:
expert ids[c // CPP], words first + (c % CPP)·BLOCK, CPP = words / BLOCK chunks a part); program p reads chunks p,
p + G, p + 2G, .. (grid-stride: at each step the programs read neighbouring chunks), the next chunk's load issued
before the current one is folded (two chunks in flight a program). parts[p] = xor of every word p read, xor dep[p %
D] when a dependency word is read (``DEP``).
PDL (programmatic dependent launch, compute capability >= 9.0, the host passes ``launch_pdl``): WAIT 0 no wait, 1
``gdc_wait`` before the first load (the data the reads depend on comes from the kernel before: ours), 2 after the
stream, just before the dependency word (the loosest legal chain: weights need nothing from the kernel before);
SIGNAL 0 never (dependents launch when this grid exits), 1 at the start, 2 after the stream.
The gate stage of a layer's chain is this read over the gate weight's words ([1, E·K/2], ids [0]) whose program 0
then copies the routed ids for the next launches (COPY): a lower bound of a gate + router launch, which also has to
combine its programs' logits and pick the top k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PAD_WORDS = 16384  # a part's words are padded to this (64 KB; every BLOCK swept divides it)
MAGIC = 0x7FFFFFFF  # a dependency word equal to this adds 1 to the k-sum (never in practice: keeps the load live)


@triton.jit
def _chunk(slab_ptr, ids_ptr, c, num_chunks, row_words, first, chunks_per_part, offs, BLOCK: tl.constexpr):
    """Words of chunk c ([BLOCK] int32; 0 where c >= num_chunks: nothing read)."""
    live = (tl.zeros_like(offs) + c) < num_chunks  # [BLOCK], one value (a per-element mask: the interpreter
    c = tl.minimum(c, num_chunks - 1)  # refuses a broadcast scalar one; constant over the block, so loads stay wide)
    e = tl.load(ids_ptr + c // chunks_per_part).to(tl.int64)
    base = e * row_words + first + (c % chunks_per_part).to(tl.int64) * BLOCK
    return tl.load(slab_ptr + base + offs, mask=live, other=0)


# Only the row stride and the first word stay specialized (their divisibility by 16 keeps the loads 16 bytes wide); the
# counts vary with every cell and config, and each new divisibility pattern would be another compile.
COUNTS = ["num_chunks", "chunks_per_part", "iters", "dep_n", "copy_n"]


@triton.jit(do_not_specialize=COUNTS)
def read_parts_kernel(slab_ptr, ids_ptr, dep_ptr, part_ptr, copy_src, copy_dst, row_words, first, num_chunks,
                      chunks_per_part, iters, dep_n, copy_n, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                      SIGNAL: tl.constexpr, DEP: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if WAIT == 1:
        gdc_wait()
    if SIGNAL == 1:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    nxt = _chunk(slab_ptr, ids_ptr, pid, num_chunks, row_words, first, chunks_per_part, offs, BLOCK)
    for i in range(1, iters + 1):
        cur = nxt
        nxt = _chunk(slab_ptr, ids_ptr, pid + i * grid, num_chunks, row_words, first, chunks_per_part, offs, BLOCK)
        acc ^= cur
    if SIGNAL == 2:
        gdc_launch_dependents()
    if WAIT == 2:
        gdc_wait()
    r = tl.xor_sum(acc, 0)
    if DEP:
        r ^= tl.load(dep_ptr + pid % dep_n)
    tl.store(part_ptr + pid, r)
    if COPY > 0:  # the gate stage's output: program 0 writes the ids the next launches read
        if pid == 0:
            s = tl.arange(0, COPY)
            tl.store(copy_dst + s, tl.load(copy_src + s, mask=s < copy_n), mask=s < copy_n)


@triton.jit(do_not_specialize=["total_rows"] + COUNTS[:3])
def read_parts_tma_kernel(desc, ids_ptr, part_ptr, rows_per_expert, first_row, total_rows, num_chunks,
                          chunks_per_part, iters, R: tl.constexpr, C: tl.constexpr):
    """``read_parts_kernel``'s schedule (no PDL, no dependency word) through a TMA descriptor over the slabs viewed
    [E·W/C, C]: chunk c is the box of R rows of C words at row ids[c // CPP]·W/C + first/C + (c % CPP)·R. Triton
    3.6 does not pipeline a descriptor load that feeds no dot (one 16 KB buffer at R 16, C 256, 3 stages, offline
    sm_90 compile), so a program has one box in flight; the programs resident on an SM keep its loads going."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    acc = tl.zeros([R, C], tl.int32)
    for i in range(iters):
        c = pid + i * grid
        live = c < num_chunks
        c = tl.minimum(c, num_chunks - 1)
        e = tl.load(ids_ptr + c // chunks_per_part)
        row = e * rows_per_expert + first_row + (c % chunks_per_part) * R
        acc ^= desc.load([tl.where(live, row, total_rows), 0])  # past the last row: zeros, nothing read
    tl.store(part_ptr + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def ksum_kernel(y_ptr, out_ptr, dep_ptr, dep_n, K, TOPK: tl.constexpr, BK: tl.constexpr, WAIT: tl.constexpr):
    """out[m, cols] = sum_j y[m·k + j, cols] in float32 (+1 where the dependency word is MAGIC), in y's dtype."""
    kb = tl.program_id(0)
    m = tl.program_id(1)
    if WAIT:
        gdc_wait()
    cols = kb * BK + tl.arange(0, BK)
    acc = tl.zeros([BK], tl.float32)
    for j in range(TOPK):
        acc += tl.load(y_ptr + (m * TOPK + j) * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    d = tl.load(dep_ptr + m % dep_n)
    acc += (d == 0x7FFFFFFF).to(tl.float32)
    tl.store(out_ptr + m * K + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < K)


@dataclass(frozen=True)
class ReadPlan:
    """One read launch: which words of each expert, how it is cut and launched."""

    first: int  # first word of each expert's range (0: gate-up part; W13: down part)
    words: int  # words a range, a multiple of block
    block: int  # BLOCK words a chunk (a power of two)
    programs: int  # G (grid-stride over the S·words/block chunks)
    num_warps: int = 4
    num_stages: int = 1  # Triton's pipeliner stages for the loop (1: the kernel's own two chunks in flight only)
    wait: int = 0  # WAIT, see the module doc (nonzero only with pdl)
    signal: int = 0  # SIGNAL
    pdl: bool = False  # launched with launch_pdl
    tma: int = 0  # > 0: ``read_parts_tma_kernel`` with boxes of [block / tma, tma] words (no PDL, no dependency)

    def chunks(self, num_ids: int) -> int:
        if self.words % self.block:
            raise ValueError(f"words {self.words} is not a multiple of block {self.block}")
        return num_ids * self.words // self.block

    def iters(self, num_ids: int) -> int:
        """Loop steps a program takes: ceil(chunks / programs)."""
        return -(-self.chunks(num_ids) // self.programs)


def launch_read(slabs: torch.Tensor, ids: torch.Tensor, plan: ReadPlan, parts: torch.Tensor,
                dep: torch.Tensor | None = None, copy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """parts [G] int32 <- each program's xor (see the module doc); dep: the word array the last step reads; copy
    (src [n], dst [n]) int32: program 0 copies src to dst after its stream (the gate stage writing the ids)."""
    if slabs.dtype != torch.int32 or slabs.dim() != 2 or not slabs.is_contiguous():
        raise ValueError(f"slabs must be a contiguous [E, W] int32 tensor, got {tuple(slabs.shape)} {slabs.dtype}")
    if plan.first + plan.words > slabs.shape[1]:
        raise ValueError(f"words [{plan.first}, {plan.first + plan.words}) outside a {slabs.shape[1]}-word row")
    if parts.shape != (plan.programs,) or parts.dtype != torch.int32:
        raise ValueError(f"parts must be [{plan.programs}] int32, got {tuple(parts.shape)} {parts.dtype}")
    if plan.tma:
        return _launch_read_tma(slabs, ids, plan, parts, dep, copy)
    dep_arg = parts if dep is None else dep
    src, dst = copy if copy is not None else (parts, parts)
    if src.shape != dst.shape or src.dtype != torch.int32 or dst.dtype != torch.int32:
        raise ValueError(f"copy must be two int32 tensors of one shape, got {tuple(src.shape)} and {tuple(dst.shape)}")
    read_parts_kernel[(plan.programs,)](
        slabs, ids, dep_arg, parts, src, dst, slabs.shape[1], plan.first, plan.chunks(ids.numel()),
        plan.words // plan.block, plan.iters(ids.numel()), dep_arg.numel(), src.numel(), BLOCK=plan.block,
        WAIT=plan.wait, SIGNAL=plan.signal, DEP=dep is not None, COPY=triton.next_power_of_2(src.numel()) if copy
        else 0, num_warps=plan.num_warps, num_stages=plan.num_stages, launch_pdl=plan.pdl)
    return parts


def _launch_read_tma(slabs: torch.Tensor, ids: torch.Tensor, plan: ReadPlan, parts: torch.Tensor,
                     dep: torch.Tensor | None, copy) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    cols, rows = plan.tma, plan.block // plan.tma
    aligned = all(v % cols == 0 for v in (slabs.shape[1], plan.first, plan.block))
    if dep is not None or copy is not None or plan.pdl or not aligned:
        raise ValueError(f"the TMA read takes no dependency or PDL, and W, first and block multiples of {cols}")
    flat = slabs.view(-1, cols)  # [E·W/C, C]
    desc = TensorDescriptor.from_tensor(flat, [rows, cols])
    read_parts_tma_kernel[(plan.programs,)](
        desc, ids, parts, slabs.shape[1] // cols, plan.first // cols, flat.shape[0], plan.chunks(ids.numel()),
        plan.words // plan.block, plan.iters(ids.numel()), R=rows, C=cols, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return parts


def read_parts_torch(slabs: torch.Tensor, ids: torch.Tensor, plan: ReadPlan,
                     dep: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of ``launch_read``: parts [G] int32 by the same schedule, on the host."""
    words = slabs.cpu().numpy()
    expert = ids.cpu().numpy().astype(np.int64)
    cpp = plan.words // plan.block
    parts = np.zeros(plan.programs, dtype=np.int32)
    for c in range(plan.chunks(len(expert))):
        lo = plan.first + (c % cpp) * plan.block
        parts[c % plan.programs] ^= np.bitwise_xor.reduce(words[expert[c // cpp], lo:lo + plan.block])
    if dep is not None:
        d = dep.cpu().numpy()
        parts ^= d[np.arange(plan.programs) % len(d)]
    return torch.from_numpy(parts)


def launch_ksum(y: torch.Tensor, out: torch.Tensor, dep: torch.Tensor, top_k: int, *, block_k: int = 1024,
                wait: bool = False, pdl: bool = False) -> None:
    """y [M·k, K] -> out [M, K]: the sum over each token's k slots (the experts call's last, tiny launch)."""
    m, k = out.shape
    if y.shape != (m * top_k, k):
        raise ValueError(f"y must be [{m * top_k}, {k}], got {tuple(y.shape)}")
    ksum_kernel[(triton.cdiv(k, block_k), m)](y, out, dep, dep.numel(), k, TOPK=top_k, BK=block_k, WAIT=wait,
                                               num_warps=4, launch_pdl=pdl)


def ksum_torch(y: torch.Tensor, top_k: int, dep: torch.Tensor) -> torch.Tensor:
    m = y.shape[0] // top_k
    d = dep.cpu()[torch.arange(m) % dep.numel()]  # [M]
    extra = (d == MAGIC).float().to(y.device)[:, None]
    return (y.view(m, top_k, -1).float().sum(1) + extra).to(y.dtype)
