"""One launch for a whole tiny-batch experts call (issues 13, 15, 19: decode at the byte floor).

Torch twin: ``moekit.experts.triton_decode_one.decode_one_torch`` (and ``moekit.experts.reference``).

Shapes: M tokens, k slots, S = M*k slots (s = t*k + j), E experts, K hidden, N intermediate; x [M, K],
w13 [E, 2N, K] (gate rows, then up rows; contiguous), w2 [E, K, N] (contiguous), h [S, N] (x's dtype),
y [S, K] float32, out [M, K]. Plain gated silu, no expert map, no biases (the host refuses the rest).

Every program first takes a ticket (an atomic counter) and uses it as its logical id, so the phases are
ordered by dispatch, whatever order the hardware starts programs in:
  tickets [0, S*NT)          gate-up tiles (slot s = t // NT, N tile t % NT): h[s, tile] = silu(x w_g^T) * (x w_u^T);
                             then release-increment up_done[s]
  tickets [S*NT, S*NT+S*DP)  down programs (slot s, DOWN_TILES tiles of BK_OUT rows of K each; DP per slot): issue
                             the first w2 loads (they do not need h),
                             then acquire-wait until up_done[src] == NT (src: the slot whose tiles wrote
                             h[s]), read h[s], y[s, tile] =
                             weight * (h w2^T); then count the arrival per (token, K tile): the last of a
                             token's k slots sums y over j = 0..k-1 in slot order into out (fixed order:
                             deterministic, bit-stable) and zeroes its arrival counter.
A program only ever waits on programs with smaller tickets, which are already running and never wait
on later ones, so the waits end (and a bounded spin, SPIN_LIMIT, turns a bug into a wrong result
rather than a hang). The last program to exit zeroes the ticket, exit and up_done counters, so the
next launch finds them at 0 with no extra launch (graph-capturable; no host sync).

GEMV (gate-up form): one program per (slot, N tile) reads whole [BN, BK] weight tiles and multiplies
them by its token's x row on the CUDA cores (no 16-row padding); an expert hit by two slots is read
twice (the second mostly from L2). Else (DOT): the tile of the first slot of each expert (its leader)
gathers every slot of that expert into a 16-row ``tl.dot``; the other slots' programs do nothing, and
their down tiles wait on the leader's counter (src = leader). The down tiles are GEMV-shaped always.

Counters (int32, zero before the first launch): [0] ticket, [1] exits, [2, 2+S_PAD) up_done per
slot, [2+S_PAD, 2+S_PAD+M*KT) arrivals per (token, K tile).

UPCAST: operands in float32 before ``tl.dot`` (the interpreter's bf16 dot is wrong). PDL: wait for the
previous kernel before the ticket (the counters and x may be its writes).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import wait_for_previous_kernel
from moekit.experts._kernels.quant_fp8 import group_scale, to_e4m3

FP8_GROUP: tl.constexpr = tl.constexpr(128)  # fp8_block's scale blocks and activation groups (``decode_one_fp8``)


@triton.jit
def take_ticket(counters_ptr, TICKET: tl.constexpr):
    """This program's logical id: the next ticket (the order programs started in), or its program id."""
    if TICKET:
        ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    else:
        ticket = tl.program_id(0)
    return ticket


@triton.jit
def spin_until(ptr, target, SPIN_LIMIT: tl.constexpr):
    """Acquire-read *ptr until it reaches target (or SPIN_LIMIT reads); then a CTA barrier so every
    thread's later loads come after the acquire."""
    seen = tl.atomic_add(ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(ptr, 0, sem="acquire")
        spins += 1
    tl.debug_barrier()


@triton.jit
def _gate_up_gemv(x_ptr, w13_ptr, h_ptr, e, token, s, nt, N, K,
                  BN: tl.constexpr, BK: tl.constexpr):
    """h[s, nt*BN + i] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, N + n]) on the CUDA cores."""
    offs_n = nt * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    w_base = w13_ptr + e * (2 * N) * K
    g_ptrs = w_base + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + N * K
    x_ptrs = x_ptr + token * K + offs_k
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BK)):  # i * BK, not a stepped k0: the masks keep their 16-element constancy
        k_ok = offs_k < K - i * BK
        ok = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_ptrs + i * BK, mask=ok, other=0.0).to(tl.float32)
        wu = tl.load(u_ptrs + i * BK, mask=ok, other=0.0).to(tl.float32)
        xv = tl.load(x_ptrs + i * BK, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.sum(wg * xv, axis=1)
        acc_u += tl.sum(wu * xv, axis=1)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + s * N + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gate_up_dot(x_ptr, w13_ptr, h_ptr, e, nt, slots, same, N, K, top_k,
                 BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """The leader's tile: every slot of expert e (``same`` [ROWS]) in one [ROWS, BN] tl.dot product."""
    tokens = tl.where(same, slots // top_k, 0).to(tl.int64)  # [ROWS]
    offs_n = nt * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    w_base = w13_ptr + e * (2 * N) * K
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * K
    x_ptrs = x_ptr + tokens[:, None] * K + offs_k[None, :]  # [ROWS, BK]
    acc_g = tl.zeros([ROWS, BN], dtype=tl.float32)
    acc_u = tl.zeros([ROWS, BN], dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BK)):
        k_ok = offs_k < K - i * BK
        xa = tl.load(x_ptrs + i * BK, mask=same[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs + i * BK, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs + i * BK, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(xa, wg, acc_g)
        acc_u = tl.dot(xa, wu, acc_u)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptrs = h_ptr + slots[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=same[:, None] & n_ok[None, :])


@triton.jit
def down_tiles(h_ptr, w2_ptr, ws_ptr, y_ptr, out_ptr, weights_ptr, counters_ptr, e, valid, s, src, kt0, N, K, top_k,
               NT, KT, ARRIVALS: tl.constexpr, BKO: tl.constexpr, BNR: tl.constexpr, TILES: tl.constexpr,
               SPIN_LIMIT: tl.constexpr, FP8: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """K tiles kt0 .. kt0+TILES-1 of slot s: y[s, rows] = weight[s] * (h[s] . w2[e, rows]) once slot src's gate-up
    tiles are done (src: the program that wrote h[s]); after each tile the arrival count and the k-sum. One flat
    loop over (tile, N step), each step's w2 loads issued before the step before it is multiplied (the first before
    the wait), so a program's fixed costs (ticket, wait, arrivals) overlap its next loads. FP8 (``decode_one_fp8``):
    w2 e4m3 with block scales ws_ptr [E, K/G, N/G], h quantized per G columns step by step (``fp8_step``)."""
    nch = tl.cdiv(N, BNR)
    offs_r = tl.arange(0, BNR)
    lanes = tl.arange(0, BKO)
    w_base = w2_ptr + e * K * N
    k_end = tl.where(valid, K, 0)  # rows past it load nothing: none of an unrouted slot's
    rows = kt0 * BKO + lanes
    w = tl.load(w_base + rows[:, None].to(tl.int64) * N + offs_r[None, :],
                mask=(rows < k_end)[:, None] & (offs_r < N)[None, :], other=0.0)  # issued before the wait
    weight = 0.0
    if valid:
        spin_until(counters_ptr + 2 + src, NT, SPIN_LIMIT)
        weight = tl.load(weights_ptr + s).to(tl.float32)
    acc = tl.zeros([BKO], dtype=tl.float32)
    steps = TILES * nch
    for i in range(0, steps):
        c = i % nch
        c1 = (i + 1) % nch
        rows1 = (kt0 + (i + 1) // nch) * BKO + lanes
        next_end = tl.where(i + 1 < steps, k_end, 0)
        w_next = tl.load(w_base + rows1[:, None].to(tl.int64) * N + c1 * BNR + offs_r[None, :],
                         mask=(rows1 < next_end)[:, None] & (offs_r < N - c1 * BNR)[None, :], other=0.0)
        hv = tl.load(h_ptr + s * N + c * BNR + offs_r, mask=offs_r < tl.where(valid, N - c * BNR, 0), other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        kt = kt0 + i // nch
        if FP8:
            acc += fp8_step(w, hv, ws_ptr, e, kt, c, N, K, KT, BKO, BNR, EMULATE)
        else:
            acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
        if (c == nch - 1) & (kt < KT):
            rows = kt * BKO + lanes
            arrive_and_sum(y_ptr, out_ptr, counters_ptr, acc * weight, s, kt, rows, rows < K, K, top_k, KT, ARRIVALS,
                           BKO)
            acc = tl.zeros([BKO], dtype=tl.float32)
        w = w_next


@triton.jit
def quantized_groups(v, GROUPS: tl.constexpr, EMULATE: tl.constexpr):
    """v [GROUPS*G] float32 -> (the e4m3 values as float32 [GROUPS, G], their scales [GROUPS]): ``quant_fp8``'s rule."""
    v = tl.reshape(v, [GROUPS, FP8_GROUP])
    s = group_scale(tl.max(tl.abs(v), axis=1))
    return to_e4m3(v / s[:, None], EMULATE).to(tl.float32), s


@triton.jit
def scaled_rows(w, q, s_act, s_w, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """sum over the step's groups of (w [ROWS, GROUPS*G] . q [GROUPS, G] per group) * s_act * s_w -> [ROWS]."""
    w = tl.reshape(w.to(tl.float32), [ROWS, GROUPS, FP8_GROUP])
    partial = tl.sum(w * q[None, :, :], axis=2)  # [ROWS, GROUPS]
    return tl.sum(partial * (s_act * s_w)[None, :], axis=1)


@triton.jit
def fp8_step(w, hv, ws_ptr, e, kt, c, N, K, KT, BKO: tl.constexpr, BNR: tl.constexpr, EMULATE: tl.constexpr):
    """One down step on fp8 weights: w [BKO, BNR] e4m3 of rows kt*BKO.., columns c*BNR..; hv [BNR] float32."""
    GROUPS: tl.constexpr = BNR // FP8_GROUP
    nb = N // FP8_GROUP
    groups = tl.arange(0, GROUPS)
    row_block = ((kt * BKO) // FP8_GROUP) * nb
    limit = tl.where(kt < KT, nb - c * GROUPS, 0)  # a tile past K (down_tiles not dividing KT) reads no scale
    sw = tl.load(ws_ptr + e * (K // FP8_GROUP) * nb + row_block + c * GROUPS + groups, mask=groups < limit, other=0.0)
    hq, hs = quantized_groups(hv, GROUPS, EMULATE)
    return scaled_rows(w, hq, hs, sw, BKO, GROUPS)


@triton.jit
def arrive_and_sum(y_ptr, out_ptr, counters_ptr, acc, s, kt, offs_o, o_ok, K, top_k, KT,
                   ARRIVALS: tl.constexpr, BKO: tl.constexpr):
    """y[s, offs_o] = acc [BKO], then count the arrival of (token, kt); the token's last slot sums its k rows of
    y in slot order into out (float32, fixed order) and zeroes the arrival counter."""
    tl.store(y_ptr + s * K + offs_o, acc, mask=o_ok)
    tl.debug_barrier()
    token = s // top_k
    arrivals = counters_ptr + ARRIVALS + token * KT + kt
    if tl.atomic_add(arrivals, 1, sem="acq_rel") == top_k - 1:
        tl.debug_barrier()
        total = tl.zeros([BKO], dtype=tl.float32)
        for j in range(0, top_k):
            total += tl.load(y_ptr + (token * top_k + j) * K + offs_o, mask=o_ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token * K + offs_o, total.to(out_ptr.dtype.element_ty), mask=o_ok)
        tl.atomic_xchg(arrivals, 0, sem="relaxed")


@triton.jit
def last_out_resets(counters_ptr, total, S_PAD: tl.constexpr):
    """Count this program's exit; the last of the ``total`` programs zeroes the ticket, exit and up_done counters."""
    if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == total - 1:
        tl.store(counters_ptr + 2 + tl.arange(0, S_PAD), tl.zeros([S_PAD], dtype=tl.int32))
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)


@triton.jit
def decode_one_kernel(
    x_ptr, w13_ptr, w2_ptr, ids_ptr, weights_ptr, h_ptr, y_ptr, out_ptr, counters_ptr,
    N, K, num_experts, num_slots, top_k,
    S_PAD: tl.constexpr, BN_UP: tl.constexpr, BK_UP: tl.constexpr, BK_OUT: tl.constexpr, BN_RED: tl.constexpr,
    GEMV: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, SPIN_LIMIT: tl.constexpr, TICKET: tl.constexpr = True,
    DOWN_TILES: tl.constexpr = 1,
):
    """The whole experts call; phases by ticket (module docstring). TICKET=False (an A/B of the ticket's cost
    only): the program id instead, which relies on the hardware starting programs in id order."""
    wait_for_previous_kernel(PDL)
    ticket = take_ticket(counters_ptr, TICKET)
    nt_up = tl.cdiv(N, BN_UP)
    kt_out = tl.cdiv(K, BK_OUT)
    down_programs = tl.cdiv(kt_out, DOWN_TILES)  # per slot
    up_tiles = num_slots * nt_up
    slots = tl.arange(0, S_PAD)
    all_ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int64)  # [S_PAD]
    in_up = ticket < up_tiles
    s = tl.where(in_up, ticket // nt_up, (ticket - up_tiles) // down_programs)
    e = tl.load(ids_ptr + s).to(tl.int64)
    valid = (e >= 0) & (e < num_experts)
    same = (all_ids == e) & (all_ids >= 0) & (all_ids < num_experts)  # [S_PAD] the slots of this slot's expert
    leader = tl.min(tl.where(same, slots, S_PAD), axis=0)
    if in_up:
        nt = ticket % nt_up
        if GEMV:
            if valid:
                _gate_up_gemv(x_ptr, w13_ptr, h_ptr, e, s // top_k, s, nt, N, K, BN_UP, BK_UP)
        else:
            if valid & (leader == s):
                _gate_up_dot(x_ptr, w13_ptr, h_ptr, e, nt, slots, same, N, K, top_k, BN_UP, BK_UP, S_PAD, UPCAST)
        tl.debug_barrier()
        tl.atomic_add(counters_ptr + 2 + s, 1, sem="release")
    else:
        src = s if GEMV else leader
        down_tiles(h_ptr, w2_ptr, None, y_ptr, out_ptr, weights_ptr, counters_ptr, e, valid, s, src,
                   ((ticket - up_tiles) % down_programs) * DOWN_TILES, N, K, top_k, nt_up, kt_out, 2 + S_PAD, BK_OUT,
                   BN_RED, DOWN_TILES, SPIN_LIMIT)
    last_out_resets(counters_ptr, up_tiles + num_slots * down_programs, S_PAD)
