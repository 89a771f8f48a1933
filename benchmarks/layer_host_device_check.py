"""Where the eager ``moekit.MoE`` layer's host time goes on the GPU (issue 13 item 4: <= 60 µs), stage by stage.

    PYTHONPATH=. OUT=/tmp/lh python benchmarks/layer_host_device_check.py [--presets P ...] [--batches 1 8]

For each preset (bf16, ``backend="triton"``, ``router="auto"``) and M, under ``torch.no_grad()``, the host µs
per call of 32 calls started on an idle GPU (median of 5 rounds) of:
  layer         the whole forward
  gate          ``MoE._router_logits`` (the gate GEMM as the layer runs it)
  router        the fused router on the gate's logits (None where the layer routes with ``route``)
  route_tokens  gate + router + the layer's routing glue
  experts       the layer's experts step on a fixed routing (``MoE._experts_and_shared``: the argument check
                runs once per set of weights, then ``call_checked_backend``)
  checked       the same through the public ``call_backend`` (``check_experts_args`` on every call)
  glue          layer - route_tokens - experts
and ``eager``, the wall µs per call of 200 back-to-back layer calls and one sync. Then at the first M: the
number of host syncs in one layer call (``torch.cuda.set_sync_debug_mode("warn")`` warnings; the last
session measured layer host ~= GPU time at M=1 for DeepSeek-V3 and Mixtral, which a sync would explain) and
``torch.profiler``'s top self-CPU ops over 20 layer calls (to $OUT). JSON to $OUT; a table printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

from moekit.config import MoEConfig
from moekit.experts import call_backend
from moekit.layer import MoE

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
STAGES = ("layer", "gate", "router", "route_tokens", "experts", "checked")


def host_from_idle(fn, calls: int = 32, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def eager_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def stage_fns(layer: MoE, x: torch.Tensor) -> dict:
    routed = layer.route_tokens(x)
    logits, bias, routing = routed.router_logits, layer.e_score_correction_bias, routed.routing
    router = layer._fused_router
    return {
        "layer": lambda: layer(x),
        "gate": lambda: layer._router_logits(x),
        "router": None if router is None else (lambda: router(logits, bias)),
        "route_tokens": lambda: layer.route_tokens(x),
        "experts": lambda: layer._experts_and_shared(x, routed),
        "checked": lambda: call_backend(layer._experts_fn, x, layer.w13, layer.w2, routing.topk_ids,
                                        routing.topk_weights, activation=layer.config.activation, b13=layer.b13,
                                        b2=layer.b2),
    }


def count_syncs(fn) -> int:
    """Host syncs in one call of ``fn``: the warnings of CUDA's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_table(fn, path: Path) -> None:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    print(f"wrote {path}", flush=True)


def cells(preset: str, batches: list[int], out: Path) -> list:
    layer = MoE(MoEConfig.preset(preset), backend="triton", router="auto", dtype=torch.bfloat16, device="cuda").eval()
    rows = []
    with torch.no_grad():
        for i, m in enumerate(batches):
            x = torch.randn(m, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            fns = stage_fns(layer, x)
            for fn in fns.values():
                if fn is not None:
                    fn(), fn()  # compile, bind, plan
            row = {"preset": preset, "M": m, **{k: None if f is None else host_from_idle(f) for k, f in fns.items()}}
            row["glue"] = row["layer"] - row["route_tokens"] - row["experts"]
            row["eager"] = eager_us(fns["layer"])
            if i == 0:
                row["syncs"] = count_syncs(fns["layer"])
                profile_table(fns["layer"], out / f"layer_profile_{preset}_M{m}.txt")
            rows.append(row)
            print(json.dumps(row), flush=True)
    del layer
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    a = p.parse_args()
    out = Path(os.environ.get("OUT", "layer_host_out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for preset in a.presets for r in cells(preset, a.batches, out)]
    (out / "layer_host.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    cols = (*STAGES, "glue", "eager")
    print(f"{'preset':<15}{'M':>5}" + "".join(f"{c:>13}" for c in cols) + f"{'syncs':>7}   (host µs per call; eager: wall)")
    for r in rows:
        cells_text = "".join(f"{'-' if r[c] is None else f'{r[c]:.1f}':>13}" for c in cols)
        print(f"{r['preset']:<15}{r['M']:>5}{cells_text}{r.get('syncs', ''):>7}")


if __name__ == "__main__":
    main()
