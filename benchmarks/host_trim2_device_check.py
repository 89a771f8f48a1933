"""Host time per eager call (issue 13 items 1 and 4: experts <= 40 µs at every M, the layer <= 60 µs), before
and after branch host-trim2's changes, and where the experts call's M-dependent host time goes.

    PYTHONPATH=$PWD OUT=/tmp/ht2 python benchmarks/host_trim2_device_check.py [--budget-s 120]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_trim2_device_check.py --smoke   (CPU: checks the script)

Variants (every output compared bit for bit with ``base``'s, and the experts' with the BoundLaunch path's):
  base      the tensors of a call handed to each raw launch as tensors (Triton's launcher then calls data_ptr
            and cuPointerGetAttribute for every pointer of every launch): main's path
  addr      handed over as addresses, read once per call (``triton_bind.PASS_ADDRESSES``, read by
            ``triton_lean`` too)
  fast      addr and the layer's decode fast path (``moekit.layer_fast``; layer cells only)
1. layer (``MoE``, backend triton, router auto; M = 1, 8): host µs of the whole forward, ``route_tokens`` (gate +
   router: one launch up to 4 tokens), the experts step, glue = the rest; per variant, outputs bit-equal.
2. experts: host µs per ``experts_triton`` call (Qwen3-30B-A3B, DeepSeek-V3; M = 1, 8, 512, 4096, 16384; bf16,
   uniform routing, no_grad): calls started on an idle GPU, variants interleaved (ABBA), median and min; the
   caching allocator's cudaMalloc count (segments) during each variant's timing; from M = 4096 also
   ``pool_all`` (addr with h and y kept in the pool, no allocation per call: is that buffer M's cost?), and at
   the probe's M ``no_pdl`` (addr without programmatic dependent launch: does a PDL launch cost more host time?).
   Each variant's host µs also split into the first call of a sample (right after the sync: the host waited
   for the GPU) and the rest's mean; at M = 8 and 512 a backlog probe: 64 calls back to back, µs per call by
   call index (does a call cost more once many launches are queued behind a busy GPU?).
3. probe (M = 4096, both presets): each step's host µs of one kept call (``host_trim2_probe``): idle GPU,
   behind a busy GPU, back to back; tensors against addresses; allocation and launch controls.
Cells run preset by preset (layer, experts) until --budget-s; --hard-limit-s stops at once. JSON to
$OUT/host_trim2.json; a table last (look for: every ``same`` yes; addr host < base host, most at M >= 512;
fast < addr for the layer at M = 1; pool_all against addr; the probe's steps that grow behind a busy GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import host_align_device_check as ha
import host_trim2_probe as probe
from moekit import MoEConfig, triton_bind
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts.triton import clear_launch_caches, experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.layer import MoE

PRESETS = ("qwen3-30b-a3b", "deepseek-v3")
BATCHES = (1, 8, 512, 4096, 16384)
PROBE_M = 4096
LAYER_BATCHES = (1, 8)
EXPERT_VARIANTS = ("base", "addr")
LAYER_VARIANTS = ("base", "addr", "fast")
LARGE_M = 4096
# Its own plan (the key has the options) with the default launches wherever A > 65 (no fold): recorded while the
# pool takes any size, so its h and y stay pooled (no allocation per call): is the per-call buffer M's cost?
POOL_ALL = LaunchOptions(align_fold_max=65)
NO_PDL = LaunchOptions(dependent_launch=False)  # at the probe's M: does a PDL launch cost more host behind a busy GPU?


class Run:
    device = torch.device("cuda")
    scale = 1
    samples, calls, large_samples, large_calls, probe_reps, stream_calls = 15, 32, 5, 12, 15, 12
    backlog_at, backlog_calls = (8, 512), 64  # the per-call backlog probe's cells
    pool_all_from = LARGE_M  # M from which the pool_all variant runs (h and y per call from here at real shapes)


def set_variant(name: str) -> None:
    """Turn each change on or off (module switches, read per call)."""
    on = name != "base"
    triton_bind.PASS_ADDRESSES = on
    try:
        from moekit import layer_fast
    except ImportError:
        return
    layer_fast.ENABLED = name == "fast"


def sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def host_us(fns: dict, m: int) -> dict:
    """Host µs per call of each variant: calls started on an idle GPU, variants interleaved (ABBA); median and
    min of the samples' means, the median of each sample's first call (right after the sync: the host has
    waited for the GPU) and of the rest's mean, and cudaMalloc calls (segments) during the variant's samples."""
    samples, calls = (Run.large_samples, Run.large_calls) if m >= LARGE_M else (Run.samples, Run.calls)
    times, firsts, rests = ({name: [] for name in fns} for _ in range(3))
    segments = {name: 0 for name in fns}
    clock = time.perf_counter
    for sample in range(samples):
        for name in (list(fns) if sample % 2 == 0 else list(fns)[::-1]):
            fn = fns[name]
            sync()
            before = probe.memory_counts(Run.device)
            t0 = clock()
            fn()
            t1 = clock()
            for _ in range(calls - 1):
                fn()
            t2 = clock()
            times[name].append((t2 - t0) / calls * 1e6)
            firsts[name].append((t1 - t0) * 1e6)
            rests[name].append((t2 - t1) / max(1, calls - 1) * 1e6)
            sync()
            after = probe.memory_counts(Run.device)
            segments[name] += after.get("segments", 0) - before.get("segments", 0)
    return {name: {"median": round(statistics.median(t), 2), "min": round(min(t), 2),
                   "first": round(statistics.median(firsts[name]), 2), "rest": round(statistics.median(rests[name]), 2),
                   "segments": segments[name]} for name, t in times.items()}


def backlog_us(fn, calls: int = 64) -> dict:
    """Host µs of each of ``calls`` back-to-back calls after one sync, as means over call index ranges: does a
    call cost more host time once many launches are queued behind a busy GPU?"""
    sync()
    clock, stamps = time.perf_counter, []
    for _ in range(calls):
        t0 = clock()
        fn()
        stamps.append((clock() - t0) * 1e6)
    sync()
    ranges = [(0, 1), (1, 8), (8, 16), (16, 32), (32, 64)]
    return {f"{a}-{b - 1}": round(statistics.mean(stamps[a:b]), 2) for a, b in ranges if b <= calls}


def variant_fn(name: str, fn):
    def run():
        set_variant(name)
        return fn()
    return run


def experts_cell(m: int, weights, shape: Shape, probe_it: bool) -> dict:
    dev, row = Run.device, {"same": True}
    for seed in (m, m + 1):  # two routings: the second reuses the plan, sequence and kept entry
        x = torch.randn(m, shape.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(m, shape, dev, seed=seed)
        args = (x, weights.w13, weights.w2, routing.topk_ids, routing.topk_weights)
        want = experts_triton(*args, options=LaunchOptions(lean_launch=False))
        fns = {name: variant_fn(name, lambda a=args: experts_triton(*a)) for name in EXPERT_VARIANTS}
        for fn in fns.values():
            for _ in range(3):  # compile, record, keep
                out = fn()
            row["same"] = row["same"] and torch.equal(out, want)
    if m >= Run.pool_all_from:
        row["pool_all_same"] = pool_all(fns, args, want)
    if m in Run.backlog_at:
        row["backlog"] = {name: backlog_us(fns[name], Run.backlog_calls) for name in ("base", "addr")}
    if probe_it:
        fns["no_pdl"] = variant_fn("addr", lambda: experts_triton(*args, options=NO_PDL))
        row["no_pdl_same"] = all(torch.equal(fns["no_pdl"](), want) for _ in range(3))
    row["host_us"] = host_us(fns, m)
    if probe_it:
        set_variant("addr")
        row["probe"] = probe.probe(args, want, dev, reps=Run.probe_reps, stream_calls=Run.stream_calls)
    set_variant("addr")
    return row


def pool_all(fns: dict, args: tuple, want: torch.Tensor) -> bool:
    """Add ``pool_all`` (addr, h and y in the pool: ``POOL_ALL`` recorded with the pool's size lifted) to ``fns``;
    whether its output equals ``want``."""
    from moekit.experts.triton import _WORKSPACES

    kept, _WORKSPACES.max_bytes = _WORKSPACES.max_bytes, 1 << 45
    try:
        fns["pool_all"] = variant_fn("addr", lambda: experts_triton(*args, options=POOL_ALL))
        for _ in range(3):  # compile, record, keep: served from the kept entry from here on, whatever max_bytes
            out = fns["pool_all"]()
    finally:
        _WORKSPACES.max_bytes = kept
    return torch.equal(out, want)


def layer_cell(layer: MoE, m: int) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device=Run.device, dtype=torch.bfloat16)
    outs, row = {}, {}
    for name in LAYER_VARIANTS:
        set_variant(name)
        for _ in range(3):
            outs[name] = layer(x)
    row["same"] = all(torch.equal(outs[name], outs["base"]) for name in LAYER_VARIANTS)
    set_variant("addr")
    routed = layer.route_tokens(x, layer._route_ws)  # forward's own buffers: the routing of x, kept
    stages = {"layer": lambda: layer(x), "route_tokens": lambda: layer.route_tokens(x, layer._route_ws),
              "experts": lambda: layer._experts_and_shared(x, routed)}
    for stage, fn in stages.items():
        names = LAYER_VARIANTS if stage == "layer" else EXPERT_VARIANTS
        timed = host_us({n: variant_fn(n, fn) for n in names}, m)
        row[stage] = {k: v["median"] for k, v in timed.items()}
        if stage == "layer":
            row["layer_rest"] = {k: v["rest"] for k, v in timed.items()}  # calls 2.. of each sample
    row["glue"] = {n: round(row["layer"][n] - row["route_tokens"][n] - row["experts"][n], 2) for n in EXPERT_VARIANTS}
    set_variant("addr")
    return row


def measure(a, start: float, results: dict) -> None:
    """Preset by preset: its layer's cells (cheap), then its experts cells (the probe at ``a.probe_m``)."""
    with torch.no_grad():
        for i, preset in enumerate(a.presets):
            layer = MoE(layer_config(preset), backend="triton", router="auto", dtype=torch.bfloat16,
                        device=Run.device).eval()
            if i == 0:
                layer_cell(layer, 1)  # throwaway: a process's first cell runs slow
            for m in a.layer_batches:
                ha.budgeted_cell(results, f"layer {preset} M={m}", start, a.budget_s, lambda: layer_cell(layer, m))
            del layer
            clear_launch_caches()
            free_memory()
            shape = Shape.from_preset(preset, Run.scale)
            weights = make_weights(shape, torch.bfloat16, Run.device)
            for m in a.batches:
                ha.budgeted_cell(results, f"experts {preset} M={m}", start, a.budget_s,
                                 lambda: experts_cell(m, weights, shape, m == a.probe_m))
            del weights
            clear_launch_caches()
            free_memory()


def layer_config(preset: str) -> MoEConfig:
    config = MoEConfig.preset(preset)
    if Run.scale == 1:
        return config
    return config.replace(hidden_size=config.hidden_size // Run.scale,
                          moe_intermediate_size=config.moe_intermediate_size // Run.scale,
                          shared_expert_intermediate_size=config.shared_expert_intermediate_size // Run.scale)


def free_memory() -> None:
    if Run.device.type == "cuda":
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    lines = ["host µs per call (median; segs: cudaMalloc calls while timed), base -> addr [-> fast]"]
    for key, r in results.items():
        if "same" not in r:
            lines.append(f"{key:34}{next(iter(r.values()))}")
            continue
        if key.startswith("experts"):
            h = r["host_us"]
            lines.append(f"{key:34}same {ha._yn(r['same'])}  host {h['base']['median']:7.1f} -> "
                         f"{h['addr']['median']:7.1f}  min {h['base']['min']:7.1f} -> {h['addr']['min']:7.1f}"
                         f"  first {h['base']['first']:7.1f} -> {h['addr']['first']:7.1f}"
                         f"  rest {h['base']['rest']:6.1f} -> {h['addr']['rest']:6.1f}"
                         f"  segs {h['base']['segments']} / {h['addr']['segments']}")
            for name, ranges in r.get("backlog", {}).items():
                lines.append(f"{'':6}backlog {name:5} µs by call index "
                             + " ".join(f"{k}: {v}" for k, v in ranges.items()))
            if "no_pdl" in h:
                lines.append(f"{'':6}no_pdl (addr, dependent_launch off) same {ha._yn(r['no_pdl_same'])} host "
                             f"{h['no_pdl']['median']:.1f} min {h['no_pdl']['min']:.1f} rest {h['no_pdl']['rest']:.1f}")
            if "pool_all" in h:
                lines.append(f"{'':6}pool_all (h, y pooled) same {ha._yn(r['pool_all_same'])} host "
                             f"{h['pool_all']['median']:.1f} min {h['pool_all']['min']:.1f} first "
                             f"{h['pool_all']['first']:.1f} rest {h['pool_all']['rest']:.1f} segs "
                             f"{h['pool_all']['segments']}")
            p = r.get("probe")
            if p and "steps" in p:
                for way in ("idle", "busy", "stream"):
                    for tag in ("tensor", "addr"):
                        steps = p[f"{way}_{tag}"]
                        lines.append(f"{'':6}probe {way:6} {tag:6} " + " ".join(f"{n}={v}" for n, v in steps.items()))
                lines.append(f"{'':6}probe same addr/tensor {ha._yn(p['same_addr'])}/{ha._yn(p['same_tensor'])} "
                             f"controls {p['control_us']}")
            elif p:
                lines.append(f"{'':6}probe {p}")
        else:
            stages = " ".join(f"{s} " + " -> ".join(f"{v:.1f}" for v in r[s].values())
                              for s in ("layer", "layer_rest", "route_tokens", "experts", "glue"))
            lines.append(f"{key:34}same {ha._yn(r['same'])}  {stages}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=150, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--layer-batches", nargs="+", type=int, default=list(LAYER_BATCHES))
    p.add_argument("--probe-m", type=int, default=PROBE_M)
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale = torch.device("cpu"), ha.SMOKE_SCALE
        Run.samples, Run.calls, Run.large_samples, Run.large_calls, Run.probe_reps, Run.stream_calls = 1, 2, 1, 2, 1, 2
        Run.backlog_at, Run.backlog_calls = (1,), 2
        a.budget_s = 1e9  # the interpreter takes minutes: every cell runs
        if a.batches == list(BATCHES):
            a.batches, a.probe_m, a.layer_batches = [1, 40], 40, [1]
        from moekit.experts.triton import _WORKSPACES
        _WORKSPACES.max_bytes = 1 << 12  # so the probe's M takes h and y per call, as at real shapes
        Run.pool_all_from = a.probe_m
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = Run.device
    out_dir = Path(os.environ.get("OUT", "host_trim2_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "host_trim2.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
