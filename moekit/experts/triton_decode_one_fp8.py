"""One launch for a whole tiny-batch fp8_block experts call (``_kernels/decode_one_fp8.py``): the host side.

    decode_one_fp8_refusal(call) -> None, or why not (the caller falls back to the fp8 kernels)
    run_decode_one_fp8(x, w13, w2, ids, weights, config, options) -> out [M, K]: one launch, no host sync

Torch twin: ``moekit.experts.triton_fp8.fused_experts_fp8_torch`` (x and h quantized per token per 128 columns,
block-scaled GEMMs in float32). Workspace and counters: ``triton_decode_one``'s (h float32 here). Wiring:
``LaunchOptions.decode_one`` in ``triton_quant.run_quantized_triton``.

Shapes: M tokens, k slots, S = M*k, E experts, K hidden, N intermediate; G = 128.
"""

from __future__ import annotations

import functools

import torch

from moekit.experts.triton_decode_one import (
    SLOT_LIMIT, SPIN_LIMIT, DecodeOneConfig, _LAUNCHES, _slot_pad, launch_key, workspace,
)
from moekit.experts.triton_launch import LaunchOptions, cdiv, kernels, next_pow2, resolve_launch_options
from moekit.triton_bind import BoundLaunch, interpreting

GROUP = 128


@functools.lru_cache(maxsize=256)
def default_fp8_config(n: int, k: int) -> DecodeOneConfig:
    """Heuristic tiles: 16-row gate-up tiles over 512 hidden columns (4 groups) a step; whole N up to 1024."""
    return DecodeOneConfig(block_k_up=min(512, next_pow2(k)), block_n_red=min(1024, next_pow2(n)))


def decode_one_fp8_refusal(x, w13, w2, topk_ids, expert_map=None, activation="silu", b13=None, b2=None,
                           config: DecodeOneConfig | None = None) -> str | None:
    """None when the one-launch fp8 kernel takes this call (fp8_block weight pair, checked), else why not."""
    slots = topk_ids.numel()
    if not 0 < slots <= SLOT_LIMIT:
        return f"M*k = {slots} slots, the one-launch kernel takes 1..{SLOT_LIMIT}"
    if expert_map is not None or b13 is not None or b2 is not None or activation != "silu":
        return "an expert map, biases or an activation other than plain silu"
    if tuple(w13.block_shape) != (GROUP, GROUP) or tuple(w2.block_shape) != (GROUP, GROUP):
        return f"block shapes {w13.block_shape}, {w2.block_shape}: only ({GROUP}, {GROUP})"
    n, k = w2.shape[2], x.shape[1]
    if n % GROUP or k % GROUP:
        return f"N = {n}, K = {k}: both must be multiples of {GROUP} (whole scale blocks per tile)"
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():
        return f"x must be contiguous bf16/fp16, got {x.dtype}"
    if not all(t.is_contiguous() for t in (w13.q, w13.scale, w2.q, w2.scale)):
        return "fp8 weights and scales must be contiguous"
    c = config or default_fp8_config(n, k)
    if c.block_n_up > GROUP or c.block_k_out > GROUP or c.block_k_up % GROUP or c.block_n_red % GROUP or not c.gemv:
        return f"tiles {c}: block_n_up, block_k_out <= {GROUP}, block_k_up, block_n_red multiples of {GROUP}, gemv"
    return None


def run_decode_one_fp8(x, w13, w2, topk_ids, topk_weights, config: DecodeOneConfig | None = None,
                       options: LaunchOptions = LaunchOptions()) -> torch.Tensor:
    """out [M, K] in one launch; the call must fit (``decode_one_fp8_refusal`` is None)."""
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    slots, n, k = ids.numel(), w2.shape[2], x.shape[1]
    config = config or default_fp8_config(n, k)
    options = resolve_launch_options(options, x.device)
    ws = workspace(x, slots, n, k, config, h_dtype=torch.float32)
    out = torch.empty_like(x)
    num_experts = w13.q.shape[0]
    key = ("fp8", slots, ids.shape[1], num_experts, n, k, launch_key(x, (w13.q, w13.scale, w2.q, w2.scale), ids, weights),
           config, options)
    launch = _LAUNCHES.get(key)
    if launch is None:
        grid = slots * cdiv(n, config.block_n_up) + slots * cdiv(cdiv(k, config.block_k_out), config.down_tiles)
        launch = _LAUNCHES[key] = BoundLaunch(
            kernels("decode_one_fp8").decode_one_fp8_kernel, (grid,), 11, (n, k, num_experts, slots, ids.shape[1]),
            S_PAD=_slot_pad(slots), BN_UP=config.block_n_up, BK_UP=config.block_k_up, BK_OUT=config.block_k_out,
            BN_RED=config.block_n_red, EMULATE=interpreting(), SPIN_LIMIT=SPIN_LIMIT, TICKET=config.ticket,
            DOWN_TILES=config.down_tiles, num_warps=config.num_warps,
            num_stages=config.num_stages, cached=options.cached_launcher, raw=options.raw_launcher,
            **options.pdl_kwargs())
    launch(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, ws.h, ws.y, out, ws.counters)
    return out
