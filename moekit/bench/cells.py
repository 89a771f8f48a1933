"""What one benchmark cell is: a shape, a batch M, a weight dtype, a backend; its inputs, the byte model it
is held to, and what it measured (``Cell``).

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.

Compulsory bytes = touched experts x the bytes of one expert (3*N*K weights, each read once; quantized:
the packed values plus their scales and zero points) + activations (x read, out written). FLOPs =
6*N*K per routed assignment. Both formulas are the byte model's (``moekit.analysis.roofline``). The
floor is max(bytes / copy bandwidth, FLOPs / matmul rate of the GEMMs' compute dtype): no
implementation runs much faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.analysis.roofline import activation_bytes, expert_flops, expert_weight_bytes
from moekit.analysis.touch import experts_touched_from_counts
from moekit.config import MoEConfig
from moekit.routing import Routing

# The presets: moekit preset names whose routed experts (E, N, K, k) the bench sweeps.
PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
GPU_BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384)
CPU_BATCHES = (1, 8, 32, 128, 512)
CPU_SCALE = 16  # CPU mode divides N and K by this, so the sweep stays in memory and in minutes


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int  # E
    n: int  # N
    k: int  # K (hidden)
    top_k: int

    @classmethod
    def from_preset(cls, name: str, scale: int = 1) -> "Shape":
        if name not in PRESETS:
            raise ValueError(f"shape must be one of {list(PRESETS)}, got {name!r}")
        c = MoEConfig.preset(name)
        return cls(name if scale == 1 else f"{name}/{scale}", c.num_experts, c.moe_intermediate_size // scale,
                   c.hidden_size // scale, c.top_k)

    def expert_bytes(self, element_size: int) -> float:
        """Bytes of one expert's w13 and w2."""
        return expert_weight_bytes(1, self.k, self.n, element_size)


@dataclass(frozen=True)
class ExpertWeights:
    """Random expert weights of one shape, scaled so each GEMM keeps unit variance."""

    w13: torch.Tensor  # [E, 2N, K]: gate rows, then up rows
    w2: torch.Tensor  # [E, K, N]


@dataclass(frozen=True)
class CellInputs:
    """One input set of a cell: tokens and their uniform routing (a cell rotates over several)."""

    x: torch.Tensor  # [M, K] tokens
    topk_ids: torch.Tensor  # [M, k] int32, k distinct experts per token
    topk_weights: torch.Tensor  # [M, k] float32, each row sums to 1


def make_weights(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ExpertWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(shape.num_experts, 2 * shape.n, shape.k, device=device, dtype=dtype, generator=g) * shape.k**-0.5
    w2 = torch.randn(shape.num_experts, shape.k, shape.n, device=device, dtype=dtype, generator=g) * shape.n**-0.5
    return ExpertWeights(w13, w2)


def uniform_routing(num_tokens: int, shape: Shape, device: torch.device, seed: int) -> Routing:
    """Each token picks k distinct experts uniformly at random (fixed seed); softmax-normalised weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, shape.num_experts, device=device, generator=g)
    ids = scores.topk(shape.top_k, dim=1).indices.int()  # [M, k]
    weights = torch.softmax(torch.rand(num_tokens, shape.top_k, device=device, generator=g), dim=1)  # [M, k]
    return Routing(ids, weights)


def make_sets(shape: Shape, num_tokens: int, num_sets: int, dtype, device, seed: int = 0) -> list[CellInputs]:
    sets = []
    for i in range(num_sets):
        g = torch.Generator(device=device).manual_seed(seed * 1000 + i)
        x = torch.randn(num_tokens, shape.k, device=device, dtype=dtype, generator=g)
        routing = uniform_routing(num_tokens, shape, device, seed * 1000 + i)
        sets.append(CellInputs(x, routing.topk_ids, routing.topk_weights))
    return sets


def measured_experts_touched(ids: torch.Tensor, num_experts: int) -> int:
    """Distinct experts the routing ``ids`` [M, k] sends tokens to (``analysis.touch.experts_touched`` is
    the expectation of this under uniform routing)."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)  # [E]
    return experts_touched_from_counts(counts.cpu().numpy())


@dataclass(frozen=True)
class CellModel:
    """The byte model of one call of one cell."""

    bytes: float  # compulsory: touched·expert_bytes + 2·M·K·element_size
    flops: float  # 6·N·K·M·k
    floor_us: float  # max(bytes / copy bandwidth, flops / matmul rate)


def cell_model(shape: Shape, num_tokens: int, touched: float, element_size: int, copy_TBps: float,
               mm_TFLOPs: float, expert_bytes: float | None = None) -> CellModel:
    """Bytes, FLOPs and floor of one call with ``touched`` experts read, on the measured ceilings.
    ``element_size``: bytes of one activation element (x read, out written); ``expert_bytes``: what one
    touched expert's w13 + w2 stream, scales and zero points included (default: 3·N·K unquantized
    weights of ``element_size`` bytes); ``mm_TFLOPs``: the matmul rate of the GEMMs' compute dtype."""
    if expert_bytes is None:
        expert_bytes = shape.expert_bytes(element_size)
    nbytes = touched * expert_bytes + activation_bytes(num_tokens, shape.k, element_size)
    flops = expert_flops(num_tokens, shape.top_k, shape.k, shape.n)
    floor_us = max(nbytes / (copy_TBps * 1e12), flops / (mm_TFLOPs * 1e12)) * 1e6
    return CellModel(nbytes, flops, floor_us)


@dataclass
class Cell:
    """One measured cell: a shape, a batch M, a weight dtype, a backend; its times and its floor."""

    shape: str
    M: int
    backend: str
    # the expert weights: the activation dtype when unquantized (bfloat16; float32 on the CPU), else the moekit.quant
    # scheme
    dtype: str
    us: float  # median µs per call (graph replay where ``graph``, else events / wall clock)
    min_us: float  # fastest of the timed passes, µs per call
    max_us: float  # slowest of the timed passes, µs per call
    spread_pct: float  # interquartile range of the passes / us * 100
    noisy: bool  # spread_pct > timing.NOISY_SPREAD_PCT: the median is not to be trusted to 10%
    repeats: int  # passes timed (>= 5)
    eager_us: float  # back-to-back eager calls, one sync at the end, per call (on the CPU: = us)
    host_us: float  # the host's time to issue those calls, before the sync, per call (on the CPU: = us)
    experts_touched: float  # mean over the rotated routings
    bytes: float  # compulsory bytes of one call: touched experts' packed weights + scales/zeros, x and out
    flops: float  # 6*N*K*M*k
    floor_us: float  # max(bytes / copy BW, flops / matmul rate of mm_dtype)
    pct_floor: float  # floor_us / us * 100
    pct_copy_bw: float  # achieved bytes/s over the measured copy bandwidth * 100
    tflops: float  # achieved 1e12 FLOP/s
    pct_mm: float  # achieved FLOP/s over the measured matmul rate of mm_dtype * 100
    graph: bool  # timed as CUDA-graph replay
    mm_dtype: str  # the measured matmul rate the floor and pct_mm use: fp8 for fp8_block, else the dense one
    # host_us over the calls after each loop's first (the steady issue cost; on the CPU: = us)
    host_rest_us: float = 0.0
    rel_err_vs_grouped_mm: float | None = None  # sanity check on the first input set (triton only)
    vs_bf16: float | None = None  # quantized cells: us / the unquantized cell's us (same shape, M, backend)
    rel_err_vs_bf16: float | None = None  # quantized cells: relative L2 of the output vs the unquantized one, first set
    # the tuned file the launch config came from (``config_source``): "NVIDIA_H200", "NVIDIA_H200 (sibling)",
    # "heuristic"; None where not said (other backends, the weight-only schemes)
    config: str | None = None
