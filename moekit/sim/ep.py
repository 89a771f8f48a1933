"""Expert-parallelism what-if: place the experts on G GPUs and price the step.

    per-expert loads [E] -> placement (moekit.parallel.placement) -> rank loads [G] -> step time

Cost model (stated, deliberately simple): a GPU's time in one MoE layer is the assignments its experts
process × ``shape.seconds_per_assignment()`` (compute-bound grouped GEMM at the dense bf16 peak; no
all-to-all, no weight streaming, no padding). The step ends when the busiest GPU ends, so
step time = max over GPUs; perfectly balanced = mean over GPUs. Throughput lost to imbalance =
1 - mean/max = 1 - balancedness: a 2× imbalance (max = 2·mean) loses 50%.

Placements: contiguous (GPU r holds a run of experts), round-robin (expert e on GPU e mod G), and EPLB
(``eplb_placement`` with ``spare_slots`` replicas of the hottest experts; a replica takes an even share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moekit.parallel.eplb import eplb_placement
from moekit.parallel.placement import (
    Placement,
    balancedness,
    contiguous_placement,
    rank_loads,
    round_robin_placement,
)
from moekit.sim.shape import EP_DTYPE, EP_GPU, StatedModel, seconds_per_assignment


def cost_model(model: StatedModel | None = None) -> str:
    """The cost model in words, stated from ``moekit.sim.shape`` so the text follows its constants; ``model``: the
    expert priced (default Mixtral's)."""
    name = "Mixtral" if model is None else model.name
    return (f"GPU time = assignments on its experts × 6·d·d_ff FLOPs at the {EP_GPU.upper()}'s dense {EP_DTYPE} "
            f"peak ({name} expert: {seconds_per_assignment(model) * 1e6:.2f} µs each); step = max over GPUs; "
            "communication not modelled")


@dataclass
class PlacementReport:
    """One placement priced under the cost model."""

    name: str  # "contiguous", "round-robin" or "eplb"
    slots: list[list[int]]  # slots[g] = experts held by GPU g
    gpu_loads: list[float]  # assignments processed per GPU (a replica's share split evenly)
    step_time_us: float  # max over GPUs
    balanced_time_us: float  # mean over GPUs: the step if the work were spread perfectly
    imbalance: float  # max / mean of gpu_loads (1.0 = balanced)
    throughput_lost: float  # 1 - mean/max: fraction of the fleet's time spent idle


@dataclass
class EPReport:
    """The what-if for one batch's per-expert loads."""

    gpus: int  # G
    spare_slots: int  # replicas EPLB may add
    cost_model: str
    placements: list[PlacementReport]  # contiguous, round-robin, eplb
    replication_gain: float  # contiguous step time / EPLB step time (1.0 = no gain)


def price_placement(name: str, placement: Placement, loads: Sequence[float], seconds: float) -> PlacementReport:
    """``placement`` of ``loads`` [E] priced at ``seconds`` an assignment."""
    per_gpu = rank_loads(placement, loads)
    peak, mean = max(per_gpu), sum(per_gpu) / len(per_gpu)
    balance = balancedness(per_gpu)
    return PlacementReport(
        name=name,
        slots=[list(s) for s in placement.slots],
        gpu_loads=per_gpu,
        step_time_us=peak * seconds * 1e6,
        balanced_time_us=mean * seconds * 1e6,
        imbalance=1.0 / balance,
        throughput_lost=1.0 - balance,
    )


def ep_what_if(loads: Sequence[float], gpus: int, spare_slots: int, model: StatedModel | None = None) -> EPReport:
    """Price contiguous, round-robin and EPLB placements of ``loads`` [E] on ``gpus`` GPUs, each assignment at
    ``model``'s expert (default Mixtral's)."""
    num_experts, seconds = len(loads), seconds_per_assignment(model)
    reports = [
        price_placement("contiguous", contiguous_placement(num_experts, gpus), loads, seconds),
        price_placement("round-robin", round_robin_placement(num_experts, gpus), loads, seconds),
        price_placement("eplb", eplb_placement(loads, gpus, spare_slots), loads, seconds),
    ]
    eplb_time = reports[2].step_time_us
    gain = reports[0].step_time_us / eplb_time if eplb_time > 0 else 1.0
    return EPReport(gpus=gpus, spare_slots=spare_slots, cost_model=cost_model(model), placements=reports,
                    replication_gain=gain)
