"""Where the Triton experts path spends its time, per kernel (torch.profiler), and how the heuristic
default compares with the tuned configs (run on the device).

    PYTHONPATH=. python benchmarks/triton_breakdown.py [--batches 1,8,1024,16384] [--heuristic]
    PYTHONPATH=. python benchmarks/triton_breakdown.py --ab weight_descriptors,dependent_launch [--candidates]
    PYTHONPATH=. python benchmarks/triton_breakdown.py --sweep qwen3-30b-a3b --batches 1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch

from moekit.bench.cells import PRESETS, Shape, make_sets, make_weights
from moekit.bench.timing import time_calls
from moekit.bench.tuning import TUNE_BATCHES
from moekit.experts.configs import device_key, get_config, heuristic_config
from moekit.bench.ceilings import measure_ceilings
from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton import fused_experts
from moekit.experts.triton_launch import LaunchOptions


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """Mean device µs per call of each kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name.split("(")[0][:40]] += evt.device_time / reps
    return dict(times)


def breakdown(batches):
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        expert_weights = make_weights(s, torch.bfloat16, torch.device("cuda"))
        w13, w2 = expert_weights.w13, expert_weights.w2
        for m in batches:
            inputs = make_sets(s, m, 1, torch.bfloat16, torch.device("cuda"))[0]
            x, ids, w = inputs.x, inputs.topk_ids, inputs.topk_weights
            t = kernel_times(lambda: fused_experts(x, w13, w2, ids, w))
            parts = "  ".join(f"{k}={v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
            print(f"{preset:14s} M={m:<6d} sum={sum(t.values()):8.1f} µs  {parts}", flush=True)
        del expert_weights, w13, w2
        torch.cuda.empty_cache()


def heuristic_vs_tuned(batches):
    dev = torch.device("cuda")
    worst = 10.0
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        expert_weights = make_weights(s, torch.bfloat16, dev)
        w13, w2 = expert_weights.w13, expert_weights.w2
        for m in batches:
            sets = make_sets(s, m, 2, torch.bfloat16, dev)
            res = {}
            for name, cfg in (("tuned",
                               get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, device_key(dev))),
                              ("heuristic", heuristic_config(m, s.num_experts, s.n, s.k, s.top_k))):
                calls = [lambda st=st,
                         c=cfg: fused_experts(st.x, w13, w2, st.topk_ids, st.topk_weights, config=c) for st in sets]
                res[name] = time_calls(calls, dev, graph=m <= 1024, budget_s=0.1)
            speed = res["tuned"] / res["heuristic"]
            worst = min(worst, speed)
            print(f"{preset:14s} M={m:<6d} tuned {res['tuned']:9.1f} µs  heuristic {res['heuristic']:9.1f} µs  "
                  f"heuristic at {100 * speed:.0f}% of tuned speed", flush=True)
        del expert_weights, w13, w2
        torch.cuda.empty_cache()
    print(f"worst: heuristic at {100 * worst:.0f}% of the tuned speed")


# Tall-tile candidates timed with ``--candidates`` at M >= 512, all named options on.
TALL_CANDIDATES = {
    "128x128x64/s4": KernelConfig(128, GemmTile(128, 64, 8, 8, 4), GemmTile(128, 64, 8, 8, 4)),
    "128x128x64/s5": KernelConfig(128, GemmTile(128, 64, 8, 8, 5), GemmTile(128, 64, 8, 8, 5)),
    "128x256x64/s3": KernelConfig(128, GemmTile(128, 64, 8, 8, 3), GemmTile(256, 64, 8, 8, 3)),
    "64x128x64/s4": KernelConfig(64, GemmTile(128, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4)),
}


# The on/off fields of ``LaunchOptions`` that ``--ab`` can toggle.
AB_FIELDS = [f.name for f in dataclasses.fields(LaunchOptions) if isinstance(getattr(LaunchOptions(), f.name), bool)]


def options_ab(batches, fields: list[str], candidates: bool):
    """The tuned configs with every on/off combination of the ``LaunchOptions`` fields named
    (``weight_descriptors``, ``dependent_launch``), the other fields at their defaults: µs, % of the
    floor, and a rel. L2 check against the all-off variant. With ``candidates``, the tall tiles too at
    M >= 512."""
    import itertools

    dev = torch.device("cuda")
    ceilings = measure_ceilings(dev)
    copy_bps, mm_flops = ceilings.copy_TBps * 1e12, ceilings.mm_TFLOPs * 1e12
    print(f"ceilings: copy {ceilings.copy_TBps:.2f} TB/s, mm {ceilings.mm_TFLOPs:.0f} TFLOP/s", flush=True)
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        expert_weights = make_weights(s, torch.bfloat16, dev)
        w13, w2 = expert_weights.w13, expert_weights.w2
        for m in batches:
            sets = make_sets(s, m, 2, torch.bfloat16, dev)
            touched = len(torch.unique(sets[0].topk_ids))
            floor = max((touched * 3 * s.n * s.k * 2 + 2 * m * s.k * 2) / copy_bps,
                        2 * m * s.top_k * 3 * s.n * s.k / mm_flops) * 1e6
            tuned = get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, device_key(dev))
            variants = [("+".join(n for n, on in zip(fields, flags) if on) or "off", tuned,
                         LaunchOptions(**dict(zip(fields, flags))))
                        for flags in itertools.product((False, True), repeat=len(fields))]
            if candidates and m >= 512:
                all_on = LaunchOptions(**dict.fromkeys(fields, True))
                variants += [(name, cfg, all_on) for name, cfg in TALL_CANDIDATES.items()]
            res, ref = {}, None
            for name, cfg, options in variants:
                calls = [lambda st=st, c=cfg, o=options: fused_experts(st.x, w13, w2, st.topk_ids, st.topk_weights,
                                                                       config=c, options=o)
                         for st in sets]
                try:
                    res[name] = time_calls(calls, dev, graph=m <= 1024, budget_s=0.1)
                except Exception as err:  # noqa: BLE001 - an A/B script: report the variant and go on
                    print(f"  {name}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                out = calls[0]().float()
                if ref is None:
                    ref = out
                elif float((out - ref).norm() / ref.norm()) > 1e-2:
                    print(f"  {name}: WRONG, rel. L2 {float((out - ref).norm() / ref.norm()):.1e}", flush=True)
            best = min((v, k) for k, v in res.items())
            print(f"{preset:14s} M={m:<6d} floor {floor:8.1f}  " + "  ".join(
                f"{k} {v:.1f} ({100 * floor / v:.0f}%)" for k, v in res.items()) + f"  best {best[1]}", flush=True)
        del expert_weights, w13, w2
        torch.cuda.empty_cache()


def sweep(preset: str, m: int):
    """A wider search than ``moekit tune`` for one cell: warps, stages and BLOCK_K too, coordinate-wise
    (gate-up tile, then its stages; then the down tile, then its stages), from the tuned config."""
    from dataclasses import replace

    dev = torch.device("cuda")
    s = Shape.from_preset(preset)
    expert_weights = make_weights(s, torch.bfloat16, dev)
    w13, w2 = expert_weights.w13, expert_weights.w2
    sets = make_sets(s, m, 8, torch.bfloat16, dev)

    def measure(cfg):
        calls = [lambda st=st: fused_experts(st.x, w13, w2, st.topk_ids, st.topk_weights, config=cfg) for st in sets]
        try:
            return time_calls(calls, dev, graph=m <= 1024, budget_s=0.15)
        except Exception:  # noqa: BLE001 - a config that does not fit is out of the running
            return float("inf")

    best = get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, device_key(dev))
    best_us = measure(best)
    print(f"{preset} M={m} tuned {best_us:.1f} µs {best}", flush=True)
    for which in ("up", "down"):
        tiles = [GemmTile(bn, bk, 1, w, 4) for bn in (32, 64, 128) for bk in (128, 256) for w in (2, 4, 8)]
        for stage_pass in (False, True):
            if stage_pass:
                tile = getattr(best, which)
                tiles = [replace(tile, num_stages=st) for st in (2, 3, 5, 6) if st != tile.num_stages]
            for tile in tiles:
                cand = replace(best, **{which: tile})
                us = measure(cand)
                if us < best_us:
                    best, best_us = cand, us
                    print(f"  better: {us:.1f} µs {cand}", flush=True)
    print(f"{preset} M={m} best {best_us:.1f} µs {best.to_dict()}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,1024,16384")
    p.add_argument("--heuristic", action="store_true")
    p.add_argument("--ab", metavar="FIELD[,FIELD]", help=f"A/B of LaunchOptions fields, of {AB_FIELDS}")
    p.add_argument("--candidates", action="store_true", help="with --ab: the tall tiles too at M >= 512")
    p.add_argument("--sweep", metavar="PRESET", help="a wider config search for PRESET at each of --batches")
    a = p.parse_args()
    if a.sweep:
        for m in (int(v) for v in a.batches.split(",")):
            sweep(a.sweep, m)
    elif a.ab:
        if unknown := set(a.ab.split(",")) - set(AB_FIELDS):
            p.error(f"--ab: {sorted(unknown)} not among the on/off LaunchOptions fields {AB_FIELDS}")
        options_ab([int(v) for v in a.batches.split(",")], a.ab.split(","), a.candidates)
    elif a.heuristic:
        heuristic_vs_tuned(TUNE_BATCHES)
    else:
        breakdown([int(v) for v in a.batches.split(",")])
