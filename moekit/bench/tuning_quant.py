"""The quantized weight formats of ``moekit tune --dtype``: ``fp8_block`` (DeepSeek-V3's block-scaled
recipe, ``moekit.experts.triton_fp8``) and the weight-only ``int8_w8a16``, ``int4_w4a16``, ``mxfp4``
(``moekit.experts.triton_wo``), each as a ``tuning.TuneScheme``. The weight-only names tune the
whole-tile decode; ``int4_w4a16_register`` and ``mxfp4_register`` the register decode (the plan's
``config_name``: each decode reads its own file; which decode runs is ``choose_decode``'s, from
measurements, or the call's ``decode=``):

- weights: the bench's random bf16 weights (unit-variance GEMMs) quantized once per shape with
  ``moekit.quant.quantize`` and the scheme's default options (fp8 blocks 128 x 128; int4 groups of 128
  with zero points), what ``MoE.quantize_(scheme)`` makes;
- the timed call: the path's launch function with an explicit config (``fused_experts_fp8_launch``;
  ``run_experts_wo`` with the launch options its custom op uses and the name's decode), bf16 activations;
- the default: the plan's heuristic (``heuristic_fp8_config``, ``wo_heuristic_config``);
- the file: the name the plan's lookup reads (``triton_fp8_plan.config_file_name``:
  ``E{E}_N{N}_K{K}_fp8_block_{device}.json``; the weight-only plan reads ``moekit.experts.configs``'
  name with the scheme in the dtype's place), so a tuned file is used with no code change;
- candidates: tile heights from half to twice the mean rows per expert (two or three at most: these
  kernels compile slower than the 16-bit ones), and per GEMM a dozen tiles at most, each accepted by
  the plan's own check (``validate``; the tests hold every candidate to it):
  fp8: BLOCK_K of both GEMMs is the scale block's 128 (one scale per K-step); the gate-up BLOCK_N is a
  multiple of 128 (h re-quantized in its epilogue) or a power of two below it (h to the down GEMM in
  float32: the narrow decode tiles). Weight-only: BLOCK_K >= 32, so a packed sub-tile is >= 32 wide;
  a tile too big for shared memory is shrunk by the plan (``fit_wo_shared_memory``) before it runs.
  The weight-only down GEMM's split-K is not a config field: the plan's ``decode_split_k`` picks it
  for each timed config, as it will for the tuned one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.bench.cells import CellInputs, Shape, make_weights
from moekit.bench.tuning import TuneScheme, tiles_of
from moekit.bench.tuning_switches import current_fp8, switch_variants, switches_of
from moekit.experts.configs import GemmTile, KernelConfig, config_file_name
from moekit.experts.triton_fp8 import check_fp8_args, fused_experts_fp8_launch
from moekit.experts.triton_fp8_plan import check_config, heuristic_fp8_config
from moekit.experts.triton_fp8_plan import config_file_name as fp8_file_name
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_wo import run_experts_wo
from moekit.experts.triton_wo_args import SCHEMES as WO_SCHEMES
from moekit.experts.triton_wo_args import WoWeight, check_wo_args
from moekit.experts.triton_wo_configs import config_name, wo_heuristic_config
from moekit.experts.triton_wo_gemm import span
from moekit.experts.triton_wo_plan import WeightArgs, weight_args
from moekit.quant import Int4Weight, Mxfp4Weight, QuantizedWeight, quantize
from moekit.quant.fp8_block import DEFAULT_BLOCK_SHAPE
from moekit.quant.mxfp4 import MX_BLOCK

# tune name -> (weight-only scheme, decode); int8's two decodes run the same whole-tile dot: one name
WO_TUNE_NAMES = {**{s: (s, "tile") for s in WO_SCHEMES},
                 **{config_name(s, "register"): (s, "register") for s in ("int4_w4a16", "mxfp4")}}
QUANT_SCHEMES = ("fp8_block", *WO_TUNE_NAMES)
FP8_GROUP = DEFAULT_BLOCK_SHAPE[1]  # the scale block's reduction width: every fp8 BLOCK_K
INT4_GROUP = 128  # ``quantize``'s default int4 group: the weights tuned on
WO_OPTIONS = LaunchOptions(reuse_workspace=False)  # what ``torch.ops.moekit.triton_experts_wo`` runs with
# (BLOCK_N, GROUP_M, num_warps, num_stages) of the fp8 tiles above decode heights; BLOCK_K is FP8_GROUP.
FP8_MID = ((128, 1, 4, 3), (128, 8, 4, 4), (128, 8, 8, 3), (64, 1, 4, 4), (256, 8, 8, 3), (64, 8, 4, 5))
FP8_TALL = ((128, 8, 8, 3), (128, 8, 4, 3), (256, 8, 8, 3), (128, 8, 8, 4), (64, 8, 4, 4), (128, 4, 8, 4))
# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of the weight-only tiles above decode heights.
WO_MID = ((64, 128, 1, 4, 3), (128, 64, 8, 4, 3), (64, 64, 8, 4, 4), (128, 128, 8, 8, 3), (32, 128, 1, 4, 4),
          (128, 64, 1, 4, 4))
WO_TALL = ((128, 64, 8, 8, 3), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (128, 64, 8, 4, 4), (64, 64, 8, 4, 4),
           (64, 128, 8, 4, 3))


def quant_block_ms(num_tokens: int, shape: Shape) -> list[int]:
    """Tile heights worth timing: 16 where the path takes its naive shortcut (M*k*4 <= E), else the
    powers of two from half to twice the mean rows per expert, within 16..128."""
    rows = num_tokens * shape.top_k / shape.num_experts
    if num_tokens * shape.top_k * 4 <= shape.num_experts:
        return [16]
    return [b for b in (16, 32, 64, 128) if rows / 2 <= b <= max(2 * rows, 16)] or [128]


def fp8_tiles(block_m: int, which: str) -> list[GemmTile]:
    """fp8 tiles for one GEMM ("up" or "down") at tile height ``block_m``. Decode heights stream weights:
    narrow tiles (down to 16 wide for gate-up) give the few touched experts programs on every SM, and
    deeper pipelines keep loads in flight."""
    if block_m <= 16:
        widths = (16, 32, 64, 128) if which == "up" else (32, 64, 128)
        return [GemmTile(bn, FP8_GROUP, 1, 4, stages) for bn in widths for stages in (3, 4, 5)]
    table = FP8_MID if block_m <= 64 else FP8_TALL
    return [GemmTile(bn, FP8_GROUP, group_m, warps, stages) for bn, group_m, warps, stages in table]


def wo_tiles(block_m: int, which: str) -> list[GemmTile]:
    """Weight-only tiles for one GEMM at tile height ``block_m`` (the same for both GEMMs and every
    scheme). Decode heights: narrow and long, 128 to 256 weight columns of reduction per step."""
    if block_m <= 16:
        return [GemmTile(bn, bk, 1, 4, stages) for bn in (32, 64, 128) for bk, stages in ((128, 4), (256, 3), (256, 4))]
    return [GemmTile(*tile) for tile in (WO_MID if block_m <= 64 else WO_TALL)]


@dataclass(frozen=True)
class Fp8Weights:
    w13: QuantizedWeight  # fp8_block [E, 2N, K]
    w2: QuantizedWeight  # fp8_block [E, K, N]


@dataclass(frozen=True)
class WoWeights:
    w13: WeightArgs  # what the weight-only kernels read of w13 [E, 2N, K]
    w2: WeightArgs  # ... of w2 [E, K, N]


def _quantized(scheme: str, shape: Shape, device: torch.device) -> tuple[QuantizedWeight, QuantizedWeight]:
    """The bench's random bf16 weights of ``shape``, quantized with ``scheme``'s default options."""
    w = make_weights(shape, torch.bfloat16, device)
    return quantize(w.w13, scheme), quantize(w.w2, scheme)


def _group_size(w: QuantizedWeight) -> int:
    """The group size the weight-only kernels take (0: int8's per-row scale)."""
    return w.group_size if isinstance(w, Int4Weight) else MX_BLOCK if isinstance(w, Mxfp4Weight) else 0


def _wo_weight(w: QuantizedWeight) -> WoWeight:
    return WoWeight(w.scheme, w.q, w.scale, getattr(w, "zero", None), _group_size(w))


def _wo_weights(scheme: str, shape: Shape, device: torch.device) -> WoWeights:
    w13, w2 = _quantized(scheme, shape, device)
    return WoWeights(*(weight_args(w.q, w.scale, getattr(w, "zero", None), _group_size(w)) for w in (w13, w2)))


def _check_shape(scheme: str, shape: Shape, device: torch.device) -> None:
    """The path's own argument checks on one zero expert of ``shape`` quantized with ``scheme``, before
    the weights are made: a ValueError or TypeError for a shape it cannot take. Milliseconds on a GPU;
    on the CPU, seconds (mxfp4 at DeepSeek-V3's width: ~20 s)."""
    w13 = quantize(torch.zeros(1, 2 * shape.n, shape.k, dtype=torch.bfloat16, device=device), scheme)
    w2 = quantize(torch.zeros(1, shape.k, shape.n, dtype=torch.bfloat16, device=device), scheme)
    x = torch.zeros(1, shape.k, dtype=torch.bfloat16, device=device)  # [M=1, K]: one token
    ids = torch.zeros(1, 1, dtype=torch.int32, device=device)  # [M, k=1]
    weights = torch.ones(1, 1, device=device)
    if scheme == "fp8_block":
        check_fp8_args(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, "silu", None, w13.block_shape)
    else:
        check_wo_args(x, _wo_weight(w13), _wo_weight(w2), ids, weights, None, "silu")


def _fp8_call(w: Fp8Weights, s: CellInputs, config: KernelConfig) -> torch.Tensor:
    """One call on ``config``'s tiles with its switches (``tuning_switches``; a plain config: none)."""
    switches = switches_of(config)
    return fused_experts_fp8_launch(s.x, w.w13.q, w.w13.scale, w.w2.q, w.w2.scale, s.topk_ids, s.topk_weights,
                                    block_shape=tuple(w.w13.block_shape), config=tiles_of(config),
                                    weight_tma=switches.weight_tma, persistent=switches.persistent,
                                    pair_dot=switches.pair_dot)


def _fp8_validate(config: KernelConfig) -> None:
    check_config(config, FP8_GROUP)


def fp8_scheme() -> TuneScheme:
    return TuneScheme(
        name="fp8_block", x_dtype=torch.bfloat16,
        make_weights=lambda shape, device: Fp8Weights(*_quantized("fp8_block", shape, device)), call=_fp8_call,
        heuristic=lambda m, s: heuristic_fp8_config(m, s.num_experts, s.n, s.k, s.top_k, FP8_GROUP),
        block_ms=quant_block_ms, tiles=fp8_tiles, file_name=fp8_file_name, validate=_fp8_validate,
        check_shape=lambda shape, device: _check_shape("fp8_block", shape, device),
        switches=switch_variants, current=current_fp8,
    )


def wo_scheme(name: str) -> TuneScheme:
    """The weight-only tune name ``name`` (a key of WO_TUNE_NAMES): its scheme with its decode."""
    scheme, decode = WO_TUNE_NAMES[name]
    group = {"int4_w4a16": INT4_GROUP, "mxfp4": MX_BLOCK}.get(scheme, 0)

    def call(w: WoWeights, s: CellInputs, config: KernelConfig) -> torch.Tensor:
        return run_experts_wo(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights, None, scheme, config=config,
                              options=WO_OPTIONS, decode=decode)

    def validate(config: KernelConfig) -> None:
        span(config.up, scheme, group)
        span(config.down, scheme, group)

    return TuneScheme(
        name=name, x_dtype=torch.bfloat16,
        make_weights=lambda shape, device: _wo_weights(scheme, shape, device), call=call,
        heuristic=lambda m, s: wo_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, decode),
        block_ms=quant_block_ms, tiles=wo_tiles,
        file_name=lambda e, n, k, device: config_file_name(e, n, k, name, device), validate=validate,
        check_shape=lambda shape, device: _check_shape(scheme, shape, device),
    )


def quant_scheme(name: str) -> TuneScheme:
    """The ``TuneScheme`` of quantization scheme ``name`` (one of QUANT_SCHEMES)."""
    if name == "fp8_block":
        return fp8_scheme()
    if name in WO_TUNE_NAMES:
        return wo_scheme(name)
    raise ValueError(f"scheme must be one of {QUANT_SCHEMES}, got {name!r}")
