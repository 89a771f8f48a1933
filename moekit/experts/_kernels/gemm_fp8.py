"""Block-scaled fp8 grouped GEMMs over the block-aligned layout (DeepSeek-V3's recipe): e4m3 weights
with one float32 scale per [GROUP_N, BLOCK_K] block, e4m3 activations with one scale per row per
BLOCK_K columns; each K-step is one scale block, so acc += dot(a_q, w_q) * a_scale[row] * w_scale[col].

Torch twin: ``moekit.experts.triton_fp8.fused_experts_fp8_torch``.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts, K hidden, N
intermediate; BM/BN/BK the tile, BK = the scale blocks' reduction width (128 by default), GROUP_N their
output height; KB = ceil(K / BK), NB = ceil(N / BK). Scales: w13 [E, ceil(2N/GROUP_N), KB], w2
[E, ceil(K/GROUP_N), NB], activations [rows, KB or NB]. The row walk (grouped ordering, the
block-aligned rows, the tiny-batch NAIVE shortcut) is the bf16 kernels' (``gemm``).

gate-up: x_q rows gathered by token (X_RAW: x itself, each [BM, BK] step quantized as it is loaded,
the twin of ``quant_fp8``'s kernel: a launch fewer, but slower on the GPU, every program quantizing each
tile it reads; the plan takes it in eager calls where a tuned entry asks), gate columns c and up columns N + c of one
expert in one program (each with its own weight scale, gathered per column: a block may straddle the gate/up boundary
when N is not a multiple of GROUP_N), SiLU-and-mul in the epilogue. Where BN is a multiple of BK every group
of h's columns lies in one program, and the epilogue re-quantizes h per BK columns (h_q e4m3 + h_s).
Narrower tiles (H_FP32: BN < BK, for more programs at decode sizes) write h in float32 instead, and
the down GEMM quantizes each [BM, BK] step of it as it loads it (the same groups, the same rounding;
each down program redoes it, which costs little only where M is small).
down: the reduction runs over N in steps of BK, one h scale and one w2 scale per step; the routed
weight is applied in the epilogue; y is summed over the k slots by ``combine``: a launch of its own, or
(KSUM, M <= ``LaunchOptions.sum_fold_max``, eager calls with the pool's kept counters) in the down GEMM's
epilogue, exactly as ``gemm.down_kernel``'s KSUM (its docstring): the same ``combine`` helpers, bit for
bit the ordered separate k-sum; or (SUM_AFTER, up to ``LaunchOptions.sum_tail_max``) in sum programs after the
GEMM's, ``gemm.down_kernel``'s SUM_AFTER.

FOLD (gate-up only, A <= ``LaunchOptions.align_fold_max``): the bf16 gate-up's folded alignment
(``gemm._gate_up_rows``): no alignment launch; each program derives its block from the ids, and the
programs of N tile 0 write the layout the down GEMM reads.

W_DESC: the weights come as TMA tensor descriptors (``gemm``'s W_DESC: e4m3 [BN, BK] tiles, one bulk copy
each, no address arithmetic in the loop); the host picks them where the strides allow (``triton_fp8_plan``).
A last gate tile past N reads up rows (and the last up tile the next expert's): those columns get weight
scale 0 (only a tile with a scale per column can pass N, see ONE_BLOCK), so h is 0 there, as with the
masked pointer loads, and no group's amax sees them; they are never stored.

ONE_BLOCK: every output column of a program lies in one weight scale block (GROUP_N a multiple of
BLOCK_N, and in gate-up N a multiple of BLOCK_N, so the up tile N + c.. does not straddle either): the
weight scale of a K-step is one scalar, and the step's partial product is folded in by one FMA per
element, acc += dot * (x_s * w_s)[:, None], instead of a [BM, BN] outer product of the two scales and a
multiply-add (the fold is not overlapped with the tensor cores: the dot's result is used at once).

AHEAD (X_RAW in gate-up, H_FP32 in down): the activation tile quantized in the loop is loaded one K-step
ahead, by hand, into registers. H200, Triton 3.6, CUDA-graph µs with it / without (Qwen3-30B-A3B, h float32:
the down GEMM's h): M = 8 80.4 / 87.1, M = 1 20.7 / 21.3; x in gate-up at M = 1 24.4 / 25.8 (run 1), within
the noise elsewhere (benchmarks/results/raw/*-fp8_small.*). (Triton 3.9's pipeliner streams such a tile through
SMEM with cp.async by itself, per its PTX for sm_90; AHEAD then replaces that by the one-step register load.)

SWAP_AB (``KernelConfig.swap_ab``, decode tiles): each step computes the transposed product, w_tile [BN, BK] @
a_tile^T [BK, BM], into a [BN, BM] accumulator (transposed back for the epilogue): the weight tile is the MMA's M
side. With 16-row tiles Triton cannot use Hopper's wgmma (its M is at least 64) and falls back to mma.sync, which has
no e4m3 form: each step converts the [BK, BN] e4m3 weight tile to f16 on the CUDA cores (sm_90 TTGIR of Triton 3.6
and 3.9: ``tt.fp_to_fp`` of the dot operand, then ``tt.dot`` on f16). Swapped, the TMA tile in shared memory feeds an
e4m3 ``warp_group_dot`` as it is (a weight tile of >= 64 rows; narrower ones stay on mma.sync and lose). The same
exact e4m3 products, summed in another order: within the twin's tolerance, not bit-equal to the unswapped kernel.
H200 graph µs, unswapped / swapped: Qwen3-30B-A3B M = 1 21.8 / 19.9, M = 2 29.9 / 28.3, DeepSeek-V3 M = 1 95.7 / 93.2;
Qwen3 M = 8 (32-wide gate-up tile) 76.1 / 84.1 (raw/*-62cabd5-decode_q3.*).

PAIR_DOT (gate-up, W_DESC and ONE_BLOCK): w_ptr is a descriptor over w13 as [E, N/C, 2, C, K]
(C = PAIR_CHUNK columns: chunk j of expert e's gate rows, then the same chunk of its up rows; ``triton_cache.
pair_descriptor``) with [1, BN/C, 2, C, BK] blocks: each K-step loads the gate and up tiles as one [2BN, BK] tile
(gate and up interleaved by chunks of C rows) and runs one [BM, BK] @ [BK, 2BN] dot instead of two: on Hopper one
wgmma of N = 2BN waited for once a step instead of two each waited for (sm_90 TTGIR of Triton 3.6 and 3.9: one
64 x 256 ``warp_group_dot`` a step, the tile reshaped in shared memory, no spills). The product is folded by one
[BM, 2BN] scale (x_s times the gate or up block's scalar). C = 64: on 8 warps each warpgroup's 128 columns hold
the gate and up of the same 64 columns, so the epilogue's split stays in registers (with gate and up as two
halves it went through shared memory). With SWAP_AB the [2BN, BK] tile is the MMA's M side (acc [2BN, BM]; at a
64-wide tile one 128 x 16 wgmma a step instead of two 64 x 16 ones). The same products and the same fold, element by
element.

Biases and the activation variant (issue #15; ``gemm_wo``'s helpers): b13_ptr [E, 2N] / b2_ptr [E, K] contiguous or None
(without them and with ACT None, the defaults, the kernels are the ones before: sm_90 SASS identical,
``benchmarks/wo_sass_diff_cpu.py``; a helper around the plain SiLU-and-mul moved ptxas' schedule on Triton 3.6). b13
joins the float32 accumulators after the block scales, before the activation (``gemm._gate_up_epilogue``; columns past N
stay act(0) * (0 + UP_SHIFT) = 0, out of every amax); b2 the down accumulator before the routed weight
(``gemm_wo.add_b2``; no split-K here: once). ACT: any gated activation (``gemm._glu``). INTERLEAVED: gate j is w13 (and
b13) row 2j, up j row 2j + 1 (gpt-oss's order, read in place): pointer loads, a scale a column, or (W_DESC, session 41)
two TMA row tiles a K-step, a scale each (``gemm_fp8_interleaved``'s docstring); no PAIR_DOT, no persistent GEMMs.

UPCAST (the interpreter only, which has no fp8 ``tl.dot``): operands converted to float32 first.
EMULATE: see ``quant_fp8`` (the interpreter's e4m3 rounding); h_q is then float32 holding e4m3 values.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import gemm_done, programs_after_gemm, routed_slot_count
from moekit.experts._kernels.down_store import store_routed
from moekit.experts._kernels.gemm import _gate_up_rows, _grid_position, program_tile
from moekit.experts._kernels.gemm_fp8_interleaved import row_scale_ptrs, variant_h
from moekit.experts._kernels.gemm_wo import add_b2
from moekit.experts._kernels.quant_fp8 import group_scale, to_e4m3


@triton.jit
def acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A float32 accumulator: [BM, BN], or [BN, BM] with SWAP_AB (one return: Triton compares every return's type)."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def unswap(acc, SWAP_AB: tl.constexpr):
    """An accumulator as [BM, BN]."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _scaled_dot(a, b, UPCAST: tl.constexpr):
    """a [BM, BK] @ b [BK, BN] in float32: fp8 tensor cores on the GPU, exact float32 in the interpreter."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _step(acc, a, b, scale, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + (a [BM, BK] @ b [BK, BN]) * scale ([BM, 1] or [BM, BN]); SWAP_AB: acc and the result transposed,
    b^T a^T (see SWAP_AB)."""
    if SWAP_AB:
        acc = acc + _scaled_dot(tl.trans(b), tl.trans(a), UPCAST) * tl.trans(scale)
    else:
        acc = acc + _scaled_dot(a, b, UPCAST) * scale
    return acc


@triton.jit
def _weight_scale_ptrs(ws_ptr, first_col, stride_wsn, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
                       ONE_BLOCK: tl.constexpr):
    """K-step 0's weight scale pointers of output columns first_col ..: one scalar pointer (ONE_BLOCK),
    else [BN], each column's row block's; ws_ptr points at the expert's scales."""
    if ONE_BLOCK:
        ptrs = ws_ptr + (first_col // GROUP_N) * stride_wsn
    else:
        ptrs = ws_ptr + ((first_col + tl.arange(0, BLOCK_N)) // GROUP_N) * stride_wsn
    return ptrs


@triton.jit
def _step_scale(xs, s_ptrs, col_ok, ONE_BLOCK: tl.constexpr):
    """The factor of one K-step's partial product: [BM, 1] x_s * w_s (ONE_BLOCK), else [BM, BN] x_s (rows)
    * w_s (columns; 0 past the last column)."""
    if ONE_BLOCK:
        scale = (xs * tl.load(s_ptrs))[:, None]
    else:
        scale = xs[:, None] * tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
    return scale


@triton.jit
def _pair_step(acc, xa, w_desc, expert, pid_n, k0, xs, sg_ptr, su_ptr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr):
    """PAIR_DOT: acc [BM, 2BN] (chunks of CHUNK gate columns and CHUNK up columns in turn) + xa [BM, BK] @ tile pid_n's
    gate and up rows of K-step k0 as one [BK, 2BN] operand, times x_s [BM] and the step's two weight scales (scalar
    pointers sg_ptr, su_ptr); SWAP_AB: acc and the product transposed, [2BN, BM]."""
    w = w_desc.load([expert, pid_n * (BLOCK_N // CHUNK), 0, 0, k0])  # [1, BN/C, 2, C, BK]; past K: zeros
    w = w.reshape(2 * BLOCK_N, BLOCK_K)  # [2BN, BK]
    is_gate = (tl.arange(0, 2 * BLOCK_N) // CHUNK) % 2 == 0
    w_scale = tl.where(is_gate, tl.load(sg_ptr), tl.load(su_ptr))  # [2BN]
    if SWAP_AB:
        acc = acc + _scaled_dot(w, tl.trans(xa), UPCAST) * (w_scale[:, None] * xs[None, :])
    else:
        acc = acc + _scaled_dot(xa, w.T, UPCAST) * (xs[:, None] * w_scale[None, :])
    return acc


@triton.jit
def _pair_split(acc_gate, acc_up, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                PAIR_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """(gate [BM, BN], up [BM, BN]; SWAP_AB: [BN, BM] each): PAIR_DOT's acc_gate [BM, 2BN] (SWAP_AB: [2BN, BM]) split
    (acc_up unused), else as they are."""
    if PAIR_DOT and SWAP_AB:
        chunks = tl.permute(tl.reshape(acc_gate, [BLOCK_N // CHUNK, 2, CHUNK, BLOCK_M]), [0, 2, 3, 1])
        acc_gate, acc_up = tl.split(chunks)  # [BN/C, C, BM] each
        acc_gate, acc_up = tl.reshape(acc_gate, [BLOCK_N, BLOCK_M]), tl.reshape(acc_up, [BLOCK_N, BLOCK_M])
    elif PAIR_DOT:
        chunks = tl.permute(tl.reshape(acc_gate, [BLOCK_M, BLOCK_N // CHUNK, 2, CHUNK]), [0, 1, 3, 2])
        acc_gate, acc_up = tl.split(chunks)  # [BM, BN/C, C] each
        acc_gate, acc_up = tl.reshape(acc_gate, [BLOCK_M, BLOCK_N]), tl.reshape(acc_up, [BLOCK_M, BLOCK_N])
    return acc_gate, acc_up


@triton.jit
def _x_step(xa, xs_ptrs, row_ok, X_RAW: tl.constexpr, EMULATE: tl.constexpr):
    """(x_q [BM, BK], x_s [BM]) of one K-step: loaded (xa is x_q), or (X_RAW: xa is x) quantized here,
    this step being one group of x's columns (the twin of ``quant_fp8``'s kernel)."""
    if X_RAW:
        xs = group_scale(tl.max(tl.abs(xa.to(tl.float32)), axis=1))
        xa = to_e4m3(xa.to(tl.float32) / xs[:, None], EMULATE)
    else:
        xs = tl.load(xs_ptrs, mask=row_ok, other=0.0)
    return xa, xs


@triton.jit
def _first_ahead(ptrs, row_ok, offs, left, QUANT_HERE: tl.constexpr, AHEAD: tl.constexpr):
    """Step 0's activation tile [BM, BK] (columns offs < left) where the loop quantizes it and loads it a step
    ahead (AHEAD), else a placeholder the loop carries unread."""
    first = 0.0
    if QUANT_HERE and AHEAD:
        first = tl.load(ptrs, mask=row_ok[:, None] & (offs < left)[None, :], other=0.0)
    return first


@triton.jit
def _act_tile(ptrs, ahead, row_ok, offs, left, step, BLOCK_K: tl.constexpr, QUANT_HERE: tl.constexpr,
              AHEAD: tl.constexpr):
    """(this K-step's activation tile [BM, BK] at ptrs, columns offs < left; what the next step gets as
    ``ahead``): the tile loaded a step before and the next one (``step`` further) loaded now where the loop
    quantizes it (AHEAD), else loaded now (``ahead`` passed on unread)."""
    if QUANT_HERE and AHEAD:
        tile = ahead
        ahead = tl.load(ptrs + step, mask=row_ok[:, None] & (offs < left - BLOCK_K)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_ok[:, None] & (offs < left)[None, :], other=0.0)
    return tile, ahead


@triton.jit
def _w13_ptrs(w_ptr, offs_n, offs_k, N, stride_wn, stride_wk, INTERLEAVED: tl.constexpr):
    """The gate and up tiles' pointers [BK, BN] of K-step 0 of columns offs_n, w_ptr at the expert's w13: gate column
    j at row j and up at N + j, or (INTERLEAVED, gpt-oss's order) at 2j and 2j + 1."""
    if INTERLEAVED:
        wg_ptrs = w_ptr + (2 * offs_n[None, :].to(tl.int64)) * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = wg_ptrs + stride_wn
    else:
        wg_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = wg_ptrs + N * stride_wn  # the up rows follow the N gate rows
    return wg_ptrs, wu_ptrs


@triton.jit
def _with_b2(acc, b2_ptr, expert, offs_out, out_ok, K):
    """acc [BM, BN] + the expert's b2 at columns offs_out (b2_ptr None: acc), before the routed weight: ``gemm_wo.
    add_b2`` (the fp8 grid has no split: program_id(1) is 0)."""
    if b2_ptr is not None:
        acc = add_b2(acc, b2_ptr, expert, offs_out, out_ok, K)
    return acc


@triton.jit
def gate_up_fp8_kernel(
    # x_q (X_RAW: x), x_s, w13 (W_DESC: its descriptor) + scale, h_q, h_s out; map: FOLD only; b13 [E, 2N] or None
    xq_ptr, xs_ptr, w_ptr, ws_ptr, hq_ptr, hs_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, map_ptr,
    b13_ptr, N, K, num_assignments, top_k, num_experts, num_pid_m, stride_xm, stride_xk, stride_xsm, stride_we,
    stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hsm, num_global, GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NAIVE: tl.constexpr,
    UPCAST: tl.constexpr, EMULATE: tl.constexpr, H_FP32: tl.constexpr, X_RAW: tl.constexpr, W_DESC: tl.constexpr,
    ONE_BLOCK: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr = True, SWAP_AB: tl.constexpr = False,
    FOLD: tl.constexpr = False, A_PAD: tl.constexpr = 1, E_PAD: tl.constexpr = 1, FOLD_CHUNK: tl.constexpr = 1,
    HAS_MAP: tl.constexpr = False, PAIR_DOT: tl.constexpr = False, PAIR_CHUNK: tl.constexpr = 64,
    ACT: tl.constexpr = None, INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _gate_up_rows(pid_m, pid_n, ids_ptr, map_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                 num_assignments, num_experts, num_global, BLOCK_M, NAIVE, FOLD, A_PAD, E_PAD,
                                 FOLD_CHUNK, HAS_MAP)
    if expert < 0:
        return  # past the rows in use, or (naive) an assignment not routed here: nothing reads its h row
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)  # [BM] int64: the gather, x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok, offs_k = offs_n < N, tl.arange(0, BLOCK_K)
    x_ptrs, xs_ptrs = xq_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk, xs_ptr + token * stride_xsm
    if W_DESC:  # over w13 as [E*2N, K], blocks [BN, BK] (PAIR_DOT: ``pair_descriptor``'s; INTERLEAVED: 2BN rows a tile)
        gate_row = (expert * 2 * N + pid_n * (BLOCK_N * (1 + INTERLEAVED))).to(tl.int32)
    else:  # [BK, BN] each
        wg_ptrs, wu_ptrs = _w13_ptrs(w_ptr + expert * stride_we, offs_n, offs_k, N, stride_wn, stride_wk, INTERLEAVED)
    ws_ptr += expert * stride_wse  # the gate and up columns' scales (INTERLEAVED with W_DESC: the two row tiles')
    sg_ptrs, su_ptrs = row_scale_ptrs(ws_ptr, pid_n, N, stride_wsn, BLOCK_N, GROUP_N, W_DESC) if INTERLEAVED else (
        _weight_scale_ptrs(ws_ptr, pid_n * BLOCK_N, stride_wsn, BLOCK_N, GROUP_N, ONE_BLOCK),
        _weight_scale_ptrs(ws_ptr, N + pid_n * BLOCK_N, stride_wsn, BLOCK_N, GROUP_N, ONE_BLOCK))
    acc_gate, acc_up = acc_zeros(BLOCK_M, BLOCK_N * (1 + PAIR_DOT), SWAP_AB), acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    x_next = _first_ahead(x_ptrs, row_ok, offs_k, K, X_RAW, AHEAD)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xa, x_next = _act_tile(x_ptrs, x_next, row_ok, offs_k, K - k0, BLOCK_K * stride_xk, BLOCK_K, X_RAW, AHEAD)
        if PAIR_DOT:
            xa, xs = _x_step(xa, xs_ptrs, row_ok, X_RAW, EMULATE)
            acc_gate = _pair_step(acc_gate, xa, w_ptr, expert.to(tl.int32), pid_n, k0, xs, sg_ptrs, su_ptrs, BLOCK_N,
                                  BLOCK_K, PAIR_CHUNK, UPCAST, SWAP_AB)
        else:
            if W_DESC:  # [BK, BN] each, zeros past K (INTERLEAVED: the two row tiles, ``gemm_fp8_interleaved``)
                wg, wu = w_ptr.load([gate_row, k0]).T, w_ptr.load([gate_row + (BLOCK_N if INTERLEAVED else N), k0]).T
            else:
                wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wg_ptrs, wu_ptrs = wg_ptrs + BLOCK_K * stride_wk, wu_ptrs + BLOCK_K * stride_wk
            xa, xs = _x_step(xa, xs_ptrs, row_ok, X_RAW, EMULATE)
            acc_gate = _step(acc_gate, xa, wg, _step_scale(xs, sg_ptrs, n_ok, ONE_BLOCK), UPCAST, SWAP_AB)
            acc_up = _step(acc_up, xa, wu, _step_scale(xs, su_ptrs, n_ok, ONE_BLOCK), UPCAST, SWAP_AB)
        x_ptrs, xs_ptrs = x_ptrs + BLOCK_K * stride_xk, xs_ptrs + 1
        sg_ptrs, su_ptrs = sg_ptrs + stride_wsk, su_ptrs + stride_wsk
    let_next_kernel_launch(PDL)  # after the main loop (``gemm``'s PDL note)
    acc_gate, acc_up = _pair_split(acc_gate, acc_up, BLOCK_M, BLOCK_N, PAIR_CHUNK, PAIR_DOT, SWAP_AB)
    h = unswap(acc_gate * tl.sigmoid(acc_gate) * acc_up, SWAP_AB) if ACT is None else variant_h(
        unswap(acc_gate, SWAP_AB), unswap(acc_up, SWAP_AB), b13_ptr, expert, offs_n, n_ok, N, BLOCK_M, BLOCK_N, ACT,
        INTERLEAVED, W_DESC, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)  # [BM, BN] fp32 (ACT None: SiLU-and-mul, no b13)
    _store_h(h, hq_ptr, hs_ptr, rows, row_ok, pid_n, N, stride_hm, stride_hsm, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE,
             H_FP32)


@triton.jit
def _store_h(h, hq_ptr, hs_ptr, rows, row_ok, pid_n, N, stride_hm, stride_hsm, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, H_FP32: tl.constexpr):
    """h [BM, BN] (columns pid_n*BN ..) -> e4m3 per BK columns: h_q rows and their BN/BK scales; H_FP32:
    h itself into the float32 h_q (the down GEMM quantizes it)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs, h_mask = hq_ptr + rows[:, None] * stride_hm + offs_n[None, :], row_ok[:, None] & (offs_n < N)[None, :]
    if H_FP32:
        tl.store(h_ptrs, h, mask=h_mask)
    else:
        GROUPS: tl.constexpr = BLOCK_N // BLOCK_K
        h3 = tl.reshape(h, [BLOCK_M, GROUPS, BLOCK_K])
        s = group_scale(tl.max(tl.abs(h3), axis=2))  # [BM, G]
        tl.store(h_ptrs, tl.reshape(to_e4m3(h3 / s[:, :, None], EMULATE), [BLOCK_M, BLOCK_N]), mask=h_mask)
        offs_g = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(hs_ptr + rows[:, None] * stride_hsm + offs_g[None, :], s,
                 mask=row_ok[:, None] & (offs_g < tl.cdiv(N, BLOCK_K))[None, :])


@triton.jit
def down_fp8_kernel(
    # h_q [A, N] (H_FP32: h), h_s [A, NB], w2 [E, K, N] (W_DESC: its descriptor) + scale, y [A, K]
    hq_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    b2_ptr,  # b2 [E, K] contiguous, or None
    K, N, num_assignments, num_experts, num_pid_m,
    stride_hm, stride_hsm, stride_we, stride_wk, stride_wn, stride_wse, stride_wsk, stride_wsn, stride_ym,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr, H_FP32: tl.constexpr, W_DESC: tl.constexpr,
    ONE_BLOCK: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr = True, SWAP_AB: tl.constexpr = False,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    SUM_AFTER: tl.constexpr = False, SUM_T: tl.constexpr = 1, SUM_K: tl.constexpr = 1):  # ``gemm.down_kernel``'s
    wait_for_previous_kernel(PDL)
    if KSUM or SUM_AFTER:
        if tl.program_id(0) >= num_pid_m * tl.cdiv(K, BLOCK_N):  # the programs after the GEMM's (module docstring)
            programs_after_gemm(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, num_pid_m * tl.cdiv(K, BLOCK_N), K,
                                num_assignments, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD,
                                HAS_MAP, ZERO_T, SUM_AFTER, SUM_T, SUM_K, PDL)
            return
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(K, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        gemm_done(counters_ptr, SUM_AFTER)
        return
    row_ok, safe_rows = rows < num_assignments, tl.where(rows < num_assignments, rows, 0)
    arrivals = 0  # without KSUM: never read (``store_routed``)
    if KSUM:  # [BM] routed slots of each row's token, loaded before the main loop (the epilogue needs them)
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD,
                                     HAS_MAP)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    offs_red = tl.arange(0, BLOCK_K)
    h_ptrs = hq_ptr + safe_rows[:, None] * stride_hm + offs_red[None, :]  # [BM, BK]
    hs_ptrs = hs_ptr + safe_rows * stride_hsm  # [BM] scale of step 0
    if W_DESC:  # a descriptor over w2 as [E*K, N], blocks [BN, BK]
        w_row = (expert * K + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_out[None, :].to(tl.int64) * stride_wk + offs_red[:, None] * stride_wn
    s_ptrs = _weight_scale_ptrs(ws_ptr + expert * stride_wse, pid_n * BLOCK_N, stride_wsk, BLOCK_N, GROUP_N, ONE_BLOCK)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    h_next = _first_ahead(h_ptrs, row_ok, offs_red, N, H_FP32, AHEAD)
    for n0 in range(0, N, BLOCK_K):
        red_ok = offs_red < N - n0
        ha, h_next = _act_tile(h_ptrs, h_next, row_ok, offs_red, N - n0, BLOCK_K, BLOCK_K, H_FP32, AHEAD)
        if W_DESC:  # rows past K are never stored, columns past N read 0
            wb = w_ptr.load([w_row, n0]).T  # [BK, BN]
        else:
            wb = tl.load(w_ptrs, mask=red_ok[:, None] & out_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wn
        ha, hs = _x_step(ha, hs_ptrs, row_ok, H_FP32, EMULATE)  # H_FP32: h float32, quantized here as x is there
        acc = _step(acc, ha, wb, _step_scale(hs, s_ptrs, out_ok, ONE_BLOCK), UPCAST, SWAP_AB)
        h_ptrs, hs_ptrs, s_ptrs = h_ptrs + BLOCK_K, hs_ptrs + 1, s_ptrs + stride_wsn
    let_next_kernel_launch(PDL)
    store_routed(_with_b2(unswap(acc, SWAP_AB), b2_ptr, expert, offs_out, out_ok, K), weights_ptr, y_ptr, out_ptr,
                 counters_ptr, ids_ptr, map_ptr, safe_rows, 0, row_ok, arrivals, pid_n, offs_out, out_ok, K, top_k,
                 num_experts, num_global, stride_ym, BLOCK_N, KSUM, TOPK_PAD, HAS_MAP, SUM_ROWS)
    gemm_done(counters_ptr, SUM_AFTER)
