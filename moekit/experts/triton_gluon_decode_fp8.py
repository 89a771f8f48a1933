"""A decode call on fp8_block weights as ONE persistent Gluon kernel (``_kernels/gluon_decode_fp8.py``; issue 15).

``experts_gluon_decode_fp8`` launches it (x quantized inside, no quantize launch, no k-sum launch, no memset);
``decode_fp8_twin`` computes DeepSeek-V3's recipe along the same tile schedule in torch (the CPU tests' oracle:
Gluon does not run in the interpreter). Same plan, scratch and counters as the bf16 kernel
(``triton_gluon_decode``), h in float32. Not a default: a variant of ``benchmarks/m1_device_check.py``.
"""

from __future__ import annotations

import importlib

import torch

from moekit.experts.triton_gluon_decode import (
    BM, MAX_SLOTS, MAX_TOKENS, DecodePlan, _Kept, decode_scratch, plan_decode,
)
from moekit.experts.triton_cache import WeightDescriptors
from moekit.quant.fp8_block import Fp8BlockWeight, fake_quantize_activations_fp8
from moekit.triton_bind import BoundLaunch

_KERNEL = "moekit.experts._kernels.gluon_decode_fp8"
_KEPT: dict[tuple, _Kept] = {}
_DESCRIPTORS = WeightDescriptors()


def decode_fp8_unfit(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor) -> str | None:
    """Why the fp8 decode kernel cannot take this call (None when it can)."""
    if not isinstance(w13, Fp8BlockWeight) or not isinstance(w2, Fp8BlockWeight):
        return "weights not fp8_block"
    if tuple(w13.block_shape) != (128, 128) or tuple(w2.block_shape) != (128, 128):
        return f"block shapes {w13.block_shape}, {w2.block_shape} (128 x 128 only)"
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous() or x.data_ptr() % 16:
        return f"x {x.dtype}, contiguous 16-byte aligned bf16 / fp16 only"
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (w13.q, w13.scale, w2.q, w2.scale)):
        return "strided or unaligned weights / scales"
    m, k = topk_ids.shape
    if m * k > MAX_SLOTS or m > MAX_TOKENS:
        return f"M={m}, k={k}: more than {MAX_SLOTS} slots or {MAX_TOKENS} tokens"
    hidden, inter = w2.shape[1], w2.shape[2]
    if inter % 256 or hidden % 128:
        return f"N={inter} (a multiple of 256), K={hidden} (of 128)"
    return None


def _descriptors(q13: torch.Tensor, q2: torch.Tensor, key: tuple) -> tuple:
    """TMA descriptors over the e4m3 weights as [E*2N, K] and [E*K, N], [64, 128] blocks."""
    from moekit.experts.triton_gluon_launch import gluon_descriptor

    return gluon_descriptor(q13.view(-1, q13.shape[2]), [BM, 128]), gluon_descriptor(q2.view(-1, q2.shape[2]), [BM, 128])


def experts_gluon_decode_fp8(x: torch.Tensor, w13: Fp8BlockWeight, w2: Fp8BlockWeight, topk_ids: torch.Tensor,
                             topk_weights: torch.Tensor, stages: int = 0, split: int = 1) -> torch.Tensor:
    """out [M, K] = DeepSeek-V3's fp8 block recipe for a decode call, one launch (raises where ``decode_fp8_unfit``
    says why)."""
    if x.shape[0] == 0:
        return torch.empty(0, w2.shape[1], dtype=x.dtype, device=x.device)
    why = decode_fp8_unfit(x, w13, w2, topk_ids)
    if why:
        raise ValueError(f"gluon fp8 decode kernel: {why}")
    m, k = topk_ids.shape
    e, hidden, inter = w2.shape
    key = (x.device, x.dtype, topk_ids.shape, w2.shape, stages, split)
    kept = _KEPT.get(key)
    if kept is None:
        from moekit.experts.triton_gluon_launch import num_sms

        plan = plan_decode(m, k, inter, hidden, num_sms(x.device), 128, stages, split, fp8=True)
        launch = BoundLaunch(importlib.import_module(_KERNEL).decode_fp8_kernel, (plan.grid,), 15, (e,), True,
                             S=plan.slots, TOP_K=k, N=inter, K=hidden, KS=split, STAGES=plan.stages, num_warps=4)
        kept = _KEPT[key] = _Kept(launch, decode_scratch(x.device, torch.float32, inter, hidden))
    w13_desc, w2_desc = _DESCRIPTORS.get(w13.q, w2.q, ("gluon_decode_fp8", x.device), _descriptors)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    h, y, part, up_done, piece, arrive, exit_ = kept.scratch
    kept.launch(w13_desc, w2_desc, x, w13.scale, w2.scale, ids, wts, h, y, out, part, up_done, piece, arrive, exit_)
    return out


def decode_fp8_twin(x: torch.Tensor, w13: Fp8BlockWeight, w2: Fp8BlockWeight, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """The fp8 kernel's function along its schedule, in torch: x quantized per 128 columns, gate-up tiles (pieces
    along K summed in order) on the dequantized weights in float32, h = silu(g) * up in float32, then quantized
    per 128 columns when staged, down tiles y = weight * (w2 rows @ hq), each token's slots summed in order."""
    m, k = topk_ids.shape
    e_count, hidden, inter = w2.shape
    ids, wts = topk_ids.reshape(-1).long(), topk_weights.reshape(-1).float()
    xq = fake_quantize_activations_fp8(x, 128)  # [M, K] float32
    h = torch.zeros(plan.slots, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(plan.slots, hidden, dtype=torch.float32, device=x.device)
    parts = torch.zeros(plan.slots, plan.up_blocks, plan.split, 2, BM, dtype=torch.float32, device=x.device)
    dequant: dict[int, tuple] = {}
    hq, kp = None, hidden // plan.split
    for up, s, blk, piece in map(plan.tile, range(plan.num_tiles)):
        e, rows = min(int(ids[s]), e_count - 1), slice(blk * BM, (blk + 1) * BM)
        if e not in dequant:
            dequant[e] = (w13.select_experts(slice(e, e + 1)).dequantize()[0],
                          w2.select_experts(slice(e, e + 1)).dequantize()[0])
        w13e, w2e = dequant[e]
        if up:
            ks = slice(piece * kp, (piece + 1) * kp)
            parts[s, blk, piece, 0] = w13e[rows, ks] @ xq[s // k, ks]
            parts[s, blk, piece, 1] = w13e[inter + blk * BM: inter + (blk + 1) * BM, ks] @ xq[s // k, ks]
            if piece == plan.split - 1:  # the kernel's last piece to arrive sums them in order; same values
                g, u = parts[s, blk, 0, 0].clone(), parts[s, blk, 0, 1].clone()
                for p in range(1, plan.split):
                    g, u = g + parts[s, blk, p, 0], u + parts[s, blk, p, 1]
                h[s, rows] = g * torch.sigmoid(g) * u
        else:
            if hq is None:  # staged once every gate-up tile is done
                hq = fake_quantize_activations_fp8(h, 128)
            wt = float(wts[s]) if int(ids[s]) < e_count else 0.0
            y[s, rows] = (w2e[rows] @ hq[s]) * wt
    out = y.view(m, k, hidden)[:, 0].clone()
    for j in range(1, k):
        out += y.view(m, k, hidden)[:, j]
    return out.to(x.dtype)
