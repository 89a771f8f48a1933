"""Host cost of "auto"'s decision at decode, on a CPU-only machine (both "devices" the CPU): per forward, the
plan (``OffloadedMoE._plan`` with the place ``_place`` picks) and the whole ``run_routed``, for "gpu", "auto"
(at M = 1 it plans by "gpu": ``cost.cpu_never_wins``) and "auto" priced per forward as before (``_place``
bypassed: ``plan.plan_forward`` with "auto", its ``split.cpu_room`` check and the CPU rate applied).

    PYTHONPATH=$PWD python benchmarks/offload_auto_host_cpu.py

E = 128, top-8 (Qwen3-30B-A3B's routing), tiny widths so the experts cost little; the costs are the H200
run's (a5fb310), where no M = 1 forward can put a miss on the CPU. Medians over ``REPEATS`` forwards of a
4-layer stack on a cache of half the experts, the modes interleaved forward by forward.
"""

from __future__ import annotations

import statistics
import time

import torch

from moekit import MoE, MoEConfig
from moekit.offload import CpuRate, ExpertCache, MissCosts, OffloadedMoE
from moekit.routing import route

REPEATS = 400
COSTS = MissCosts(link_bytes_per_s=55.0e9, cpu_expert_s=483e-6, cpu_token_s=22e-6, cpu_step_s=1.868e-3,
                  gpu_bytes_per_s=3.76e12, cpu_margin=1.137, hysteresis=0.05, gpu_call_s=152e-6, fetch_layer_s=256e-6,
                  cpu_rows_s=((1, 505e-6), (2, 464e-6), (4, 522e-6), (8, 691e-6)))


def stack(place: str, moes: list[MoE]) -> list[OffloadedMoE]:
    cache = ExpertCache(len(moes) * 64, device="cpu", policy="lfu")
    rate = CpuRate() if place != "gpu" else None
    return [OffloadedMoE.from_moe(m, cache=cache, prefetch=None, compute_misses_on=place if place != "auto-old"
                                  else "auto", costs=COSTS, cpu_rate=rate) for m in moes]


def main() -> None:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=128, top_k=8)
    moes = [MoE(config, backend="grouped_mm", router="torch") for _ in range(4)]
    stacks = {place: stack(place, moes) for place in ("gpu", "auto", "auto-old")}
    for layer in stacks["auto-old"]:
        layer._place = lambda m, _layer=layer: _layer.compute_misses_on  # the per-forward pricing, as before
    plans = {place: [] for place in stacks}
    forwards = {place: [] for place in stacks}
    for place, layers in stacks.items():
        for layer in layers:
            plan = layer._plan

            def timed(tokens, hits, where, issue=None, _plan=plan, _out=plans[place]):
                start = time.perf_counter()
                out = _plan(tokens, hits, where, issue)
                _out.append(time.perf_counter() - start)
                return out

            layer._plan = timed
    gen = torch.Generator().manual_seed(1)
    for _ in range(REPEATS):
        x = torch.randn(1, 64, generator=gen)
        routing = route(moes[0].gate(x), config)
        for place, layers in stacks.items():
            start = time.perf_counter()
            for layer in layers:
                layer.run_routed(x, routing)
            forwards[place].append((time.perf_counter() - start) / len(layers))
    print(f"M = 1, E = 128, top-8, 4 layers, {REPEATS} steps; host us per layer forward (median): plan | run_routed")
    for place in stacks:
        print(f"  {place:<8} {statistics.median(plans[place]) * 1e6:6.1f} | {statistics.median(forwards[place]) * 1e6:7.1f}")


if __name__ == "__main__":
    main()
