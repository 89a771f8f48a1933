"""The int4 weight-only decode through a TMA-fed shared-memory ring (``_kernels/gluon_wo_ring.py``; issue 16):
its weight layout, plan, launches and torch twin. Not yet chosen by any default: the device check
(``benchmarks/wo_ring_device_check.py``) times it against the weight-only pick.

    [gate-up ring GEMV -> h [S, N] bf16] -> [down ring GEMV -> y [S, K] float32 x routed weight] -> [sum over k]

Weights: ``RingWeight``, made once from an int4_w4a16 ``WoWeight`` (group 128) by ``ring_weight``: the packed
bytes as they are ([E*R, C/2] view), the scales and zeros transposed to [E*G, R] (a TMA box needs >= 16
contiguous bytes: the group values of a tile's rows must be contiguous). Shapes: S = M*k slots (token-major),
E experts, R rows, C the reduction dim, G = C / 128 groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.experts.triton_launch import default_launch_options
from moekit.experts.triton_plan import sum_launch
from moekit.experts.triton_wo import WoWeight, dequantize_wo

GROUP = 128  # the one group size the ring decodes (one group a step)


@dataclass(frozen=True)
class RingWeight:
    q: torch.Tensor  # [E*R, C/2] uint8, a view of the WoWeight's packed bytes
    scale: torch.Tensor  # [E, R, G] float32 (mxfp4: [E, R, 4G] uint8 e8m0), the WoWeight's (the raw decode's)
    zero: torch.Tensor  # [E, R, G] uint8 (mxfp4: the scale again, never read)
    scale_t: torch.Tensor | None  # [E*G, R] float32 (the byte and word decodes; None: not made)
    zero_t: torch.Tensor | None  # [E*G, R] uint8
    experts: int  # E
    rows: int  # R
    cols: int  # C
    scheme: str = "int4_w4a16"  # or "mxfp4" (the raw decode only)


@dataclass(frozen=True)
class RingPlan:
    block_rows: int = 32  # BM: rows a tile (a multiple of 4 * num_warps)
    stages: int = 8  # ring depth (a stage: the tile's rows x 128 values, gate and up both when gated)
    num_warps: int = 4  # the decode partition's warps (the loader is one more)
    programs_per_sm: int = 1
    group: int = 0  # 0: a slot a tile; TM > 0: items of up to TM slots of one expert (its rows read once)
    decode: str = "bytes"  # "bytes" (gluon_wo_ring), "words" (gluon_wo_ring_words), "raw" (gluon_wo_raw)


@dataclass(frozen=True)
class RingItems:
    expert: torch.Tensor  # [S] int32, the item's expert (items past count: unused)
    slots: torch.Tensor  # [S, TM] int32, its slots (-1: none)
    count: torch.Tensor  # [1] int32, items in use (on the device: no host sync)


def ring_items(ids: torch.Tensor, tm: int) -> RingItems:
    """The slots ids [S] grouped by expert into items of up to ``tm`` slots (each expert's slots in slot order,
    the experts in id order), by torch ops on the device (graph-capturable, no sync)."""
    s = ids.numel()
    order = torch.sort(ids.long(), stable=True)  # values: the experts sorted, indices: the slots
    pos = torch.arange(s, device=ids.device)
    first = torch.ones(s, dtype=torch.bool, device=ids.device)
    first[1:] = order.values[1:] != order.values[:-1]
    rank = pos - torch.cummax(torch.where(first, pos, 0), 0).values  # the slot's place among its expert's
    opens = rank % tm == 0
    item = torch.cumsum(opens, 0) - 1
    expert = torch.zeros(s, dtype=torch.int32, device=ids.device)
    expert[item] = order.values.to(torch.int32)
    slots = torch.full((s, tm), -1, dtype=torch.int32, device=ids.device)
    slots[item, rank % tm] = order.indices.to(torch.int32)
    return RingItems(expert, slots, opens.sum().to(torch.int32).view(1))


DECODES = ("bytes", "words", "raw")


def ring_weight(w: WoWeight, cols: int, transposed: bool = True) -> RingWeight:
    """The ring's layout of an int4_w4a16 weight [E, R, C] with group size 128 or an mxfp4 one (C = ``cols``, a
    multiple of 128); ``transposed`` (int4 only): also the [E*G, R] scales and zeros the byte and word decodes read
    (copies; the raw decode reads the weight's own)."""
    if w.scheme not in ("int4_w4a16", "mxfp4"):
        raise ValueError(f"ring decode: int4_w4a16 or mxfp4 weights only, got {w.scheme!r}")
    if w.group_size != (GROUP if w.scheme == "int4_w4a16" else 32):
        raise ValueError(f"ring decode: int4 with group size {GROUP} or mxfp4 only, got {w.group_size}")
    transposed = transposed and w.scheme == "int4_w4a16"
    zero = w.scale if w.zero is None else w.zero
    if cols % GROUP or cols <= 0:
        raise ValueError(f"ring decode: the reduction dim must be a positive multiple of {GROUP}, got {cols}")
    e, r, packed = w.q.shape
    if packed != cols // 2 or not w.q.is_contiguous():
        raise ValueError(f"ring decode: q must be contiguous [E, R, {cols // 2}], got {tuple(w.q.shape)}")
    if not (w.scale.is_contiguous() and zero.is_contiguous()):
        raise ValueError("ring decode: scale and zero must be contiguous [E, R, groups]")
    g = cols // GROUP
    scale_t = w.scale.permute(0, 2, 1).contiguous().view(e * g, r) if transposed else None
    zero_t = zero.permute(0, 2, 1).contiguous().view(e * g, r) if transposed else None
    return RingWeight(w.q.view(e * r, packed), w.scale, zero, scale_t, zero_t, e, r, cols, w.scheme)


def check_plan(plan: RingPlan, out_rows: int) -> None:
    """Refuse a plan the kernel cannot run on ``out_rows`` output rows a matrix (N gated, K down), by name."""
    if plan.block_rows % (4 * plan.num_warps) or plan.block_rows > 256:
        raise ValueError(f"ring plan: block_rows {plan.block_rows} must be a multiple of 4 * num_warps "
                         f"({4 * plan.num_warps}) and <= 256")
    if out_rows % plan.block_rows:
        raise ValueError(f"ring plan: {out_rows} rows are not a multiple of block_rows {plan.block_rows}")
    if not 2 <= plan.stages <= 16:
        raise ValueError(f"ring plan: stages must be 2..16, got {plan.stages}")
    if plan.group not in (0, 1, 2, 4, 8):
        raise ValueError(f"ring plan: group must be 0 (a slot a tile) or 1, 2, 4, 8 slots an item, got {plan.group}")
    if plan.decode not in DECODES:
        raise ValueError(f"ring plan: decode must be one of {DECODES}, got {plan.decode!r}")
    if plan.decode != "bytes" and plan.group > 2:
        raise ValueError(f"ring plan: the {plan.decode} decode takes items of at most 2 slots, got group {plan.group}")


def ring_grid(slots: int, out_rows: int, plan: RingPlan, num_sms: int) -> int:
    """Programs of one launch: the tiles (slot, row block), at most programs_per_sm per SM."""
    return max(1, min(slots * (out_rows // plan.block_rows), num_sms * plan.programs_per_sm))


def prep_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, C] (C a multiple of 128) as the word decode reads it, float32: values [rows * G * 8, 16], step g of
    row r at rows (r G + g) 8 ..: [j, c] = x[r, 128 g + 8 c + j] * 16^-(j % 4); sums [rows * G, 16]: [r G + g, c] =
    the sum of x[r, 128 g + 8 c ..+ 8]."""
    rows, c = x.shape
    v = x.float().view(rows, c // GROUP, 16, 8)  # [r, g, word c, code j]
    scale = torch.tensor([16.0 ** -(j % 4) for j in range(8)], device=x.device)
    values = (v * scale).transpose(2, 3).reshape(rows * (c // GROUP) * 8, 16)
    return values, v.sum(3).reshape(rows * (c // GROUP), 16)


def _descriptors(w: RingWeight, bm: int, x: torch.Tensor, decode: str = "bytes") -> tuple:
    """The kernel's first arguments: TMA descriptors of w's bytes [BM, 64] (words, raw: int32 [BM, 16]), scales and
    zeros [1, BM] (raw: the [E, R, G] tensors themselves), and x [rows, C] bf16 as int32 [1, 64] (words: ``prep_x``
    [8, 16] and [1, 16] float32; raw: [16, 4] int32)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, block: list[int], layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    flat8 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    if w.scale_t is None and decode != "raw":
        raise ValueError(f"ring decode: the {decode} decode needs ring_weight(..., transposed=True)")
    if decode == "raw":
        pairs = x.view(torch.int32).reshape(-1, 4)  # [rows * C / 8, 4]: row r's step g at rows (r G + g) 16 ..
        return desc(w.q.view(torch.int32), [bm, 16], flat), desc(pairs, [16, 4], flat), w.scale, w.zero
    if decode == "words":
        values, sums = prep_x(x)
        return (desc(w.q.view(torch.int32), [bm, 16], flat), desc(w.scale_t, [1, bm], flat),
                desc(w.zero_t, [1, bm], flat8), desc(values, [8, 16], flat), desc(sums, [1, 16], flat))
    return (desc(w.q, [bm, 64], gl.NVMMASharedLayout.get_default_for([bm, 64], gl.uint8)),
            desc(w.scale_t, [1, bm], flat), desc(w.zero_t, [1, bm], flat8), desc(x.view(torch.int32), [1, 64], flat))


def ring_gemv(x: torch.Tensor, w: RingWeight, ids: torch.Tensor, wts: torch.Tensor, top_k: int, gated: bool,
              plan: RingPlan = RingPlan(), loader_only: bool = False, items: RingItems | None = None) -> torch.Tensor:
    """Gated: h [S, R/2] bf16 from x [S/top_k, C] bf16; else y [S, R] float32 = wts[s] * (x[s] . w[ids[s]]) from
    x = h [S, C] bf16. ids [S] int32, wts [S] float32; ``items`` (``ring_items(ids, plan.group)``) where
    plan.group > 0."""
    from moekit.experts._kernels.gluon_wo_ring import ring_kernel
    from moekit.experts._kernels.gluon_wo_ring_words import ring_words_kernel
    from moekit.experts._kernels.gluon_wo_raw import RAW_CONSTANTS, raw_kernel

    if x.dtype != torch.bfloat16 or x.shape[-1] != w.cols or not x.is_contiguous():
        raise ValueError(f"ring decode: x must be contiguous bf16 [.., {w.cols}], got {x.dtype} {tuple(x.shape)}")
    slots = ids.numel()
    rows = w.rows // 2 if gated else w.rows
    check_plan(plan, rows)
    out = torch.empty(slots, rows, device=x.device, dtype=torch.bfloat16 if gated else torch.float32)
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = ring_grid(slots, rows, plan, num_sms)
    if (items is None) != (plan.group == 0):
        raise ValueError(f"ring decode: items are needed exactly where plan.group > 0 (group {plan.group})")
    descs = _descriptors(w, plan.block_rows, x.reshape(-1, w.cols), plan.decode)
    tables = (ids, ids, ids) if items is None else (items.expert, items.slots, items.count)
    kernel = {"bytes": ring_kernel, "words": ring_words_kernel, "raw": raw_kernel}[plan.decode]
    mx = w.scheme == "mxfp4"
    consts = RAW_CONSTANTS[mx] if plan.decode == "raw" else ()
    if mx and plan.decode != "raw":
        raise ValueError(f"ring decode: mxfp4 weights take the raw decode only, got {plan.decode!r}")
    kernel[(grid,)](*descs, ids, wts, *tables, out, w.experts, *consts, S=slots,
                         TOP_K=top_k if gated else 1, R=w.rows, ROWS=rows, G=w.cols // GROUP, GATED=gated,
                         TM=max(plan.group, 1), GROUPED=plan.group > 0, STAGES=plan.stages, LOADER_ONLY=loader_only,
                         num_warps=plan.num_warps, **({"MX": mx} if plan.decode == "raw" else {}))
    return out


@functools.lru_cache(maxsize=256)
def _sum_launch(num_tokens: int, hidden: int, top_k: int, num_experts: int, device: torch.device):
    """moekit's k-sum (``triton_plan.sum_launch``, slot order, skipped slots unread): y [S, K] float32 -> out."""
    return sum_launch(num_tokens, hidden, top_k, num_experts, None, default_launch_options(device), ordered=True)


def ring_sum(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int) -> torch.Tensor:
    """out [M, K] = the sum over each token's routed slots of y [M*k, K] float32, in slot order; ids [M, k]."""
    _sum_launch(out.shape[0], out.shape[1], ids.shape[1], num_experts, out.device)(y, ids, ids, out)
    return out


def ring_experts(x: torch.Tensor, w13: RingWeight, w2: RingWeight, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, up: RingPlan = RingPlan(), down: RingPlan = RingPlan()) -> torch.Tensor:
    """The MoE experts [M, K] bf16: gate-up ring GEMV, down ring GEMV x routed weight, the sum over k in slot order."""
    m, k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int32)
    wts = topk_weights.reshape(-1).to(torch.float32)
    items = {tm: ring_items(ids, tm) for tm in {up.group, down.group} if tm}
    h = ring_gemv(x, w13, ids, wts, k, True, up, items=items.get(up.group))  # [S, N]
    y = ring_gemv(h, w2, ids, wts, 1, False, down, items=items.get(down.group))  # [S, K] float32
    return ring_sum(y, topk_ids, torch.empty_like(x), w13.experts)


def ring_twin(x: torch.Tensor, w13: WoWeight, w2: WoWeight, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's arithmetic in float32 torch: (h [S, N] bf16, out [M, K] bf16), h rounded to bf16 as the kernel
    stores it. Slot s reads expert ids[s] (an id >= E: the last expert's rows, weight 0)."""
    m, k = topk_ids.shape
    e, n2, kdim = w13.q.shape[0], w13.q.shape[1], 2 * w13.q.shape[2]
    n = n2 // 2
    ids = topk_ids.reshape(-1).long()
    wts = torch.where(ids < e, topk_weights.reshape(-1).float(), 0.0)
    ids = ids.clamp(max=e - 1)
    xs = x.float().repeat_interleave(k, 0)  # [S, K]
    h = torch.empty(m * k, n, device=x.device, dtype=torch.bfloat16)
    y = torch.empty(m * k, kdim, device=x.device, dtype=torch.float32)
    for s, ex in enumerate(ids.tolist()):
        gu = dequantize_wo(w13, kdim, ex) @ xs[s]  # [2N]
        h[s] = (torch.nn.functional.silu(gu[:n]) * gu[n:]).to(torch.bfloat16)
        y[s] = wts[s] * (dequantize_wo(w2, n, ex) @ h[s].float())
    return h, y.view(m, k, kdim).sum(1).to(x.dtype)
