"""One persistent, warp-specialized Gluon kernel for a whole decode call (Hopper; issues 19, 15, 16).

    h[s]      = bf16(silu(x[tok(s)] @ w13[e(s), :N]^T) * (x[tok(s)] @ w13[e(s), N:]^T))   s: a slot, tok(s) = s // k
    y[s]      = weight[s] * (h[s] @ w2[e(s)]^T)                                           float32
    out[t]    = bf16(sum over j = 0..k-1, in order, of y[t*k + j])

One program per SM (grid <= #SMs, one program per SM by its shared memory, so all run at once) walks one tile
list, tile t = program_id + i * grid: first the S*NB*KS gate-up tiles (slot s, BM rows of N; gate and up rows
both; KS pieces along K, summed in order by the last piece to finish), then the S*KB down tiles (slot s, BM
rows of K). Every program does all its gate-up tiles before any
down tile, so a down tile only ever waits on gate-up tiles, which never wait: no deadlock.

Two partitions share ONE shared-memory ring of STAGES stages, each stage two [BM, BK] weight tiles:
  - loader (1 warp): for every tile of the program in order its weight tiles: gate-up steps load a gate tile
    and an up tile of one BK step, down steps two BK steps of w2's rows. It never waits on another program:
    the w2 tiles of a down tile are in flight while the gate-up results they need are still being computed
    elsewhere.
  - MMA (num_warps = 4, one warpgroup): first x's M rows (all K) into SMEM as XR = 8 zero-padded rows (plain
    loads: no per-call TMA descriptor). Swap-AB wgmma: weights the [BM, BK] A operand, x's rows (gate-up) or
    the S slots' h rows (down) the narrow B operand ([BK, XR] / [BK, HR]). Gate-up epilogue: the slot's token
    column, silu * mul (KS > 1: the pieces' partials first), h[s] stored, a CTA barrier, a release increment
    of up_done[s]. Before its first down tile a program acquire-spins until every slot's up_done == NB
    (bounded: a bug gives a wrong result, not a hang) and stages all S rows of h in SMEM once (HR = 8 or 16
    rows); a down tile's MMAs read the ring's w2 tiles against them, y[s] = weight * column s in float32,
    then an acq_rel arrival on arrive[tok, kb]; the k-th arrival sums the token's k slots in slot order (the
    same order whichever program comes last: deterministic) into out and zeroes its counter. The last program
    out (exit counter) zeroes up_done and the exit counter: the counters are 0 again for the next call, so no
    memset launch and the call is graph-capturable.

Triton 3.6 spells the CTA barrier ``thread_barrier``, 3.9 ``barrier``; the aliases pick whichever exists.
Gluon does not run in the interpreter: the torch twin (``triton_gluon_decode.decode_twin``) follows the same
tile schedule on any device.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tma_load

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
MAX_SPINS = gl.constexpr(1 << 22)  # acquire reads of a counter before a down tile gives up (about seconds: only a bug gets there)


@gluon.jit
def _slot_tile(t, S: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr, KS: gl.constexpr):
    """Tile id -> (is gate-up, slot, row block, K piece): gate-up tiles (slot, row block, piece) slot-major, then down
    tiles (slot, row block) slot-major."""
    up = t < S * NB * KS
    d = gl.where(up, t, t - S * NB * KS)
    per = gl.where(up, NB * KS, KB)
    r = d % per
    return up, d // per, gl.where(up, r // KS, r), gl.where(up, r % KS, 0)


@gluon.jit
def _decode_loader(w13_desc, w2_desc, ring, ready, empty, ids_ptr, num_experts, S: gl.constexpr, N: gl.constexpr,
                   K: gl.constexpr, KS: gl.constexpr):
    BM: gl.constexpr = w13_desc.block_type.shape[0]
    BK: gl.constexpr = w13_desc.block_type.shape[1]
    STAGES: gl.constexpr = ring.type.shape[0] // 2
    NB: gl.constexpr = N // BM
    KB: gl.constexpr = K // BM
    KP: gl.constexpr = K // BK // KS  # reduction steps of a gate-up piece
    nbytes: gl.constexpr = 2 * w13_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), S * (NB * KS + KB), gl.num_programs(0)):
        up, s, blk, piece = _slot_tile(t, S, NB, KB, KS)
        e = gl.minimum(gl.load(ids_ptr + s), num_experts - 1)  # an id >= E (EP skip): weight 0, any expert's rows
        if up:
            row = e * (2 * N) + blk * BM
            for kk in range(piece * KP, piece * KP + KP):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.expect(ready.index(st), nbytes)
                _tma_load(w13_desc, [row, kk * BK], ready.index(st), ring.index(2 * st))
                _tma_load(w13_desc, [row + N, kk * BK], ready.index(st), ring.index(2 * st + 1))
                it += 1
        else:
            row = e * K + blk * BM
            for j in range(N // (2 * BK)):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(st), nbytes)
                _tma_load(w2_desc, [row, 2 * j * BK], ready.index(st), ring.index(2 * st))
                _tma_load(w2_desc, [row, (2 * j + 1) * BK], ready.index(st), ring.index(2 * st + 1))
                it += 1


@gluon.jit
def _stage_rows(smem, src_ptr, num_rows, row_stride, num_warps: gl.constexpr):
    """smem [C, R, BK] = src's first num_rows rows (row_stride elements apart), C chunks of BK columns; rows past
    num_rows zero. Then made visible to the wgmma (async proxy) and the whole partition."""
    C: gl.constexpr = smem.type.shape[0]
    R: gl.constexpr = smem.type.shape[1]
    BK: gl.constexpr = smem.type.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, num_warps], [1, 0])
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, layout)), 1)  # [R, 1]
    c = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, layout)), 0)  # [1, BK]
    for i in gl.static_range(C):
        v = gl.load(src_ptr + r * row_stride + i * BK + c, mask=r < num_rows, other=0.0,
                    cache_modifier=".cg")
        smem.index(i).store(v)
    fence_async_shared()
    _barrier()


@gluon.jit
def _up_tile(x_smem, ring, ready, empty, piece, it, K: gl.constexpr, KS: gl.constexpr, acc_layout: gl.constexpr):
    """Gate-up MMAs of one tile's K piece: (it, gate [BM, XR], up [BM, XR]) in float32."""
    BM: gl.constexpr = ring.type.shape[1]
    BK: gl.constexpr = ring.type.shape[2]
    XR: gl.constexpr = x_smem.type.shape[1]
    STAGES: gl.constexpr = ring.type.shape[0] // 2
    KP: gl.constexpr = K // BK // KS
    g = gl.zeros([BM, XR], gl.float32, acc_layout)
    u = gl.zeros([BM, XR], gl.float32, acc_layout)
    for kk in range(piece * KP, piece * KP + KP):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        xb = x_smem.index(kk).permute((1, 0))  # [BK, XR]
        g = warpgroup_mma(ring.index(2 * st), xb, g, is_async=True)
        u = warpgroup_mma(ring.index(2 * st + 1), xb, u, is_async=True)
        g, u = warpgroup_mma_wait(num_outstanding=2, deps=(g, u))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > piece * KP)  # step before retired
        it += 1
    g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    return it, g, u


@gluon.jit
def _up_epilogue(g, u, h_ptr, part_ptr, piece_ptr, up_done_ptr, s, blk, piece, tok, rows, cols, N: gl.constexpr,
                 KS: gl.constexpr):
    """The slot's token column of gate / up; KS == 1: h[s, rows] = silu(gate) * up, then a release of up_done[s].
    KS > 1: the piece's partial sums to part, an acq_rel arrival; the KS-th sums the pieces in order, writes h,
    zeroes the arrival counter and releases up_done[s]."""
    BM: gl.constexpr = g.type.shape[0]
    g_col = gl.sum(gl.where(cols == tok, g, 0.0), axis=1)  # [BM]
    u_col = gl.sum(gl.where(cols == tok, u, 0.0), axis=1)
    if KS == 1:
        gl.store(h_ptr + s * N + blk * BM + rows, (g_col / (1.0 + gl.exp(-g_col)) * u_col).to(h_ptr.dtype.element_ty))
        _barrier()  # every warp's h stores issued before the release
        gl.atomic_add(up_done_ptr + s, 1, sem="release", scope="gpu")
    else:
        tile = s * (N // BM) + blk
        gl.store(part_ptr + (tile * KS + piece) * 2 * BM + rows, g_col)
        gl.store(part_ptr + (tile * KS + piece) * 2 * BM + BM + rows, u_col)
        _barrier()
        old = gl.atomic_add(piece_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if old == KS - 1:  # the tile's last piece: the pieces' sum in piece order (whoever comes last)
            gs = gl.zeros_like(g_col)
            us = gl.zeros_like(u_col)
            for p in gl.static_range(KS):
                gs += gl.load(part_ptr + (tile * KS + p) * 2 * BM + rows, cache_modifier=".cg")
                us += gl.load(part_ptr + (tile * KS + p) * 2 * BM + BM + rows, cache_modifier=".cg")
            gl.store(h_ptr + s * N + blk * BM + rows, (gs / (1.0 + gl.exp(-gs)) * us).to(h_ptr.dtype.element_ty))
            gl.store(piece_ptr + tile, 0)
            _barrier()
            gl.atomic_add(up_done_ptr + s, 1, sem="release", scope="gpu")


@gluon.jit
def _wait_all(up_done_ptr, S: gl.constexpr, NB: gl.constexpr):
    """Acquire-spin until every slot's NB gate-up tiles are done (bounded by MAX_SPINS reads a slot)."""
    for q in range(S):
        seen = gl.atomic_add(up_done_ptr + q, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < NB) & (spins < MAX_SPINS):
            seen = gl.atomic_add(up_done_ptr + q, 0, sem="acquire", scope="gpu")
            spins += 1


@gluon.jit
def _down_epilogue(acc, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr, num_experts, s, blk, tok, TOP_K: gl.constexpr,
                   K: gl.constexpr):
    """acc [BM, HR] float32, column s slot s's product: y[s, rows] = weight * that column; the token's k-th arrival
    on arrive[tok, blk] sums its k slots in slot order into out and zeroes the counter."""
    BM: gl.constexpr = acc.type.shape[0]
    HR: gl.constexpr = acc.type.shape[1]
    KB: gl.constexpr = K // BM
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))  # [BM]
    cols = gl.expand_dims(gl.arange(0, HR, layout=gl.SliceLayout(0, acc.type.layout)), 0)  # [1, HR]
    wt = gl.where(gl.load(ids_ptr + s) < num_experts, gl.load(wts_ptr + s), 0.0)
    y_col = gl.sum(gl.where(cols == s, acc, 0.0), axis=1) * wt  # [BM] float32
    gl.store(y_ptr + s * K + blk * BM + rows, y_col)
    _barrier()  # every warp's y stores issued before the arrival
    old = gl.atomic_add(arrive_ptr + tok * KB + blk, 1, sem="acq_rel", scope="gpu")
    if old == TOP_K - 1:  # the token's last slot here: the ordered sum
        o = gl.zeros_like(y_col)
        for jj in gl.static_range(TOP_K):
            o += gl.load(y_ptr + (tok * TOP_K + jj) * K + blk * BM + rows, cache_modifier=".cg")
        gl.store(out_ptr + tok * K + blk * BM + rows, o.to(out_ptr.dtype.element_ty))
        gl.store(arrive_ptr + tok * KB + blk, 0)


@gluon.jit
def _down_tile(ring, h_smem, ready, empty, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr, num_experts, s, blk, tok,
               it, TOP_K: gl.constexpr, N: gl.constexpr, K: gl.constexpr, num_warps: gl.constexpr):
    """Down tile (slot s, rows blk*BM.. of K): y[s, rows] = weight * (h[s] @ w2 rows^T), h[s] column s of the
    staged h rows; the token's k-th arrival sums its k slots in slot order into out."""
    BM: gl.constexpr = ring.type.shape[1]
    BK: gl.constexpr = ring.type.shape[2]
    HR: gl.constexpr = h_smem.type.shape[1]
    STAGES: gl.constexpr = ring.type.shape[0] // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HR, 16])
    acc = gl.zeros([BM, HR], gl.float32, acc_layout)
    for j in range(N // (2 * BK)):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        acc = warpgroup_mma(ring.index(2 * st), h_smem.index(2 * j).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(ring.index(2 * st + 1), h_smem.index(2 * j + 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=j > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    _down_epilogue(acc, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr, num_experts, s, blk, tok, TOP_K, K)
    return it


@gluon.jit
def _decode_mma(x_smem, ring, h_smem, ready, empty, x_ptr, ids_ptr, wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr,
                up_done_ptr, piece_ptr, arrive_ptr, exit_ptr, num_experts, S: gl.constexpr, TOP_K: gl.constexpr,
                N: gl.constexpr, K: gl.constexpr, KS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = ring.type.shape[1]
    XR: gl.constexpr = x_smem.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, XR, 16])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))  # [BM]
    cols = gl.expand_dims(gl.arange(0, XR, layout=gl.SliceLayout(0, acc_layout)), 0)  # [1, XR]
    _stage_rows(x_smem, x_ptr, S // TOP_K, K, num_warps)  # x's M rows, zero-padded to XR
    it = 0
    staged = 0
    for t in range(gl.program_id(0), S * (N // BM * KS + K // BM), gl.num_programs(0)):
        up, s, blk, piece = _slot_tile(t, S, N // BM, K // BM, KS)
        if up:
            it, g, u = _up_tile(x_smem, ring, ready, empty, piece, it, K, KS, acc_layout)
            _up_epilogue(g, u, h_ptr, part_ptr, piece_ptr, up_done_ptr, s, blk, piece, s // TOP_K, rows, cols, N, KS)
        else:
            if staged == 0:  # the program's first down tile: every slot's h, once
                _wait_all(up_done_ptr, S, N // BM)
                _stage_rows(h_smem, h_ptr, S, N, num_warps)
                staged = 1
            it = _down_tile(ring, h_smem, ready, empty, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr, num_experts,
                            s, blk, s // TOP_K, it, TOP_K, N, K, num_warps)
    _barrier()
    done = gl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if done == gl.num_programs(0) - 1:  # every program has passed all its waits: reset for the next call
        SP: gl.constexpr = 16 if S <= 16 else 32
        slots = gl.arange(0, SP, layout=gl.SliceLayout(1, acc_layout))
        gl.store(up_done_ptr + slots, gl.zeros([SP], gl.int32, gl.SliceLayout(1, acc_layout)), mask=slots < S)
        gl.store(exit_ptr, 0)


@gluon.jit
def decode_kernel(w13_desc, w2_desc, x_ptr, ids_ptr, wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr, up_done_ptr, piece_ptr,
                  arrive_ptr, exit_ptr, num_experts, S: gl.constexpr, TOP_K: gl.constexpr, N: gl.constexpr,
                  K: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """w13_desc [E*2N, K] and w2_desc [E*K, N] blocks [BM, BK]; x_ptr [M, K] contiguous (M = S / TOP_K <= 8);
    ids_ptr / wts_ptr [S] int32 / float32 (S = M*k <= 16 slots, token-major); h_ptr [S, N] (x's dtype), y_ptr
    [S, K] float32 scratch; out_ptr [M, K]; part_ptr [S, N/BM, KS, 2, BM] float32 scratch (KS > 1: the gate-up
    pieces' partial sums); up_done_ptr [S], piece_ptr [S, N/BM], arrive_ptr [M, K/BM], exit_ptr [1] int32
    counters, zero at entry and exit. KS: gate-up tiles split in KS pieces along K (more, smaller tiles for the
    SMs). N a multiple of 2*BK and of BM, K of BK*KS and BM."""
    BK: gl.constexpr = w13_desc.block_type.shape[1]
    XR: gl.constexpr = 8
    HR: gl.constexpr = 8 if S <= 8 else 16
    dtype: gl.constexpr = w13_desc.dtype
    x_smem = gl.allocate_shared_memory(dtype, [K // BK, XR, BK], gl.NVMMASharedLayout.get_default_for([XR, BK], dtype))
    h_smem = gl.allocate_shared_memory(dtype, [N // BK, HR, BK], gl.NVMMASharedLayout.get_default_for([HR, BK], dtype))
    ring = gl.allocate_shared_memory(dtype, [2 * STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_decode_mma, (x_smem, ring, h_smem, ready, empty, x_ptr, ids_ptr, wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr,
                       up_done_ptr, piece_ptr, arrive_ptr, exit_ptr, num_experts, S, TOP_K, N, K, KS, num_warps)),
        (_decode_loader, (w13_desc, w2_desc, ring, ready, empty, ids_ptr, num_experts, S, N, K, KS)),
    ], [1], [40])
