"""``gluon_gemm_wo``'s weight-only grouped GEMM with the decode in its own partition (the brief's candidate 1): a
producer partition (PRODUCER_WARPS warps) issues the TMA loads STAGES - 1 steps ahead and decodes each step's stored
tiles into one of two bf16 slots; the MMA partition (num_warps warps: its accumulators keep their registers) only
waits for a decoded slot and issues the async wgmma. (CK1: with the decode in the MMA partition the int4 GEMMs ran
1.6-2.3x the bf16 ones: the decode's registers share the 128 accumulator registers a thread.)

Barriers: ready[s] (a stage's TMA bytes landed), empty[s] (the MMAs that read the stage's activation tile retired:
the producer, which read its weight tiles itself, may refill it), decoded[d] (slot d's tiles stored and fenced by
every producer thread), free[d] (the MMAs that read slot d retired). The producer walks the same tiles as the MMA
partition, one flattened step index over (tile, reduction step). Arithmetic, layouts and schemes are
``gluon_gemm_wo``'s (``_decode_step``, ``_group_scales``, ``_scale_rows``, ``_epilogue``).

Triton spelled the partition barrier ``thread_barrier`` (3.6) and ``barrier`` (3.9). Gluon does not run in the
interpreter (CUDA sm_90 only). Torch twin: ``triton_gluon_wo.experts_gluon_wo_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from moekit.experts._kernels.gluon_gemm import _tile_of, _tma_load
from moekit.experts._kernels.gluon_gemm_wo import _decode_step, _epilogue, _group_scales, _scale_rows

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _load_step(a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, g, k_steps, num_row_blocks,
               num_col_blocks, W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
               GROUP_M: gl.constexpr, PACK: gl.constexpr):
    """TMA loads of this program's flattened step g (tile g // k_steps of its walk, reduction step g % k_steps)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    rb, cb = _tile_of(gl.program_id(0) + (g // k_steps) * gl.num_programs(0), num_row_blocks, num_col_blocks, GROUP_M)
    kk = g % k_steps
    w_row = gl.load(experts_ptr + rb) * W_ROWS + cb * BLOCK_N
    s = g % STAGES
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + WTILES * q_desc.block_type.nbytes)
    _tma_load(a_desc, [rb * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
    _tma_load(q_desc, [w_row, kk * (BLOCK_K // PACK)], ready.index(s), q_bufs.index(s * WTILES))
    if GATED:
        _tma_load(q_desc, [w_row + GATE_OFFSET, kk * (BLOCK_K // PACK)], ready.index(s), q_bufs.index(s * WTILES + 1))


@gluon.jit
def _step_scales(s_ptr, z_ptr, experts_ptr, g, k_steps, num_row_blocks, num_col_blocks, stride_se, stride_sr,
                 stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 ROW: gl.constexpr, VEC: gl.constexpr, GATE_OFFSET: gl.constexpr, GROUP_M: gl.constexpr,
                 SCHEME: gl.constexpr, GROUP: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """(mul, add) of the gate rows and of the up rows of flattened step g (``_group_scales``)."""
    rb, cb = _tile_of(gl.program_id(0) + (g // k_steps) * gl.num_programs(0), num_row_blocks, num_col_blocks, GROUP_M)
    sg, zg = _scale_rows(s_ptr, z_ptr, gl.load(experts_ptr + rb), cb, stride_se, stride_sr, stride_sg, stride_ze,
                         stride_zr, BLOCK_N, ROW, VEC, SCHEME, PRODUCER_WARPS)
    k0 = (g % k_steps) * BLOCK_K
    mul_g, add_g = _group_scales(sg, zg, k0, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME)
    mul_u, add_u = _group_scales(sg + GATE_OFFSET * stride_sr, zg + GATE_OFFSET * stride_zr, k0, reduce_dim,
                                 stride_sg, stride_zg, GROUP, SCHEME)
    return mul_g, add_g, mul_u, add_u


@gluon.jit
def _producer(a_desc, q_desc, a_bufs, q_bufs, w_bufs, ready, empty, decoded, free, experts_ptr, used_ptr, s_ptr,
              z_ptr, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
              W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr,
              SCHEME: gl.constexpr, GROUP: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    PACK: gl.constexpr = 1 if SCHEME == 0 else (8 if SCHEME == 1 else 2)
    ROW: gl.constexpr = q_bufs.type.shape[2]
    FULL: gl.constexpr = 128 // q_bufs.dtype.primitive_bitwidth  # ``_decode_tile``'s elements a thread
    SPREAD: gl.constexpr = BLOCK_N * ROW // (32 * PRODUCER_WARPS)
    VEC: gl.constexpr = FULL if FULL < SPREAD else SPREAD
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    total = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0)) * k_steps  # this program's steps
    for g in range(0, gl.minimum(STAGES - 1, total)):
        _load_step(a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, g, k_steps, num_row_blocks,
                   num_col_blocks, W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)
    mul_g, add_g, mul_u, add_u = _step_scales(
        s_ptr, z_ptr, experts_ptr, 0, k_steps, num_row_blocks, num_col_blocks, stride_se, stride_sr, stride_sg,
        stride_ze, stride_zr, stride_zg, reduce_dim, BLOCK_N, BLOCK_K, ROW, VEC, GATE_OFFSET, GROUP_M, SCHEME, GROUP,
        PRODUCER_WARPS)
    for g in range(0, total):
        mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.wait(free.index(g % 2), ((g // 2) & 1) ^ 1)
        _decode_step(q_bufs, w_bufs, g % STAGES, g % 2, mul_g, add_g, mul_u, add_u, GATED, SCHEME, PRODUCER_WARPS)
        _barrier()  # every producer thread's stores fenced before the one arrival
        mbarrier.arrive(decoded.index(g % 2), count=1)
        # then the stage of step g - 1 refilled (its MMAs retire once step g's, just decoded, are issued: loading
        # before this decode would wait on the MMA partition waiting on it)
        if g + STAGES - 1 < total:
            _load_step(a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, g + STAGES - 1, k_steps,
                       num_row_blocks, num_col_blocks, W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)
        mul_g, add_g, mul_u, add_u = _step_scales(  # the next step's, loading while this one's MMAs run
            s_ptr, z_ptr, experts_ptr, gl.minimum(g + 1, total - 1), k_steps, num_row_blocks, num_col_blocks,
            stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, BLOCK_N, BLOCK_K, ROW, VEC,
            GATE_OFFSET, GROUP_M, SCHEME, GROUP, PRODUCER_WARPS)


@gluon.jit
def _mma_partition(c_desc, a_bufs, w_bufs, c_buf, ready, empty, decoded, free, experts_ptr, used_ptr, s_ptr,
                   stride_se, reduce_dim, num_col_blocks, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                   GROUP_M: gl.constexpr, SCHEME: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, a_bufs.type.shape[2])
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for kk in range(k_steps):
            s, d = it % STAGES, it % 2
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            mbarrier.wait(decoded.index(d), (it // 2) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(d * WTILES).permute((1, 0)), acc, is_async=True)
            if GATED:
                up = warpgroup_mma(a_bufs.index(s), w_bufs.index(d * WTILES + 1).permute((1, 0)), up, is_async=True)
                acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's MMAs retired: its stage and its decoded slot may be refilled
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            mbarrier.arrive(free.index((it + 1) % 2), count=1, pred=kk > 0)
            it += 1
        _epilogue(c_desc, c_buf, acc, up, s_ptr + gl.load(experts_ptr + rb) * stride_se, rb, cb, GATE_OFFSET, GATED,
                  SCHEME, layout)
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
        mbarrier.arrive(free.index((it + 1) % 2), count=1, pred=k_steps > 0)
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_wo_ws_kernel(a_desc, q_desc, c_desc, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se, stride_sr,
                              stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                              W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHEME: gl.constexpr, GROUP: gl.constexpr,
                              PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``gluon_gemm_wo.grouped_gemm_wo_kernel``'s arguments and result; the decode in a producer partition."""
    WTILES: gl.constexpr = 2 if GATED else 1
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES * WTILES] + q_desc.block_type.shape, q_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * WTILES, BLOCK_N, BLOCK_K], w_layout)  # decoded, 2 slots
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    decoded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(decoded.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    gl.warp_specialize([
        (_mma_partition, (c_desc, a_bufs, w_bufs, c_buf, ready, empty, decoded, free, experts_ptr, used_ptr, s_ptr,
                          stride_se, reduce_dim, num_col_blocks, GATE_OFFSET, GATED, GROUP_M, SCHEME, num_warps)),
        (_producer, (a_desc, q_desc, a_bufs, q_bufs, w_bufs, ready, empty, decoded, free, experts_ptr, used_ptr,
                     s_ptr, z_ptr, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim,
                     num_col_blocks, W_ROWS, GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
