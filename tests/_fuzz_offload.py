"""Offloaded layers (``moekit.offload.OffloadedMoE``) on the fuzzer's cases against the float64 loop of
``_fuzz_reference``: what ``test_fuzz_offload`` asserts and ``benchmarks/fuzz_layer.py --offload`` counts.

    case -> two MoE layers (the case's, and one of the next seed's weights) -> OffloadedMoE.from_moe on one shared
    ExpertCache of C slots (C below the experts a batch touches: rounds), linked (prefetch) -> FORWARDS batches in
    a row, each through both layers (cache state carried over) -> each output against the reference routed from
    that call's own logits

On the CPU both "devices" are the CPU (the cache's documented test mode: copies plain and synchronous). Options from
the seed's own stream: C, the policy (lru / lfu), prefetch (None / router / previous), where misses run (gpu / cpu /
auto with fixed costs), admissions per forward, and whether both layers go through torch.save / torch.load (the whole
modules, sharing their cache) after the first batch. The plain layer's backend is grouped_mm or reference.

Shapes: M tokens, K hidden, E routed experts, C cache slots.
"""

from __future__ import annotations

import dataclasses
import io
import random
from dataclasses import dataclass

import torch

from _fuzz_cases import FuzzCase, build
from _fuzz_check import Outcome, check_output
from _fuzz_reference import LayerWeights, reference_moe
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, link_layers

FORWARDS = 3  # batches in a row: hits, evictions and prefetches of the earlier ones reach the later ones
FLOAT64_PARTIALS = 1e-6
COSTS = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" mixes gpu and cpu misses


@dataclass
class OffloadOptions:
    cache_experts: int  # C: shared by the two layers, below their touched experts where E allows
    policy: str  # "lru" / "lfu"
    prefetch: str | None  # None / "router" / "previous"
    compute_misses_on: str  # "gpu" / "cpu" / "auto"
    admit_per_forward: int | None
    backend: str  # the plain layer's: "grouped_mm" / "reference"
    pickled: bool  # after the first batch, both layers through torch.save / torch.load (one new, empty cache)


def offload_options(case: FuzzCase) -> OffloadOptions:
    rng = random.Random(f"offload{case.seed}")
    e = case.config.num_experts
    return OffloadOptions(cache_experts=rng.randint(1, max(1, e - 1)), policy=rng.choice(["lru", "lfu"]),
                          prefetch=rng.choice([None, "router", "previous"]),
                          compute_misses_on=rng.choice(["gpu", "cpu", "auto"]),
                          admit_per_forward=rng.choice([None, 0, 1]),
                          backend=rng.choice(["grouped_mm", "reference"]), pickled=rng.random() < 0.3)


def offloadable(case: FuzzCase) -> bool:
    """Cases with tokens and without NaN gate rows (a forward that raises tells nothing of the cache)."""
    return case.m > 0 and not case.nan_gate_rows


def _layers(case: FuzzCase, opts: OffloadOptions):
    """The case's plain layer and the next seed's weights on the same config (the second of the stack)."""
    first, _ = build(case, opts.backend)
    second, _ = build(dataclasses.replace(case, seed=case.seed + 100_000), opts.backend)
    return first, second


def check_offload(case: FuzzCase, result: Outcome) -> OffloadOptions | None:
    """Both offloaded layers, FORWARDS batches in a row, against the float64 loop; None where not offloadable."""
    if not offloadable(case):
        return None
    opts = offload_options(case)
    plain = _layers(case, opts)
    cache = ExpertCache(opts.cache_experts, device="cpu", policy=opts.policy)
    try:
        layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch=opts.prefetch, costs=COSTS,
                                        compute_misses_on=opts.compute_misses_on,
                                        admit_per_forward=opts.admit_per_forward) for m in plain]
    except (TypeError, ValueError) as err:
        result.refusals += 1
        result.fail(f"offload: from_moe raised {type(err).__name__}: {err}")
        return opts
    link_layers(layers)
    g = torch.Generator().manual_seed(case.seed + 7)
    for step in range(FORWARDS):
        if step == 1 and opts.pickled:
            layers = _saved_and_loaded(layers)
        for depth, (off, moe) in enumerate(zip(layers, plain)):
            # each layer a fresh x [M, K] of the case's scale: a layer's output as the next input compounds the
            # dtype's rounding and overflows fp16; the cache and the prefetch see the same sequence of calls
            x = (torch.randn(case.m, case.config.hidden_size, generator=g) * case.x_scale).to(case.dtype)
            try:
                with torch.no_grad():
                    call = off.eval()(x, return_stats=True)
            except (TypeError, ValueError) as err:
                if "float64" in str(err) or "memory_budget_bytes" in str(err):  # the backend's own refusals
                    result.refusals += 1
                    return opts
                result.fail(f"offload: forward {step} layer {depth} raised {type(err).__name__}: {err}")
                return opts
            _check_call(case, moe, x, call, f"offload {opts}: forward {step} layer {depth}", result)
    return opts


def _saved_and_loaded(layers: list[OffloadedMoE]) -> list[OffloadedMoE]:
    buf = io.BytesIO()
    torch.save(layers, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _check_call(case: FuzzCase, moe, x: torch.Tensor, call, what: str, result: Outcome) -> None:
    """One offloaded call against the plain layer's weights in the float64 loop, routed from the call's logits."""
    fp8 = moe.w13.block_shape[1] if case.scheme == "fp8_block" else None
    ref = reference_moe(LayerWeights.of(moe), case.config, x, call.router_logits.double(),
                        capacity_factor=case.capacity_factor, drop_policy=case.drop_policy, fp8_block=fp8)
    if case.capacity_factor is not None and (ref.capacity_ambiguous or ref.ambiguous_tokens):
        result.skipped_ambiguous += 1
        return
    rows = [t for t in range(case.m) if t not in set(ref.ambiguous_tokens)]
    # the partial outputs (hits, fetched, CPU) add in float32 (OffloadedMoE's docstring): a float64 layer to 1e-6
    tol = FLOAT64_PARTIALS if case.dtype == torch.float64 else None
    check_output(call.out[rows], ref.out[rows], case, what, result, tol)
