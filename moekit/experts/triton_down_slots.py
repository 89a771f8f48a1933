"""Tiny batches on the bf16/fp16 Triton path: gate-up as planned, then the down GEMM and the k-sum as one launch
whose programs walk a token's slots (``_kernels/down_slots.py``; its torch twin is ``experts.reference``).

    experts_down_slots(x, w13, w2, ids, weights, tile) = fused_experts(x, w13, w2, ids, weights) bit for bit where
    the plan takes the tiny-batch shortcut (A*4 <= E, no expert map, no biases), with one launch fewer.

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate. The tile names the down kernel's column
width (BLOCK_N of out's K columns), its reduction step over N (BLOCK_K) and its pipeline; the grid is
(cdiv(K, BLOCK_N), M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts.triton_cache import WorkspacePool, descriptor_pair, weight_descriptor
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels, next_pow2
from moekit.experts.triton_plan import plan_for
from moekit.triton_bind import BoundLaunch


@dataclass(frozen=True)
class SlotsTile:
    """The down-over-slots kernel's tile: out columns per program, reduction step, warps, pipeline depth."""

    BLOCK_N: int = 16
    BLOCK_K: int = 128
    num_warps: int = 4
    num_stages: int = 8

    @property
    def name(self) -> str:
        return f"n{self.BLOCK_N} k{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"


_POOL = WorkspacePool()
_KEPT: dict[tuple, tuple] = {}  # (plan id, tile, w2 fingerprint) -> (plan, descriptors, w2 descriptor, BoundLaunch)


def slots_applicable(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, expert_map=None, b13=None,
                     b2=None) -> bool:
    """Where the kernel runs: the plan's tiny-batch shortcut (blocks from topk_ids: A*4 <= E), no expert map, no
    biases, 16-bit weights (TMA)."""
    return (expert_map is None and b13 is None and b2 is None and w13.element_size() == 2
            and ids.numel() * 4 <= w13.shape[0])


def _entry(x, w13, w2, ids, weights, tile: SlotsTile, config, options: LaunchOptions):
    plan = plan_for(x, w13, w2, ids, weights, None, "silu", config, options)
    if plan.align is not None or plan.descriptor_key is None:
        raise ValueError("experts_down_slots needs the tiny-batch shortcut with TMA weights (A*4 <= E, 16-bit "
                         f"contiguous weights), got A={ids.numel()}, E={w13.shape[0]}")
    key = (id(plan), tile, w2.data_ptr(), w2.shape, w13.data_ptr(), w13.shape)
    kept = _KEPT.get(key)
    if kept is None:
        num_experts, hidden, n = w2.shape
        top_k = ids.shape[1]
        launch = BoundLaunch(
            kernels("down_slots").down_slots_kernel, (cdiv(hidden, tile.BLOCK_N), x.shape[0]), 5,
            (hidden, n, top_k, num_experts, n, hidden),
            BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, TOPK_PAD=next_pow2(top_k), UPCAST=interpreting(),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=tile.num_warps,
            num_stages=tile.num_stages, cached=plan.options.cached_launcher, raw=plan.options.raw_launcher,
            **plan.options.pdl_kwargs(),
        )
        kept = _KEPT[key] = (plan, descriptor_pair(w13, w2, plan.descriptor_key),
                             weight_descriptor(w2, tile.BLOCK_N, tile.BLOCK_K), launch)
    return kept


def experts_down_slots(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, tile: SlotsTile = SlotsTile(), config=None,
                       options: LaunchOptions = LaunchOptions()) -> torch.Tensor:
    """out [M, K]: the plan's gate-up launch into h, then ``down_slots_kernel`` (plain silu; checked arguments)."""
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    if not slots_applicable(x, w13, ids):
        raise ValueError(f"experts_down_slots: A*4 <= E and 16-bit weights needed, got A={ids.numel()}, "
                         f"E={w13.shape[0]}, {w13.dtype}")
    plan, pair, w2_desc, down = _entry(x, w13, w2, ids, weights, tile, config, options)
    b = _POOL.buffers(plan.workspace, x.device) if plan.options.reuse_workspace else plan.workspace.allocate(x.device)
    out = torch.empty_like(x)
    plan.gate_up(x, pair.w13, pair.w13_up, None, b["h"], ids, None, None, None, None)
    down(b["h"], w2_desc, weights, ids, out)
    return out
