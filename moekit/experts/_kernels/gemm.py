"""Grouped GEMMs over the block-aligned layout, gathering activation rows by index (never permuted).

Torch twins: ``moekit.experts.reference`` (per-expert loop) and ``moekit.experts.grouped_mm``.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts, K hidden, N
intermediate; BM/BN/BK the tile. Program (pid_m, pid_n) owns M-block pid_m of the layout (one expert,
up to BM assignment rows) and output columns pid_n*BN ..; every row index is int64 before it is
multiplied by a stride (A*K and E*2N*K pass 2^31 at real sizes).

PDL: programmatic dependent launch (``_common``), set by the host on Hopper. A GEMM lets the next kernel
launch only after its main loop: signalling right after the wait let the next grid's programs take SM
slots while this one still streamed (Mixtral-8x7B M=1 on the H200: 175 -> 189 µs; 173 µs signalling late).

W_DESC: the weights come as TMA tensor descriptors (Hopper's bulk tile copies) instead of pointer
tiles; the host picks it for 16-bit weights when the strides allow (``triton.py``). Activation rows
are gathered by index either way.

NAIVE (the tiny-batch shortcut, A*4 <= E, no expert map): block pid_m is assignment pid_m alone, its
expert read straight from topk_ids, so no alignment runs at all (the host passes None for
sorted_ids, expert_ids and num_padded; the NAIVE branch never touches them).

FOLD (the folded alignment, A <= ``LaunchOptions.align_fold_max``, gate-up only): no alignment launch
runs; each gate-up program derives its block from all A ids itself (``align.fold_block_rows``), and the
programs with pid_n == 0 write that block's sorted_ids rows and expert_ids entry (program (0, 0) also
num_padded): every element written by exactly one program. The down GEMM reads them as usual: its
``wait_for_previous_kernel`` returns only once every gate-up program has finished (PDL included).

KSUM (the k-sum folded into the down GEMM, M <= ``LaunchOptions.sum_fold_max``, eager calls whose workspace
keeps the counters): the down programs count arrivals per (token, K tile) after storing y, and the last of
a token's routed slots sums them (``combine.ksum_epilogue``, bit for bit the separate ``combine.sum_slots_kernel``
with ORDERED); ZERO_T-token programs after the GEMM's write 0 for tokens no slot routes here. The GEMM's
programs, tiles and schedule are the same with and without it.

SUM_AFTER (the k-sum in the down GEMM's grid, sum_fold_max < M <= ``LaunchOptions.sum_tail_max``, the same eager
calls): programs appended after the GEMM's wait until every GEMM program has stored its y tile (one arrival each
on the kept counters[0]), then each writes a [SUM_T, SUM_K] tile of out as the separate ordered k-sum does
(``combine.sum_after_gemm``: bit for bit its out). The GEMM's programs, tiles and schedule are the same with and
without it; each only signals at its end.

The experts variant (``moekit.activations.ActivationSpec``) is constexprs of the gate-up kernel, so
each variant compiles its own epilogue and the plain silu kernel is what it was: ACT (the activation's
kernel id), GATED (False: w13 is [E, N, K], an up projection and act alone), INTERLEAVED (gate row 2j,
up row 2j + 1: gpt-oss), ALPHA (silu's sigmoid scale), LIMIT (gate <= LIMIT, |up| <= LIMIT; None: no
clamp), LIMIT_AFTER (act(gate) <= LIMIT instead of gate: Step-3.7, Bailing-Hybrid), UP_SHIFT (act(gate) *
(up + UP_SHIFT)). Biases are pointers, None without one: b13 [E, 2N or N] is added in the gate-up epilogue
(one [BN] row per tile), b2 [E, K] in the down epilogue before the routed weight multiplies. Weights are read
through their strides (transposed storage is a view).

PRECISION: "ieee" for float32 inputs (the fp32 contract is 1e-5; tf32 lands near 3e-4), "tf32"
otherwise (ignored for 16-bit operands).

UPCAST: operands are converted to float32 before ``tl.dot``. Only the CPU interpreter needs it: its
bf16 ``tl.dot`` returns garbage (seen with Triton 3.9: max error 2.7e10 on a 16x16 product).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.align import fold_block_rows
from moekit.experts._kernels.combine import gemm_done, programs_after_gemm, routed_slot_count
from moekit.experts._kernels.down_store import store_routed


@triton.jit
def _grid_position(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M M-blocks (usually one expert's) sweep the N tiles together, so an
    expert's weight tile is read from HBM once and from L2 by the other blocks."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                num_assignments, num_experts, BLOCK_M: tl.constexpr, NAIVE: tl.constexpr):
    """(assignment of each row of M-block pid_m [BM] int64, with A on padding rows; its expert, -1 = none)."""
    lanes = tl.arange(0, BLOCK_M)
    if NAIVE:
        eid = tl.load(ids_ptr + pid_m).to(tl.int64)
        expert = tl.where((eid >= 0) & (eid < num_experts), eid, -1)
        rows = tl.where(lanes == 0, pid_m, num_assignments).to(tl.int64)
    else:
        in_use = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        expert = tl.where(in_use, tl.load(expert_ids_ptr + pid_m).to(tl.int64), -1)
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + lanes).to(tl.int64)  # the buffer holds whole blocks
    return rows, expert


@triton.jit
def program_tile(num_pid_m, num_pid_n, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments,
                 num_experts, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, NAIVE: tl.constexpr):
    """(pid_n, rows, expert) of this program: its N tile (``_grid_position``), the assignment of each row of its M
    block [BM] and their expert, -1 = none (``_block_rows``)."""
    pid_m, pid_n = _grid_position(num_pid_m, num_pid_n, GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments,
                               num_experts, BLOCK_M, NAIVE)
    return pid_n, rows, expert


@triton.jit
def _gate_up_rows(pid_m, pid_n, ids_ptr, map_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                  num_assignments, num_experts, num_global, BLOCK_M: tl.constexpr, NAIVE: tl.constexpr,
                  FOLD: tl.constexpr, A_PAD: tl.constexpr, E_PAD: tl.constexpr, FOLD_CHUNK: tl.constexpr,
                  HAS_MAP: tl.constexpr):
    """``_block_rows`` of a gate-up program; with FOLD its block from the ids, and the programs of N tile 0
    write it for the down GEMM (module docstring)."""
    if FOLD:
        rows, expert, num_padded = fold_block_rows(pid_m, ids_ptr, map_ptr, num_assignments, num_experts,
                                                   num_global, BLOCK_M, A_PAD, E_PAD, FOLD_CHUNK, HAS_MAP)
        if pid_n == 0:
            tl.store(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M), rows)
            tl.store(expert_ids_ptr + pid_m, expert)
            if pid_m == 0:
                tl.store(num_padded_ptr, num_padded)
        rows, expert = rows.to(tl.int64), expert.to(tl.int64)
    else:
        rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments,
                                   num_experts, BLOCK_M, NAIVE)
    return rows, expert  # one return: Triton 3.6 compares the types of every return statement


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b; UPCAST: the operands in float32 first (the interpreter, see above)."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _activation(g, ACT: tl.constexpr, ALPHA: tl.constexpr):
    """ACT is ``moekit.activations.ACTIVATIONS[name].kernel_id``; the torch twin is its ``fn``. ALPHA
    scales the sigmoid's argument of silu (gpt-oss: g * sigmoid(1.702 g)); other activations ignore it."""
    if ACT == 0:  # silu
        if ALPHA == 1.0:
            return g * tl.sigmoid(g)
        else:
            return g * tl.sigmoid(ALPHA * g)
    elif ACT == 1:  # gelu (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation; tanh(u) = 2*sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g * tl.sigmoid(2.0 * u)
    elif ACT == 3:  # relu
        return tl.maximum(g, 0.0)
    else:  # relu2: relu squared
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _glu(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_SHIFT: tl.constexpr,
         LIMIT_AFTER: tl.constexpr = False):
    """act(gate) * (up + UP_SHIFT), gate clamped to <= LIMIT and up to [-LIMIT, LIMIT] first unless
    LIMIT is None (gpt-oss: ALPHA 1.702, LIMIT 7, UP_SHIFT 1); LIMIT_AFTER: min(act(gate), LIMIT) instead of
    act(min(gate, LIMIT)) (Step-3.7, Bailing-Hybrid). Twin: ``moekit.activations``' spec."""
    if LIMIT is not None:
        if not LIMIT_AFTER:
            gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if UP_SHIFT != 0.0:
        up = up + UP_SHIFT
    act = _activation(gate, ACT, ALPHA)
    if LIMIT_AFTER:
        act = tl.minimum(act, LIMIT)
    return act * up


@triton.jit
def _gate_up_epilogue(acc_gate, acc_up, b13_ptr, expert, offs_n, n_ok, N, stride_be, stride_bn,
                      ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                      ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_SHIFT: tl.constexpr,
                      LIMIT_AFTER: tl.constexpr = False):
    """[BM, BN] fp32 h tile from the accumulators: + b13 (one [BN] row per tile), then glu (gated) or
    act (ungated: acc_up is unused)."""
    if b13_ptr is not None:
        b_rows = offs_n.to(tl.int64) * (2 if INTERLEAVED else 1)  # [BN] the gate (or up-only) rows
        b_ptrs = b13_ptr + expert * stride_be + b_rows * stride_bn
        acc_gate += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up_rows = 1 if INTERLEAVED else N  # up of column j: row 2j + 1, or row N + j
            acc_up += tl.load(b_ptrs + up_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        return _glu(acc_gate, acc_up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
    else:
        return _activation(acc_gate, ACT, ALPHA)


@triton.jit
def _w13_rows(pid_n, offs_n, n_ok, N, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr, PAIRS: tl.constexpr):
    """The w13 rows a gate-up program's pointer loads read, and their mask: with PAIRS [1, 2BN] consecutive
    rows (gate, up, gate, up...: one contiguous load), else [1, BN] gate (or up-only) rows."""
    if PAIRS:  # one return below: Triton 3.6 compares the types of every return statement
        rows = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)[None, :].to(tl.int64)
        ok = rows < 2 * N
    else:
        rows = offs_n[None, :].to(tl.int64) * (2 if INTERLEAVED else 1)
        ok = n_ok[None, :]
    return rows, ok


@triton.jit
def gate_up_kernel(
    x_ptr, w13_ptr, w13_up_ptr, b13_ptr, h_ptr,  # x [M, K], w13 [E, 2N or N, K], b13 [E, 2N or N], h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, map_ptr,  # map: FOLD with an expert map only
    N, K, num_assignments, top_k, num_experts, num_pid_m, num_global,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, PAIRS: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, LIMIT_AFTER: tl.constexpr, UP_SHIFT: tl.constexpr, NAIVE: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, W_DESC: tl.constexpr, PDL: tl.constexpr, FOLD: tl.constexpr = False,  # FOLD: docstring
    A_PAD: tl.constexpr = 1, E_PAD: tl.constexpr = 1, FOLD_CHUNK: tl.constexpr = 1, HAS_MAP: tl.constexpr = False):
    """h = glu(x w13^T + b13) per assignment (variant constexprs: module docstring; gate/up rows: _w13_rows).
    w13_up_ptr: the up rows' own descriptor when W_DESC and INTERLEAVED (w13_ptr: the gate rows'), else None."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _gate_up_rows(pid_m, pid_n, ids_ptr, map_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                 num_assignments,
                                 num_experts, num_global, BLOCK_M, NAIVE, FOLD, A_PAD, E_PAD, FOLD_CHUNK, HAS_MAP)
    if expert < 0:
        return  # past the rows in use, or (naive) an assignment not routed here: nothing reads its h row
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)  # [BM] int64: the gather, x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    if W_DESC:  # descriptors over [rows, K], block [BN, BK]; rows per expert: 2N, or N (ungated, interleaved)
        gate_row = (expert * N * (1 if INTERLEAVED else (2 if GATED else 1)) + pid_n * BLOCK_N).to(tl.int32)
        up_desc, up_row = (w13_up_ptr, gate_row) if INTERLEAVED else (w13_ptr, gate_row + N)  # gated only
    else:
        w_rows, w_ok = _w13_rows(pid_n, offs_n, n_ok, N, BLOCK_N, INTERLEAVED, PAIRS)  # [1, BN or 2BN]
        wg_ptrs = w13_ptr + expert * stride_we + w_rows * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN or 2BN]
        wu_ptrs = wg_ptrs + (1 if INTERLEAVED else N) * stride_wn  # gated, not PAIRS: the up rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # ungated: the one accumulator
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # ungated: never touched
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            # A last N tile reads past N into the next rows (up, or the next expert's): those columns
            # are never stored. Past K, and past the last row, the descriptor reads zeros.
            wg = w13_ptr.load([gate_row, k0]).T  # [BK, BN]
            if GATED:
                wu = up_desc.load([up_row, k0]).T
        else:
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & w_ok, other=0.0)
            wg_ptrs += BLOCK_K * stride_wk
            if PAIRS:
                wg, wu = tl.split(tl.reshape(wg, [BLOCK_K, BLOCK_N, 2]))  # [BK, BN] each
            elif GATED:
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & w_ok, other=0.0)
                wu_ptrs += BLOCK_K * stride_wk
        acc_gate = _dot(xa, wg, acc_gate, UPCAST, PRECISION)
        if GATED:
            acc_up = _dot(xa, wu, acc_up, UPCAST, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
    let_next_kernel_launch(PDL)  # after the main loop: see PDL above
    h = _gate_up_epilogue(acc_gate, acc_up, b13_ptr, expert, offs_n, n_ok, N, stride_be, stride_bn,
                          ACT, GATED, INTERLEAVED, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)  # [BM, BN] fp32; no [A, 2N]
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_kernel(
    # h [A, N], w2 [E, K, N], b2 [E, K], y [A, K] out: weight * (h w2^T + b2)
    h_ptr, w2_ptr, b2_ptr, y_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    K, N, num_assignments, num_experts, num_pid_m,
    stride_hm, stride_we, stride_wk, stride_wn, stride_b2e, stride_b2k, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_DESC: tl.constexpr,
    PDL: tl.constexpr, KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (docstring)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    SUM_AFTER: tl.constexpr = False, SUM_T: tl.constexpr = 1, SUM_K: tl.constexpr = 1):
    """y = routed weight * (h w2^T + b2) per assignment (b2_ptr None: no bias); KSUM, SUM_AFTER: out too (docstring)."""
    wait_for_previous_kernel(PDL)
    if KSUM or SUM_AFTER:
        if tl.program_id(0) >= num_pid_m * tl.cdiv(K, BLOCK_N):  # the programs after the GEMM's (module docstring)
            programs_after_gemm(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, num_pid_m * tl.cdiv(K, BLOCK_N), K,
                                num_assignments, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD,
                                HAS_MAP, ZERO_T, SUM_AFTER, SUM_T, SUM_K, PDL)
            return
    # columns: K (BLOCK_N tiles); reduce N
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
    h_ptrs = h_ptr + safe_rows[:, None] * stride_hm + offs_red[None, :]  # [BM, BK]
    if W_DESC:  # w2_ptr is a tensor descriptor over w2 as [E*K, N], block [BN, BK]
        w_row = (expert * K + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = (w2_ptr + expert * stride_we + offs_out[None, :].to(tl.int64) * stride_wk
                  + offs_red[:, None] * stride_wn)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_K):
        red_ok = offs_red < N - n0
        ha = tl.load(h_ptrs, mask=row_ok[:, None] & red_ok[None, :], other=0.0)
        if W_DESC:
            wb = w2_ptr.load([w_row, n0]).T  # [BK, BN]; rows past K are never stored, columns past N read 0
        else:
            wb = tl.load(w_ptrs, mask=red_ok[:, None] & out_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wn
        acc = _dot(ha, wb, acc, UPCAST, PRECISION)
        h_ptrs += BLOCK_K
    let_next_kernel_launch(PDL)  # after the main loop: see PDL above
    if b2_ptr is not None:  # added before the routed weight: the bias is part of the expert's output
        b2 = tl.load(b2_ptr + expert * stride_b2e + offs_out.to(tl.int64) * stride_b2k, mask=out_ok, other=0.0)
        acc += b2.to(tl.float32)[None, :]
    store_routed(acc, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, 0,
                 row_ok, arrivals, pid_n, offs_out, out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, KSUM,
                 TOPK_PAD, HAS_MAP, SUM_ROWS)
    gemm_done(counters_ptr, SUM_AFTER)

