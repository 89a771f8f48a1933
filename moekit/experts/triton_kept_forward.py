"""The kept training forward's tiles (``BackwardOptions(recompute=False)``: ``triton_train_forward.sorted_forward``
with ``keep_h``, the gate-up GEMM storing h_p beside g_p): which gate-up and down tile a shape runs.

    forward_tiles(shape, block_m, desc, limit_bytes) -> KeptForward(fwd13, fwd2, source)

By ``shape_class`` (the backward's: width narrow / mid / wide, rows per expert few / some / many), ``FORWARD_RULE``
names the source of a class's tiles:
    "inference"  the inference forward's own config for this shape (``configs.get_config``: the tuned file's entry of
                 the nearest M, else ``heuristic_config``), its BLOCK_M the M-block of both kernels, where it fits the
                 kept kernels (below), else "kept"
    "kept"       ``triton_backward_sorted.KEPT_FORWARD`` for both GEMMs (session 51's one tile: "wide/many"'s gate-up
                 tile, 128 x 128, 64-wide K steps, 8 warps, 4 stages)
    a name of ``CANDIDATES``: that measured pair
A class not in the rule takes "kept"; the rule applies to bf16 on an sm_90 GPU (where it was measured, as ``TUNED``,
which sizes the layout's block), every other call takes "kept".

Why the kept forward cannot simply take the inference forward's tiles: its layout is the backward's (block_m from
``backward_tiles``, 128 on sm_90: x_p and h_p are kept in those rows for the backward), so an M-block must divide it
(the inference forward sizes its own layout's block to its BLOCK_M); both operands of each GEMM come through TMA
(x_p / g_p in the layout's rows), so every stage buffers its activation tile too (the inference forward gathers x by
pointer loads, one stage fewer): the pipeline is refit to the shared memory (``configs.fit_shared_memory`` with
descriptors); and the gate-up epilogue stores gate and up (h_p) beside g, holding both accumulators to the end
(registers: checked by the offline compiles of ``benchmarks/trn52_compile_cpu.py``).

Shapes: M tokens, k slots, A = M*k assignments, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from moekit.experts.configs import (GemmTile, KernelConfig, call_device_key, fit_shared_memory, get_config,
                                    on_config_cache_clear)
from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles, shape_class
from moekit.experts.triton_launch import interpreting, max_shared_memory


@dataclass(frozen=True)
class KeptShape:
    """What the pick reads of one kept forward call."""

    num_tokens: int  # M
    num_experts: int  # E, local
    n: int  # N
    hidden: int  # K
    top_k: int  # k
    dtype: torch.dtype  # x's
    device_key: str  # ``configs.device_key`` of x's device: the config files' name part


@dataclass(frozen=True)
class KeptForward:
    """The kept forward's two tiles and where they came from."""

    fwd13: KernelTiles  # the gate-up GEMM (with the h_p store); rows divides the layout's block
    fwd2: KernelTiles  # the down GEMM
    source: str  # "inference", "kept", or the name of a ``CANDIDATES`` entry


def _config(rows: int, up: tuple, down: tuple) -> KernelConfig:
    """A measured pair: ``rows``-row M-blocks, each GEMM's (BLOCK_N, num_warps, num_stages), 64-wide steps, 8 M-blocks
    a sweep."""
    return KernelConfig(rows, GemmTile(up[0], 64, 8, up[1], up[2]), GemmTile(down[0], 64, 8, down[1], down[2]))


# Named (gate-up, down) pairs the device check times beside "kept" and "inference" (``benchmarks/
# trn52_device_check.py``, phase "fwd", each kernel timed alone too); shared memory per stage in bf16 in the comments
# (sm_90: 227 KB a block, 228 KB an SM: two blocks of <= ~112 KB share one).
CANDIDATES: dict[str, KernelConfig] = {
    # 3 stages: gate-up 3 x 48 KB (one block an SM), down 3 x 32 KB (two)
    "s3": _config(128, (128, 8, 3), (128, 8, 3)),
    # gate-up 64 wide: 3 x 32 KB, two blocks an SM (one's h_p / g stores under the other's MMAs); down 256 wide,
    # 3 x 48 KB
    "n64": _config(128, (64, 8, 3), (256, 8, 3)),
    # 64-row blocks, 256 wide (Mixtral M=1024's inference tiles, GROUP_M 8): gate-up 3 x 72 KB, down 4 x 40 KB
    "m64": _config(64, (256, 8, 3), (256, 8, 4)),
}

# shape_class -> the source of its kept forward tiles (module docstring). Session 51's one tile everywhere until the
# device check measures the others (session 52).
FORWARD_RULE: dict[str, str] = {}


def kept_tile(block_m: int, tile: GemmTile, desc: bool) -> KernelTiles:
    """An inference GEMM tile as a kept forward tile, ``block_m`` rows."""
    return KernelTiles(tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages, rows=block_m, desc=desc,
                       contiguous=True, group=tile.GROUP_M)


def as_kept(config: KernelConfig, source: str, block_m: int, itemsize: int, desc: bool,
            limit_bytes: int) -> KeptForward | None:
    """``config`` as the kept forward's tiles, its pipelines refit to ``limit_bytes`` of shared memory with both
    operands buffered (``desc``: TMA, else pointer loads); None where its BLOCK_M does not divide the layout's
    ``block_m``."""
    if block_m % config.BLOCK_M:
        return None
    fitted = fit_shared_memory(config, itemsize, limit_bytes, descriptors=desc)
    return KeptForward(kept_tile(config.BLOCK_M, fitted.up, desc), kept_tile(config.BLOCK_M, fitted.down, desc),
                       source)


def inference_config(shape: KeptShape) -> KernelConfig:
    """The inference forward's config for ``shape`` (the tuned file's entry of the nearest M, else the heuristic)."""
    return get_config(shape.num_tokens, shape.num_experts, shape.n, shape.hidden, shape.top_k, shape.dtype,
                      shape.device_key)


def forward_tiles(shape: KeptShape, block_m: int, desc: bool, limit_bytes: int, kept: KernelTiles,
                  source: str | None = None) -> KeptForward:
    """The kept forward's tiles for ``shape`` on a layout of ``block_m`` rows a block: ``source`` (None: the rule's
    for the shape's class, else "kept"), falling back to ``kept`` (the "kept" tile, with ``desc``) where the source's
    M-block does not divide ``block_m``. Kept per arguments (cleared with the config lookups)."""
    if source is None:
        source = FORWARD_RULE.get(shape_class(shape.num_tokens * shape.top_k, shape.num_experts, shape.n), "kept")
    if source not in ("kept", "inference", *CANDIDATES):
        raise ValueError(f"source must be 'inference', 'kept' or one of {sorted(CANDIDATES)}, got {source!r}")
    return _picked(shape, block_m, desc, limit_bytes, kept, source)


@functools.lru_cache(maxsize=256)
def _picked(shape: KeptShape, block_m: int, desc: bool, limit_bytes: int, kept: KernelTiles,
            source: str) -> KeptForward:
    fallback = KeptForward(dataclasses.replace(kept, desc=desc), dataclasses.replace(kept, desc=desc), "kept")
    if source == "kept":
        return fallback
    config = inference_config(shape) if source == "inference" else CANDIDATES[source]
    return as_kept(config, source, block_m, shape.dtype.itemsize, desc, limit_bytes) or fallback


on_config_cache_clear(_picked.cache_clear)


@dataclass(frozen=True)
class DeviceFacts:
    """What the pick reads of a call's device."""

    key: str  # ``configs.device_key``: the config files' name part
    shared_bytes: int  # the shared memory a program may use; unbounded off CUDA and under the interpreter
    measured: bool  # an sm_90 GPU, where ``FORWARD_RULE`` was measured (as ``TUNED``, which keys the layout's block)


@functools.lru_cache(maxsize=16)
def device_facts(device: torch.device) -> DeviceFacts:
    on_gpu = device.type == "cuda" and not interpreting()
    return DeviceFacts(call_device_key(device), max_shared_memory(device) if on_gpu else 1 << 62,
                       on_gpu and torch.cuda.get_device_capability(device) == (9, 0))


def with_kept_forward(tiles: BackwardTiles, kept: BackwardTiles, x: torch.Tensor, w13: torch.Tensor,
                      topk_ids: torch.Tensor, source: str | None = None) -> BackwardTiles:
    """``kept`` (``kept_tiles(tiles)``) with ``forward_tiles``' pick for the call (x [M, K], w13 [E, 2N, K], topk_ids
    [M, k]) where the shape's ``tiles`` carry no forward tiles of their own ("wide/many"'s ``TUNED`` entry does).
    ``source`` None: the rule's for bf16 on an sm_90 GPU (where it was measured), else "kept"."""
    if tiles.fwd13 is not None:
        return kept
    facts = device_facts(x.device)
    if source is None and not (facts.measured and x.dtype == torch.bfloat16):
        source = "kept"
    shape = KeptShape(x.shape[0], w13.shape[0], w13.shape[1] // 2, x.shape[1], topk_ids.shape[1], x.dtype, facts.key)
    pick = forward_tiles(shape, kept.block_m, kept.fwd13.desc, facts.shared_bytes, kept.fwd13, source)
    return dataclasses.replace(kept, fwd13=pick.fwd13, fwd2=pick.fwd2)
