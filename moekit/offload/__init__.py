"""Experts that do not fit on the GPU: host-resident routed experts behind a GPU expert cache.

    OffloadedMoE.from_moe(moe, cache_experts=C)       one layer, its own cache of C expert slots
    cache = ExpertCache(C, device="cuda")              a model's budget, shared by its layers:
    layers = [OffloadedMoE.from_moe(m, cache=cache) for m in moes]; link_layers(layers)   (prefetch)
    OffloadedMoE.from_moe(hash_moe, ...)               a HashMoE's: an OffloadedHashMoE, called with token_ids

Quantized experts (``MoE.quantize_``, fp8 checkpoints) are offloaded packed: host copy, slots and
fetches hold their q / scale (/ zero) tensors, and ``expert_nbytes(moe)`` is the packed size of one.

``whatif`` replays a routing trace through the cache policies without weights (the simulator's
cache what-if); ``cost`` prices a forward's misses and ``plan`` decides where they run; ``online``
(``CpuRate``) keeps how much slower or faster than calibrated the CPU branches ran (a scale of the whole
CPU model), for "auto" to price by.
"""

from moekit.offload.bandwidth import measure_link_bandwidth, measure_read_bandwidth
from moekit.offload.cache import ExpertCache
from moekit.offload.cpu_path import CpuOptions, CpuPhases
from moekit.offload.cost import MissCosts, MissSplit, gpu_only
from moekit.offload.layer import OffloadedMoE, expert_nbytes, link_layers
from moekit.offload.layer_hash import OffloadedHashMoE
from moekit.offload.online import CpuRate
from moekit.offload.plan import MissPlan, plan_misses
from moekit.offload.policy import POLICIES, EvictionPolicy
from moekit.offload.split import split_misses
from moekit.offload.stats import OffloadStats
from moekit.offload.trace import Mark, StepTrace

__all__ = [
    "CpuOptions", "CpuPhases", "CpuRate", "ExpertCache", "EvictionPolicy", "Mark", "MissCosts", "MissPlan", "MissSplit",
    "OffloadStats",
    "OffloadedHashMoE", "OffloadedMoE", "POLICIES", "StepTrace",
    "expert_nbytes", "gpu_only", "link_layers", "measure_link_bandwidth", "measure_read_bandwidth", "plan_misses",
    "split_misses",
]
