"""Host cost of "auto"'s decision at decode, on a CPU-only machine (both "devices" the CPU): per forward, the
plan (``OffloadedMoE._plan`` with the place ``_place`` picks) and the whole ``run_routed``, for "gpu", "auto"
(at M = 1 it plans by "gpu": ``cost.cpu_never_wins``) and "auto" priced per forward as before (``_place``
bypassed: ``plan.plan_forward`` with "auto", its ``split.cpu_room`` check and the CPU rate applied).

    PYTHONPATH=$PWD python benchmarks/offload_auto_host_cpu.py
    PYTHONPATH=$PWD python benchmarks/offload_auto_host_cpu.py --replay [--scale 0.78]

``--replay``: "auto"'s plan at M = 8 and 32 on the bench's streams (the simulator's, skewed and uniform,
25/50/75% of E x L cached, Qwen3-30B-A3B's expert bytes) through the cache what-if (``whatif.replay``, which
calls ``plan.plan_forward`` as the layers do), priced by session 16's H200 costs (2384125; ``--scale``
multiplies their CPU side, as the bench's per-group recalibration does): per cell the mean thread CPU
time of a plan (early fetches' issue left out), apart for forwards that fetched every miss and those that
split, against "gpu"'s plan on the same stream.

E = 128, top-8 (Qwen3-30B-A3B's routing), tiny widths so the experts cost little; the costs are the H200
run's (a5fb310), where no M = 1 forward can put a miss on the CPU. Medians over ``REPEATS`` forwards of a
4-layer stack on a cache of half the experts, the modes interleaved forward by forward.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from moekit import MoE, MoEConfig
from moekit.offload import CpuRate, ExpertCache, MissCosts, OffloadedMoE, whatif
from moekit.routing import route
from moekit.sim.cache import decode_stream

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
        print(f"  {place:<8} {statistics.median(plans[place]) * 1e6:6.1f} | "
              f"{statistics.median(forwards[place]) * 1e6:7.1f}")


H200 = MissCosts(link_bytes_per_s=52.95e9, cpu_expert_s=0.438e-3, cpu_token_s=10.3e-6, cpu_step_s=1.776e-3,
                 gpu_bytes_per_s=3.75e12, cpu_margin=1.219, hysteresis=0.05, gpu_call_s=0.125e-3,
                 fetch_layer_s=0.232e-3, issue_s=68.5e-6, link_cpu_bytes_per_s=51.1e9,
                 cpu_rows_s=((1, 448e-6), (2, 491e-6), (4, 468e-6), (8, 606e-6), (16, 572e-6), (32, 768e-6)))


def replay_plans(scale: float) -> None:
    """``--replay`` (module docstring)."""
    costs, expert_bytes, real, plans = H200.scaled(scale), 3 * 2048 * 768 * 2, whatif.plan_forward, []

    def timed(cache, layer, place, tokens, hits, nbytes, c, admit=None, issue=None):
        early = [0.0]

        def timed_issue(experts):
            clock = time.thread_time()
            issue(experts)
            early[0] += time.thread_time() - clock

        start = time.thread_time()
        plan = real(cache, layer, place, tokens, hits, nbytes, c, admit, timed_issue if issue else None)
        plans.append((time.thread_time() - start - early[0], bool(plan.cpu)))
        return plan

    whatif.plan_forward = timed
    print(f"auto's plan on the replay, H200 costs x{scale} on the CPU side; thread CPU us a plan (mean): "
          f"fetch-all forwards (n) | split forwards (n) | gpu's plan")
    for stream, skew in (("skewed", 0.3), ("uniform", 0.0)):
        for m in (8, 32):
            data = decode_stream(128, 8, 4, 60, m, skew, 0.3, seed=3)
            for fraction in (0.25, 0.5, 0.75):
                took = {}
                for place in ("gpu", "auto"):
                    plans.clear()
                    whatif.replay(data.trace, round(fraction * 512), "lfu", None, place=place, costs=costs,
                                  expert_bytes=expert_bytes, measure_from=17)
                    took[place] = list(plans)
                fetch = [t for t, split in took["auto"] if not split]
                split = [t for t, split in took["auto"] if split]
                print(f"  {stream:<7} {fraction:.0%} M = {m:2d}: {_mean_us(fetch):7.1f} ({len(fetch):3d}) | "
                      f"{_mean_us(split):7.1f} ({len(split):3d}) | {_mean_us([t for t, _ in took['gpu']]):5.1f}")
    whatif.plan_forward = real


def _mean_us(times: list[float]) -> float:
    return statistics.fmean(times) * 1e6 if times else 0.0


if __name__ == "__main__":
    if "--replay" in sys.argv:
        replay_plans(float(sys.argv[sys.argv.index("--scale") + 1]) if "--scale" in sys.argv else 1.0)
    else:
        main()
