"""The bound kernel of ``ovl_device_check.py`` (issues 15, 19 at the ridge): a persistent, warp-specialized Gluon
kernel that streams exactly a cell's weight bytes and runs exactly its tensor work on them (``ovl_plan``: the boxes,
their split, the torch twin ``ovl_twin``). No real grouped GEMM reads fewer bytes or runs fewer MMAs, so its time
bounds theirs on this GPU; its MODE runs the loads alone or the MMAs alone.

One program an SM takes boxes [lo, hi) (``OvlPlan.span``). Partitions:
  - loader (1 warp): box b's CONSUMERS [64, BK] TMA boxes (rows 64c.. of its BW-row block) into a STAGES-deep ring;
    ``ready`` (bytes landed), ``empty`` (count CONSUMERS: every consumer's MMAs on the stage retired);
  - consumer c (4 warps each; c = 0 the default partition): NCHUNK wgmmas a stage, [64, BK] weights (SMEM, the MMA's
    A) x the resident [TN, BK] tile's transpose (SMEM, B), into one float32 [64, TN] accumulator; bf16 and plain fp8
    keep one stage's wgmmas in flight (the stage before is released when they retire); PROMOTE (fp8 with
    DeepSeek-V3's per-128 block scales, BK = 128): each wgmma into a fresh part, waited, then acc += part x token
    scale x box scale in float32 (the scales computed, not loaded: ``ovl_plan.token_scales`` / ``box_scale``).
The resident tile (and, MODE MMAS, the ring) is loaded once before the partitions start. One store at the end:
out [G, CONSUMERS, 64, TN] float32. Gluon needs sm_90 and does not run in the interpreter (``ovl_compile_cpu.py``
compiles it offline; ``ovl_plan.ovl_twin`` is its arithmetic).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ovl_plan import HALF_ROWS, OvlPlan

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# MODE: the bound; its loads alone (no MMA); its MMAs alone (on a ring filled once)
BOTH, LOADS, MMAS = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
MODES = {"both": 0, "loads": 1, "mmas": 2}
FIRST = gl.constexpr(0)  # a consumer's index (a partition's arguments must be values or constexprs)
SECOND = gl.constexpr(1)


@gluon.jit
def _span(boxes):
    """This program's boxes [lo, hi) (``OvlPlan.span``)."""
    pid = gl.program_id(0)
    g = gl.num_programs(0)
    return pid * boxes // g, (pid + 1) * boxes // g


@gluon.jit
def _loader(w13_desc, w2_desc, w_bufs, ready, empty, boxes, boxes13, steps13, steps2, STAGES: gl.constexpr,
            CONSUMERS: gl.constexpr, MODE: gl.constexpr):
    BLOCK_K: gl.constexpr = w13_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = CONSUMERS * 64
    if MODE != MMAS:
        lo, hi = _span(boxes)
        for i in range(hi - lo):
            b = lo + i
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), CONSUMERS * w13_desc.block_type.nbytes)
            if b < boxes13:
                row = b // steps13 * BLOCK_W
                for c in gl.static_range(CONSUMERS):
                    _tma_load(w13_desc, [row + c * 64, b % steps13 * BLOCK_K], ready.index(s),
                              w_bufs.index(s * CONSUMERS + c))
            else:
                b2 = b - boxes13
                row = b2 // steps2 * BLOCK_W
                for c in gl.static_range(CONSUMERS):
                    _tma_load(w2_desc, [row + c * 64, b2 % steps2 * BLOCK_K], ready.index(s),
                              w_bufs.index(s * CONSUMERS + c))


@gluon.jit
def _consumer(a_smem, w_bufs, ready, empty, out_ptr, boxes, HALF: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr, NCHUNK: gl.constexpr, INSTR_K: gl.constexpr, MODE: gl.constexpr,
              PROMOTE: gl.constexpr):
    TN: gl.constexpr = a_smem.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, TN, INSTR_K])
    cols = gl.arange(0, TN, layout=gl.SliceLayout(0, layout))  # [TN]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))  # [64]
    acc = gl.zeros([64, TN], gl.float32, layout)
    lo, hi = _span(boxes)
    if PROMOTE == 2 and MODE != LOADS:
        acc = _promote_pipelined(a_smem, w_bufs, ready, empty, acc, cols, hi - lo, HALF, STAGES, CONSUMERS, NCHUNK,
                                 MODE)
    else:
        t_scale = 1.0 + (cols % 8).to(gl.float32) * 0.0625  # ``ovl_plan.token_scales``
        part = gl.zeros([64, TN], gl.float32, layout)
        for i in range(hi - lo):
            s = i % STAGES
            if MODE != MMAS:
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            w = w_bufs.index(s * CONSUMERS + HALF)
            if MODE == LOADS:
                mbarrier.arrive(empty.index(s), count=1)
            elif PROMOTE == 1:
                scale = t_scale * (1.0 + (i % 4).to(gl.float32) * 0.125)  # x ``ovl_plan.box_scale(i)``
                for c in range(NCHUNK):  # a loop, not unrolled: unrolled, ptxas spilled 160 B at 4 chunks
                    part = warpgroup_mma(w, _chunk(a_smem, c), part, use_acc=False, is_async=True)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                    acc += part * scale[None, :]
                if MODE == BOTH:
                    mbarrier.arrive(empty.index(s), count=1)
            else:
                for c in gl.static_range(NCHUNK):
                    acc = warpgroup_mma(w, _chunk(a_smem, c), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=NCHUNK, deps=(acc,))  # the stage before's wgmmas retired
                if MODE == BOTH:
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        if MODE != LOADS and PROMOTE == 0:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    tile = (gl.program_id(0) * CONSUMERS + HALF) * 64
    gl.store(out_ptr + (tile + rows[:, None]) * TN + cols[None, :], acc)


@gluon.jit
def _chunk(a_smem, c):
    """Chunk c's B operand [BK, TN]: resident tile c mod 2, so two chunks in flight never have the same operands
    (identical ones were merged: CK1b's first pipelined promotion ran half its wgmmas) and the twin tells a merged
    or hoisted chunk from a run one."""
    return a_smem.index(c % a_smem.type.shape[0]).permute((1, 0))


@gluon.jit
def _pair(wa, wb, ba, bb, acc, zero, scale_a, scale_b):
    """Two wgmmas in flight, each into a fresh part; the first folded in (x its scales) while the second runs."""
    pa = warpgroup_mma(wa, ba, zero, use_acc=False, is_async=True)
    pb = warpgroup_mma(wb, bb, zero, use_acc=False, is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc += done * scale_a[None, :]
    done = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
    return acc + done * scale_b[None, :]


@gluon.jit
def _promote_pipelined(a_smem, w_bufs, ready, empty, acc, cols, n, HALF: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMERS: gl.constexpr, NCHUNK: gl.constexpr, MODE: gl.constexpr):
    """PROMOTE 2: the promotion with two wgmmas in flight (``_pair``): an even NCHUNK pairs a box's chunks, one
    chunk pairs two boxes (an odd last box alone, waited). Nothing in flight crosses a loop's back edge (a part
    kept in flight across iterations made ptxas serialize the wgmmas, C7514, and spill 840 B)."""
    t_scale = 1.0 + (cols % 8).to(gl.float32) * 0.0625  # ``ovl_plan.token_scales``
    zero = gl.zeros_like(acc)
    if NCHUNK % 2 == 0:
        for i in range(n):
            s = i % STAGES
            if MODE != MMAS:
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            w = w_bufs.index(s * CONSUMERS + HALF)
            scale = t_scale * (1.0 + (i % 4).to(gl.float32) * 0.125)  # x ``ovl_plan.box_scale(i)``
            for c in range(NCHUNK // 2):
                acc = _pair(w, w, _chunk(a_smem, 0), _chunk(a_smem, 1), acc, zero, scale, scale)
            if MODE == BOTH:
                mbarrier.arrive(empty.index(s), count=1)
    else:
        for j in range(n // 2):
            sa = (2 * j) % STAGES
            sb = (2 * j + 1) % STAGES
            if MODE != MMAS:
                mbarrier.wait(ready.index(sa), ((2 * j) // STAGES) & 1)
                mbarrier.wait(ready.index(sb), ((2 * j + 1) // STAGES) & 1)
            scale = t_scale * (1.0 + ((2 * j) % 4).to(gl.float32) * 0.125)  # box 2j's; box 2j + 1's: + 1/8
            b_op = _chunk(a_smem, 0)
            acc = _pair(w_bufs.index(sa * CONSUMERS + HALF), w_bufs.index(sb * CONSUMERS + HALF), b_op, b_op, acc,
                        zero, scale, scale + t_scale * 0.125)
            if MODE == BOTH:
                mbarrier.arrive(empty.index(sa), count=1)
                mbarrier.arrive(empty.index(sb), count=1)
        if n % 2 == 1:
            i = n - 1
            s = i % STAGES
            if MODE != MMAS:
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            part = warpgroup_mma(w_bufs.index(s * CONSUMERS + HALF), _chunk(a_smem, 0), zero, use_acc=False)
            acc += part * (t_scale * (1.0 + (i % 4).to(gl.float32) * 0.125))[None, :]
    return acc


@gluon.jit(do_not_specialize=["boxes", "boxes13", "steps13", "steps2"])  # one compile per tile, any cell
def ovl_kernel(w13_desc, w2_desc, a_desc, out_ptr, boxes, boxes13, steps13, steps2, STAGES: gl.constexpr,
               CONSUMERS: gl.constexpr, NCHUNK: gl.constexpr, INSTR_K: gl.constexpr, MODE: gl.constexpr,
               PROMOTE: gl.constexpr, CONSUMER_REGS: gl.constexpr, TN: gl.constexpr, num_warps: gl.constexpr):
    """w13_desc [E·2N, K] and w2_desc [E·K, N] (one dtype) in [64, BK] boxes; a_desc [TILES·TN, BK] in [TN, BK]
    boxes (TILES = 2 where NCHUNK > 1: chunk c multiplies tile c mod 2); out_ptr
    [G, CONSUMERS, 64, TN] float32; boxes, boxes13, steps13, steps2: ``OvlPlan``'s; num_warps = 4 (consumer 0);
    PROMOTE: 0 none, 1 each wgmma waited then folded, 2 pipelined (``_promote_pipelined``)."""
    w_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES * CONSUMERS] + w13_desc.block_type.shape,
                                       w13_desc.layout)
    TILES: gl.constexpr = 2 if NCHUNK > 1 else 1
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [TILES] + a_desc.block_type.shape, a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    start = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    mbarrier.init(start, count=1)
    if MODE == MMAS:  # the ring filled once: w13's first rows
        mbarrier.expect(start, TILES * a_desc.block_type.nbytes + STAGES * CONSUMERS * w13_desc.block_type.nbytes)
        for j in gl.static_range(STAGES * CONSUMERS):
            _tma_load(w13_desc, [j * 64, 0], start, w_bufs.index(j))
    else:
        mbarrier.expect(start, TILES * a_desc.block_type.nbytes)
    for j in gl.static_range(TILES):
        _tma_load(a_desc, [j * TN, 0], start, a_smem.index(j))
    mbarrier.wait(start, 0)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_smem, w_bufs, ready, empty, out_ptr, boxes, FIRST, STAGES, CONSUMERS, NCHUNK, INSTR_K,
                         MODE, PROMOTE)),
            (_consumer, (a_smem, w_bufs, ready, empty, out_ptr, boxes, SECOND, STAGES, CONSUMERS, NCHUNK, INSTR_K,
                         MODE, PROMOTE)),
            (_loader, (w13_desc, w2_desc, w_bufs, ready, empty, boxes, boxes13, steps13, steps2, STAGES, CONSUMERS,
                       MODE)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (a_smem, w_bufs, ready, empty, out_ptr, boxes, FIRST, STAGES, CONSUMERS, NCHUNK, INSTR_K,
                         MODE, PROMOTE)),
            (_loader, (w13_desc, w2_desc, w_bufs, ready, empty, boxes, boxes13, steps13, steps2, STAGES, CONSUMERS,
                       MODE)),
        ], [1], [24])


MAX_REGISTERS = {1: 128, 2: 160}  # at launch, per consumer count: (2 or 3 warpgroups) x this - 24 (loader) - 224
CONSUMER_REGS = 224  # consumer 1's (2 consumers)


def launch_ovl(plan: OvlPlan, w13: torch.Tensor, w2: torch.Tensor, a: torch.Tensor, out: torch.Tensor, mode: str,
               promote: int, stages: int) -> torch.Tensor:
    """out [G, C, 64, TN] float32 <- the kernel on w13 [E·2N, K], w2 [E·K, N] (2-D views; bf16 or e4m3) and the
    resident a [TILES·TN, BK] (w13's dtype; ``OvlPlan.resident_rows``); mode "both", "loads" or "mmas"; promote (fp8
    only, BK = 128): 1 waited, 2 pipelined."""
    from moekit.experts.triton_gluon_launch import gluon_descriptor

    want = (plan.programs, plan.consumers, HALF_ROWS, plan.tn)
    if out.shape != want or out.dtype != torch.float32 or a.shape != (plan.resident_rows, plan.block_k):
        raise ValueError(f"out must be {want} float32 and a [{plan.resident_rows}, {plan.block_k}]")
    if promote and (w13.dtype != torch.float8_e4m3fn or plan.block_k != 128):
        raise ValueError("the promotion is fp8's, with 128-column boxes")
    if plan.boxes < plan.programs:
        raise ValueError(f"{plan.boxes} boxes for {plan.programs} programs: every program needs one")
    box = [HALF_ROWS, plan.block_k]
    ovl_kernel[(plan.programs,)](
        gluon_descriptor(w13, box), gluon_descriptor(w2, box), gluon_descriptor(a, [plan.tn, plan.block_k]), out,
        plan.boxes, plan.boxes13, plan.steps13, plan.steps2, STAGES=stages, CONSUMERS=plan.consumers,
        NCHUNK=plan.nchunk, INSTR_K=32 if w13.element_size() == 1 else 16, MODE=MODES[mode], PROMOTE=promote,
        CONSUMER_REGS=CONSUMER_REGS, TN=plan.tn, num_warps=4, maxnreg=MAX_REGISTERS[plan.consumers])
    return out
