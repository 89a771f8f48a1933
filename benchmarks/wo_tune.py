"""Tune the weight-only quantized experts' tiles on the device and write their config files.

    PYTHONPATH=. python benchmarks/wo_tune.py [--presets P ...] [--schemes S ...] [--batches M ...]
    PYTHONPATH=. python benchmarks/wo_tune.py --install $OUT/wo_configs.json   # into moekit/experts/configs/

Per cell (preset, scheme, M): coordinate descent from ``wo_heuristic_config``: the gate-up tile over
UP candidates with the heuristic's down tile, then the down tile over DOWN candidates with the best
gate-up tile; each candidate timed in a CUDA graph on the same rotated inputs as
``wo_device_check.py``. Every candidate kernel is compiled up front in a thread pool. Writes
$OUT/wo_configs.json: {config file name: its content, ``moekit.experts.configs``' format with a
"measured" entry per M (tuned and heuristic µs)}; ``--install`` writes each file into the package.
About 5 minutes for the three presets, three schemes and four batch sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit.bench.cells import PRESETS, Shape, make_sets
from moekit.bench.timing import time_stats
from moekit.experts.configs import GemmTile, KernelConfig, PACKAGED_DIR, config_file_name, device_key
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_wo import run_experts_wo, weight_args
from moekit.experts.triton_wo_plan import wo_heuristic_config
from wo_device_check import BATCHES, SCHEMES, SETS, precompile, quantized

OPTIONS = LaunchOptions(reuse_workspace=False)


def tiles(decode: bool) -> list[GemmTile]:
    """The tiles a GEMM is tried with: decode (<16 rows per expert) narrow, else the tall ones. The
    kernels dequantize a whole [BN, BK] tile per step (float32 on its way to bf16), so BN x BK stays
    <= 16384 (with 4 warps: no spills in ptxas for sm_90, Triton 3.6; 128 x 128 and 64 x 256 are the
    edge); BLOCK_N 64 and 128 are wgmma's M, 32 falls back to mma.sync."""
    if decode:
        return [GemmTile(bn, bk, 1, w, st) for bn, bk, w, st in
                ((32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 4), (32, 256, 8, 3),
                 (64, 256, 8, 3), (128, 128, 8, 3))]
    return [GemmTile(bn, bk, gm, w, st) for bn, bk, gm, w, st in
            ((128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (64, 64, 8, 4, 4), (64, 128, 8, 4, 3), (128, 128, 8, 8, 3),
             (128, 32, 8, 8, 4))]


def candidates(base: KernelConfig, decode: bool, stage: str, best_up: GemmTile | None = None) -> list[KernelConfig]:
    if stage == "up":
        return [replace(base, up=t) for t in tiles(decode)]
    return [replace(base, up=best_up, down=t) for t in tiles(decode)]


def time_config(config, inputs, a13, a2, scheme, dev) -> float:
    fns = [lambda c=c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=config,
                                      options=OPTIONS) for c in inputs]
    try:
        return time_stats(fns, dev, graph=True, budget_s=0.03).us
    except Exception as e:  # noqa: BLE001  (a tile the device cannot run: out of resources)
        print(f"  {config}: {type(e).__name__}", flush=True)
        return float("inf")


def tune_cell(s: Shape, scheme: str, m: int, a13, a2, inputs, dev) -> tuple[KernelConfig, float, float]:
    """(best config, its µs, the heuristic's µs) of one cell."""
    base = wo_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme)
    decode = base.BLOCK_M == 16
    heuristic_us = time_config(base, inputs, a13, a2, scheme, dev)
    best, best_us = base, heuristic_us
    for stage in ("up", "down"):
        for config in candidates(best, decode, stage, best.up):
            us = time_config(config, inputs, a13, a2, scheme, dev)
            if us < best_us:
                best, best_us = config, us
    print(f"{s.name} {scheme} M={m}: {best_us:.1f} µs (heuristic {heuristic_us:.1f}) {best.to_dict()}", flush=True)
    return best, best_us, heuristic_us


def all_candidates(s: Shape, scheme: str, m: int) -> list[KernelConfig]:
    """Every config the descent may time for this cell (the down stage's gate-up tile is unknown ahead,
    but kernels compile per GEMM, so the heuristic's gate-up tile stands in for it)."""
    base = wo_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme)
    decode = base.BLOCK_M == 16
    return [base] + candidates(base, decode, "up") + candidates(base, decode, "down", base.up)


def tune(presets, schemes, batches, dev) -> dict:
    shapes = [Shape.from_preset(p) for p in presets]
    precompile([(s, scheme, m, c) for s in shapes for scheme in schemes for m in batches
                for c in all_candidates(s, scheme, m)], dev)
    files = {}
    for s in shapes:
        sets = {m: make_sets(s, m, SETS, torch.bfloat16, dev, seed=m) for m in batches}
        for scheme in schemes:
            w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
            w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
            a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
            configs, measured = {}, {}
            for m in batches:
                best, us, heuristic_us = tune_cell(s, scheme, m, a13, a2, sets[m], dev)
                configs[str(m)], measured[str(m)] = best.to_dict(), {"tuned_us": us, "heuristic_us": heuristic_us}
            name = config_file_name(s.num_experts, s.n, s.k, scheme, device_key(dev))
            files[name] = {"E": s.num_experts, "N": s.n, "K": s.k, "dtype": scheme, "device": device_key(dev),
                           "configs": configs, "measured": measured}
            del w13, w2, a13, a2
            torch.cuda.empty_cache()
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--install", metavar="FILE", help="write the files of a wo_configs.json into the package")
    args = p.parse_args(argv)
    if args.install:
        for name, content in json.loads(Path(args.install).read_text()).items():
            (PACKAGED_DIR / name).write_text(json.dumps(content, indent=1) + "\n")
            print("wrote", PACKAGED_DIR / name)
        return 0
    files = tune(args.presets, args.schemes, args.batches, torch.device("cuda"))
    out = Path(os.environ.get("OUT", ".")) / "wo_configs.json"
    out.write_text(json.dumps(files, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
