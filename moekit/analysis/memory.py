"""Weight memory of a whole model per storage format, and whether it fits on N GPUs.

Units: GB = 1e9 bytes (what model cards and the tables here print), GiB = 2**30 bytes (what drivers
report and ``gpu_memory_utilization`` multiplies). An "80 GB" H100 holds 79.65 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.analysis.bill_parts import ParamBill
from moekit.analysis.formats import FORMATS, WeightFormat
from moekit.analysis.gpus import GIB, GpuSpec

GB = 1e9
DEFAULT_UTILIZATION = 0.92  # vLLM-style gpu_memory_utilization
# Activations, CUDA graphs and non-torch allocations, per GPU: the seed chapter's §2.1 charge.
DEFAULT_RESERVE_GIB = 6.0


@dataclass(frozen=True)
class MemoryBill:
    """Weight bytes of a model in one format. The matmul weights (attention, dense MLP, routed and
    shared experts) take the format; embedding, output head, router and norms stay bf16, as in the
    published fp8 and int4 checkpoints."""

    dtype: str
    total_bytes: float  # the whole model
    routed_expert_bytes: float  # the routed experts alone, in the format

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def routed_expert_gb(self) -> float:
        return self.routed_expert_bytes / GB


def weight_memory(bill: ParamBill, fmt: WeightFormat) -> MemoryBill:
    """The model's weight bytes with its matmul weights stored in ``fmt``."""
    quantised = bill.in_format
    kept_bf16 = bill.total - quantised
    return MemoryBill(
        dtype=fmt.name,
        total_bytes=quantised * fmt.bytes_per_weight + kept_bf16 * FORMATS["bf16"].bytes_per_weight,
        routed_expert_bytes=_routed(bill) * fmt.bytes_per_weight,
    )


def _routed(bill: ParamBill) -> int:
    """The routed experts, an encoder's too; ERNIE-4.5-VL's second sparse blocks as routed experts (their gates,
    0.07% of them, stored in the format too)."""
    return bill.routed_experts + bill.second_blocks + (_routed(bill.encoder) if bill.encoder else 0)


@dataclass(frozen=True)
class Fit:
    """Weights split evenly over ``num_gpus``, against what each GPU can give to weights plus KV cache."""

    num_gpus: int
    utilization: float  # fraction of capacity the engine may use
    reserve_gib: float  # per GPU, taken off the top for activations, graphs and non-torch memory
    usable_gib: float  # capacity·utilization − reserve: room for weights plus KV, per GPU
    weights_gib: float  # weights per GPU
    headroom_gib: float  # usable − weights: left for the KV cache; negative when it does not fit
    min_gpus: int  # fewest GPUs on which the weights fit (headroom >= 0)

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0


def fit_on_gpus(
    weight_bytes: float, gpu: GpuSpec, num_gpus: int, utilization: float = DEFAULT_UTILIZATION,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
) -> Fit:
    """Does a model of ``weight_bytes`` fit on ``num_gpus`` of ``gpu`` at this utilisation and reserve?"""
    if num_gpus < 1 or not 0.0 < utilization <= 1.0 or reserve_gib < 0:
        raise ValueError(f"need num_gpus >= 1, 0 < utilization <= 1, reserve_gib >= 0; got {num_gpus}, "
                         f"{utilization}, {reserve_gib}")
    usable = gpu.memory_gib * utilization - reserve_gib
    weights = weight_bytes / GIB / num_gpus
    min_gpus = math.ceil(weight_bytes / GIB / usable) if usable > 0 else 0  # 0: fits on no number of GPUs
    return Fit(num_gpus, utilization, reserve_gib, usable, weights, usable - weights, min_gpus)
