"""``moekit bench --offload``: decode through a stack of offloaded layers whose experts exceed the GPU budget.

    [measure: host->GPU link, CPU expert rate] -> [L layers, one pinned host weight set, a shared
    ExpertCache of C = fraction x E x L slots] -> [per step: every layer's run_routed on the
    simulator's routing] -> step time vs the byte model's floor at the measured hit rate

Routing comes from the simulator's synthetic routers (uniform and skewed), one per layer, so every
configuration replays the same stream. The layers share one host weight set (their experts would
differ in a real model; here it keeps host memory at one layer's worth); the cache keys them apart.
The floor per step, from the measured touched and missed experts: misses fetched: sum over layers of
max(touched bytes / copy BW, missed bytes / link); misses on the CPU: max(hit bytes / copy BW, CPU
tokens x 6NK / CPU rate), bytes per expert the packed ones for a quantized scheme; "auto" is held to the better of the two pure configurations measured.

Shapes: E experts, K hidden, N intermediate, k top-k, M tokens per step, L layers, C cache slots.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from moekit.bench.ceilings import measure_ceilings
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.offload import (
    ExpertCache, MissCosts, OffloadedMoE, expert_nbytes, link_layers, measure_cpu_costs, measure_link_bandwidth,
)
from moekit.offload.whatif import RoutingTrace, replay
from moekit.quant import install_quantized_experts_, quantize
from moekit.routing import Routing
from moekit.sim.router import draw_tokens, make_router

STREAMS = {"uniform": 0.0, "skewed": 0.6}


@dataclass(frozen=True)
class OffloadRow:
    stream: str  # "uniform" or "skewed" (the simulator's router skew)
    cache_fraction: float  # C / (E x L)
    policy: str
    compute_misses_on: str
    M: int
    step_ms: float  # median wall time of one decode step through all L layers
    floor_ms: float  # the byte model's floor at the measured touched / hit counts
    hit_rate: float  # measured over the timed steps
    sim_hit_rate: float  # the cache what-if's prediction for the same stream, policy and size (misses fetched)
    fetched_per_step: float
    cpu_tokens_per_step: float
    tok_s: float


def measure_offload(device: torch.device, *, experts=256, hidden=7168, inter=2048, top_k=8, layers=2,
                    batches=(1, 8, 32), fractions=(0.25, 0.5, 0.75), policies=("lfu",), places=("gpu", "cpu", "auto"),
                    streams=tuple(STREAMS), steps=8, warm_steps=4, scheme: str | None = None, on_progress=None) -> dict:
    """Every (stream, fraction, policy, place, M); returns the document ``moekit bench --offload`` writes.
    ``streams``: names in ``STREAMS``. ``scheme``: a ``moekit.quant`` scheme for the experts (kept packed
    on the host, in the slots and over the link); None: float experts (bf16 on CUDA, float32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    costs = MissCosts(measure_link_bandwidth(device), *measure_cpu_costs(inter, hidden, dtype, scheme=scheme))
    copy_bw = measure_ceilings(device).copy_TBps * 1e12 / 2 if device.type == "cuda" else costs.link_bytes_per_s
    config = MoEConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, top_k=top_k)
    shell = _host_shell(config, dtype, device, scheme)
    rows = []
    for stream, skew in ((name, STREAMS[name]) for name in streams):
        for m in batches:
            trace = _routing(config, layers, warm_steps + steps, m, skew, device)
            for fraction in fractions:
                slots = max(1, round(fraction * experts * layers))
                for policy in policies:
                    sim = _predicted_hit_rate(_as_trace(trace, experts), slots, policy, warm_steps)
                    for place in places:
                        row = _one(shell, config, trace, slots, policy, place, m, warm_steps, costs, copy_bw, device)
                        rows.append(OffloadRow(stream, fraction, policy, place, m, sim_hit_rate=sim, **row))
                        if on_progress:
                            on_progress(rows[-1])
    prefetch = _prefetch_rows(shell, config, layers, batches, fractions[0], policies[0], steps, warm_steps, device)
    return {"prefetch_rows": prefetch, "link_GBps": costs.link_bytes_per_s / 1e9, "cpu_expert_us": costs.cpu_expert_s * 1e6,
            "cpu_token_us": costs.cpu_token_s * 1e6,
            "hbm_read_GBps": copy_bw / 1e9, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
            "layers": layers, "dtype": scheme or str(dtype).removeprefix("torch."), "expert_bytes": expert_nbytes(shell),
            "rows": [asdict(r) for r in rows]}


def _host_shell(config: MoEConfig, dtype, device, scheme: str | None = None) -> MoE:
    """A CPU ``MoE`` whose expert weights are one host set (pinned on CUDA), filled in chunks on ``device``;
    with a ``scheme``, quantized chunk by chunk on ``device`` and kept packed (never a float copy of the layer)."""
    shell = MoE(config, num_local_experts=0, dtype=dtype, device="cpu", fuse_shared=False, router="torch")
    e, n, k = config.num_experts, config.moe_intermediate_size, config.hidden_size
    weights = [_host_weight((e, 2 * n, k), dtype, device, scheme), _host_weight((e, k, n), dtype, device, scheme)]
    if scheme is None:
        shell.w13, shell.w2 = (torch.nn.Parameter(w, requires_grad=False) for w in weights)
    else:
        install_quantized_experts_(shell, *weights)
    return shell


def _host_weight(shape: tuple[int, int, int], dtype, device, scheme: str | None, chunk: int = 16):
    """Random [E, R, C] weights (std 1/sqrt(C)) in host memory (pinned on CUDA), float or packed."""
    pin, e = device.type == "cuda", shape[0]
    out, parts = None, {}
    for i in range(0, e, chunk):
        w = torch.randn((min(chunk, e - i), *shape[1:]), device=device, dtype=dtype) * shape[-1] ** -0.5
        q = w if scheme is None else quantize(w, scheme)
        tensors = {"w": q} if scheme is None else q.tensors()
        if out is None:
            parts = {name: torch.empty((e, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for name, t in tensors.items()}
            out = q
        for name, t in tensors.items():
            parts[name][i:i + t.shape[0]].copy_(t)
    return parts["w"] if scheme is None else dataclasses.replace(out, **parts)


def _share_experts(dst: MoE, shell: MoE) -> None:
    """``dst`` computes with ``shell``'s host expert weights (no copy)."""
    if shell.quant_scheme is None:
        dst.w13, dst.w2 = shell.w13, shell.w2
    else:
        install_quantized_experts_(dst, shell.w13, shell.w2)


def _routing(config, layers, steps, m, skew, device) -> list[list[Routing]]:
    """[step][layer] routings of ``m`` tokens from one synthetic router per layer (seeded)."""
    routers = [make_router(config.num_experts, config.top_k, skew, seed=11 + layer) for layer in range(layers)]
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = draw_tokens(m, config.num_experts, gen)
        per_layer = []
        for router in routers:
            r = router.route(x)
            per_layer.append(Routing(r.topk_ids.to(device), r.topk_weights.to(device)))
        out.append(per_layer)
    return out


def _as_trace(trace: list[list[Routing]], experts: int) -> RoutingTrace:
    touched = [[sorted(set(r.topk_ids.flatten().tolist())) for r in step] for step in trace]
    return RoutingTrace(experts, touched, [[[] for _ in step] for step in trace])


def _prefetch_rows(shell, config, layers, batches, fraction, policy, steps, warm_steps, device) -> list[dict]:
    """Prefetch None / "previous" / "router" through layers that route with their own gates: sigmoid
    scores with a Zipf popularity bias (a skewed stream), each layer's input its predecessor's plus a
    little noise (a residual stream), misses fetched. Hit rate and step time per prediction."""
    skewed = config.replace(scoring="sigmoid", use_correction_bias=True)
    rows = []
    for m in batches:
        for prediction in (None, "previous", "router"):
            cache = ExpertCache(max(1, round(fraction * config.num_experts * layers)), device=device, policy=policy)
            stack = []
            for layer in range(layers):
                torch.manual_seed(100 + layer)
                gated = MoE(skewed, num_local_experts=0, dtype=shell.w13.dtype, device="cpu", fuse_shared=False,
                            router="torch")
                rank = torch.randperm(config.num_experts) + 1
                gated.e_score_correction_bias.copy_(-0.05 * torch.log(rank.float()))  # Zipf popularity
                _share_experts(gated, shell)
                stack.append(OffloadedMoE.from_moe(gated, cache=cache, prefetch=prediction))
            link_layers(stack)
            gen = torch.Generator(device=device).manual_seed(5)
            times, before = [], None
            for step in range(warm_steps + steps):
                if step == warm_steps:
                    before = dict(cache.stats.as_dict())
                x = torch.randn(m, config.hidden_size, device=device, dtype=shell.w13.dtype, generator=gen)
                _sync(device)
                start = time.perf_counter()
                for layer in stack:
                    layer(x)
                    x = x + 0.3 * torch.randn(x.shape, device=device, dtype=x.dtype, generator=gen)
                _sync(device)
                times.append(time.perf_counter() - start)
            after = cache.stats.as_dict()
            touched, hits = after["touched"] - before["touched"], after["hits"] - before["hits"]
            rows.append({"M": m, "prefetch": prediction or "none", "hit_rate": hits / max(touched, 1),
                         "step_ms": statistics.median(times[warm_steps:]) * 1e3,
                         "prefetch_accuracy": after["prefetch_used"] / max(after["prefetched"], 1)})
    return rows


def _predicted_hit_rate(trace: RoutingTrace, slots: int, policy: str, warm_steps: int) -> float:
    """The what-if's hit rate over the timed steps (the replay of the warm steps subtracted): every
    miss fetched, as ``compute_misses_on="gpu"`` runs."""
    warm = RoutingTrace(trace.num_experts, trace.touched[:warm_steps], trace.predicted[:warm_steps])
    full, before = replay(trace, slots, policy), replay(warm, slots, policy)
    return (full.hits - before.hits) / max(full.touched - before.touched, 1)


def _one(shell, config, trace, slots, policy, place, m, warm_steps, costs, copy_bw, device) -> dict:
    cache = ExpertCache(slots, device=device, policy=policy)
    layers = [OffloadedMoE.from_moe(shell, cache=cache, prefetch=None, compute_misses_on=place, costs=costs)
              for _ in trace[0]]
    x = torch.randn(m, config.hidden_size, device=device, dtype=shell.w13.dtype)
    times, totals = [], None
    for step, routings in enumerate(trace):
        if step == warm_steps:
            totals = dict(cache.stats.as_dict())
        _sync(device)
        start = time.perf_counter()
        for layer, routing in zip(layers, routings):
            layer.run_routed(x, routing)
        _sync(device)
        if step >= warm_steps:
            times.append(time.perf_counter() - start)
    timed = {key: cache.stats.as_dict()[key] - totals[key] for key in ("touched", "hits", "fetched", "cpu_experts", "cpu_tokens")}
    steps = len(times)
    expert_bytes = expert_nbytes(shell)  # packed bytes for a quantized scheme
    gpu_s = (timed["hits"] + timed["fetched"]) * expert_bytes / copy_bw
    cpu_s = timed["cpu_experts"] * costs.cpu_expert_s + timed["cpu_tokens"] * costs.cpu_token_s
    floor = max(gpu_s, timed["fetched"] * expert_bytes / costs.link_bytes_per_s, cpu_s) / steps
    step_s = statistics.median(times)
    return {"step_ms": step_s * 1e3, "floor_ms": floor * 1e3,
            "hit_rate": timed["hits"] / max(timed["touched"], 1), "fetched_per_step": timed["fetched"] / steps,
            "cpu_tokens_per_step": timed["cpu_tokens"] / steps, "tok_s": m / step_s}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
