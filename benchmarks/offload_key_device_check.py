"""Device check of issue #18's slot-copy rebuild and the CPU branch's contention with the link (helper offkey):

1. Contention probe: the CPU experts' branch (``calibrate.branch``, cold experts, 1 row each) with the link idle,
   while large pinned host -> device copies run (several distinct pinned source buffers, queued before the
   branch and still running when it ends: checked per branch) and right after such copies, after ``--gaps`` ms
   of idle host time (0, 1, 5, 20: a decode layer's host work, a fetch-bound layer's wait; the branch's threads
   asleep meanwhile), interleaved over ``--repeats`` rounds; medians of the branch's total and compute seconds,
   each state over idle.
2. The key split A/B: the Triton experts' TMA descriptors keyed on addresses (the code) against the twin of
   before (``version_keys``: an entry dropped whenever a weight's ``_version`` moved, as the fingerprint with
   ``_version`` did), over cells of ``offload_cal_device_check``'s table in two turns (every cell's twin then
   split, then split then twin): each row's ``copy_call_ms`` (an all-hit forward's extra host time right after a copy
   into the slots), step ms, x floor, auto over the better pure mode.

Correctness first: every mode's layer output against the plain ``MoE`` (``offload_cpu_anatomy.exactness``) under
both keys, PASS/FAIL. Prints partial results as it goes; the JSON (``--out DIR`` or $OUT,
offload_key_device_check.json) is rewritten after every part; the table prints last. ``--limit S``: no group
starts past S seconds. ``--cells none``: no A/B (the exactness and the probe only).

    PYTHONPATH=$PWD python3 benchmarks/offload_key_device_check.py --limit 130 --out $OUT/offkey
    PYTHONPATH=$PWD python3 benchmarks/offload_key_device_check.py --smoke      (CPU, tiny shapes: runs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, measure_costs, measure_offload
from moekit.bench.offload_report import auto_vs_best, modes_by_cell
from moekit.experts.triton_cache import WeightDescriptors
from moekit.offload import CpuOptions, OffloadedMoE
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CPU_GEMMS
from offload_cal_device_check import cell_name, keeper  # benchmarks/ on sys.path
from offload_setting import offload_setting
from offload_cal_log import MODES
from offload_cpu_anatomy import exactness

START = time.perf_counter()
# the cells the rebuild and the contention show in (0efdb0f: cpu x floor 1.35 / 1.81 / 2.14 at skewed router M = 1;
# auto over the best pure 1.123 at skewed/25/none/32, 1.055 at M = 8)
CELLS = "skewed/25/router/1,skewed/75/router/1,skewed/25/none/32,skewed/50/none/8"
SOURCES = 4  # distinct pinned source buffers of the link's load (a prefetch reads many experts' blocks)
# the probe's link states: none; copies running through the branch; copies done just before it (checkpoint 1's
# "busy": ``calibrate.branch`` synchronized the device first, 1.11-1.23x idle)
STATES = ("idle", "during", "after")


@contextlib.contextmanager
def version_keys():
    """The twin of before the split: ``WeightDescriptors.get`` drops a weight's entry whenever its or w2's
    ``_version`` moved since its last call (the fingerprint held both versions), so the descriptors and the
    launch sequence recorded over them are built again after every copy into the slots."""
    real = WeightDescriptors.get
    seen: dict[int, tuple] = {}

    def get(self, w13, w2, key, build=None):
        state = (id(self), w13._version, w2._version)
        if seen.get(id(w13)) != state:
            self._entries.pop(id(w13), None)
            seen[id(w13)] = state
        return real(self, w13, w2, key, build)

    WeightDescriptors.get = get
    try:
        yield
    finally:
        WeightDescriptors.get = real


def dump(result: dict) -> None:
    if result.get("out"):
        result["total_s"] = time.perf_counter() - START
        path = os.path.join(result["out"], "offload_key_device_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, default=str)
        os.replace(path + ".tmp", path)


def contention(shell, costs, device, repeats: int, gaps_s: tuple[float, ...], sizes=(1, 2, 4, 8)) -> list[dict]:
    """The CPU branch with the link idle, during copies and after them (module docstring, part 1)."""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    gemm, threads = costs.cpu_gemm or CPU_GEMMS[0], costs.cpu_threads or torch.get_num_threads()
    groups = cold_groups(layer.config.num_experts, max(sizes), 2000)
    cuda = device.type == "cuda"
    chunk = 64 << 20 if cuda else 0
    srcs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(SOURCES)] if cuda else []
    dst = torch.empty(chunk, dtype=torch.uint8, device=device) if cuda else None
    stream = torch.cuda.Stream(device) if cuda else None
    link = costs.link_bytes_per_s
    got: dict[tuple, list] = {}
    for _ in range(repeats):
        for n in sizes:
            for state in STATES:
                for gap in gaps_s:
                    done = None
                    if cuda:
                        torch.cuda.synchronize(device)
                    if state != "idle" and cuda:  # copies for the gap and 4x the branch's model time at the link's rate
                        span = gap + 4 * costs.cpu_side_s([1] * n) + 0.004
                        with torch.cuda.stream(stream):
                            for i in range(int(span * link / chunk) + 1):
                                dst.copy_(srcs[i % SOURCES], non_blocking=True)
                            done = torch.cuda.Event()
                            done.record(stream)
                        if state == "after":
                            stream.synchronize()
                    time.sleep(gap)
                    total = branch(layer, next(groups), n, 1, threads, gemm, busy=False, quiet=state != "during")
                    covered = done is None or not done.query()  # the copies still ran when the branch ended
                    if cuda:
                        stream.synchronize()
                    got.setdefault((n, state, gap), []).append((total, layer.last_cpu.compute_s, covered))
    rows = []
    for (n, state, gap), v in sorted(got.items(), key=lambda kv: (kv[0][0], STATES.index(kv[0][1]), kv[0][2])):
        rows.append({"experts": n, "state": state, "gap_ms": gap * 1e3,
                     "ms": statistics.median(t for t, _, _ in v) * 1e3, "max_ms": max(t for t, _, _ in v) * 1e3,
                     "compute_ms": statistics.median(c for _, c, _ in v) * 1e3,
                     "covered": sum(c for _, _, c in v) / len(v), "model_ms": costs.cpu_side_s([1] * n) * 1e3,
                     "n": len(v)})
    for r in rows:
        if r["state"] != "idle":
            idle = next(i for i in rows if i["state"] == "idle" and (i["experts"], i["gap_ms"]) == (r["experts"],
                                                                                                 r["gap_ms"]))
            r["over_idle"] = r["ms"] / idle["ms"]
            r["compute_over_idle"] = r["compute_ms"] / idle["compute_ms"]
    return rows


def print_contention(rows: list[dict]) -> None:
    print("CPU branch with the link idle, during H2D copies, right after them (cold experts, 1 row each; ms medians;"
          " covered: share of branches that ended before the copies did)")
    for r in rows:
        extra = (f"  /idle x{r['over_idle']:.3f} (compute x{r['compute_over_idle']:.3f}), covered {r['covered']:.2f}"
                 if r["state"] != "idle" else "")
        print(f"  n{r['experts']} {r['state']:<6} gap{r['gap_ms']:<3.0f}: {r['ms']:6.3f} max {r['max_ms']:6.3f} "
              f"(compute {r['compute_ms']:6.3f}) model {r['model_ms']:6.3f}{extra}")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    limit = float(argv[argv.index("--limit") + 1]) if "--limit" in argv else 150.0
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else (2 if smoke else 12)
    gaps = argv[argv.index("--gaps") + 1] if "--gaps" in argv else "0,1,5,20"
    gaps_s = tuple(float(g) * 1e-3 for g in gaps.split(","))
    cells = argv[argv.index("--cells") + 1] if "--cells" in argv else CELLS
    patterns = [] if cells == "none" else cells.split(",")  # none: the exactness and the probe only
    s = offload_setting(smoke)
    cuda, device, dtype, shape, config = s.cuda, s.device, s.dtype, s.shape, s.config
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "shape": shape, "cells": patterns, "rows": [], "state": "running",
              "out": argv[argv.index("--out") + 1] if "--out" in argv else os.environ.get("OUT")}
    if result["out"]:
        os.makedirs(result["out"], exist_ok=True)
    shells = host_shells(config, dtype, device, layers=shape["layers"])
    batches = (1, 8, 32) if cuda else (1, 8)
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows(batches), max(batches))
    result["costs"] = dataclasses.asdict(costs)
    print(f"costs: issue {costs.issue_s * 1e6:.1f} us an expert (its victim evicted; 0efdb0f, into empty slots: 66), "
          f"second call {costs.gpu_call_s * 1e3:.3f} ms, fetch layer {costs.fetch_layer_s * 1e3:.3f} ms, CPU expert "
          f"{costs.cpu_time(1) * 1e6:.0f} us at 1 row, {costs.cpu_threads} threads, {costs.cpu_gemm}")
    result["exact"] = exact(shells[0], costs, device, batches)
    result["contention"] = contention(shells[0], costs, device, repeats, gaps_s)
    print_contention(result["contention"])
    dump(result)
    # two turns, each cell's twin and split back to back, in the other order on the second
    order = [(p, keys) for turn in (("version", "address"), ("address", "version")) for p in patterns for keys in turn]
    for run, (pattern, keys) in enumerate(order):
        if time.perf_counter() - START > limit:
            result["state"] = f"cut at {limit:.0f} s"
            break
        stream, _, _, m = pattern.split("/")

        def progress(r, keys=keys, run=run) -> None:
            result["rows"].append({**dataclasses.asdict(r), "keys": keys, "run": run})
            r = result["rows"][-1]
            print(f"  [{keys}] {cell_name(r['stream'], r['cache_fraction'], r['prefetch'], r['M'])} "
                  f"{r['compute_misses_on']:>4}: step {r['step_ms']:.3f} ms x floor {r['x_floor']:.3f} copy call "
                  f"{r['copy_call_ms']:.3f} ms")
            sys.stdout.flush()

        with version_keys() if keys == "version" else contextlib.nullcontext():
            measure_offload(device, batches=(int(m),), policies=("lfu",), places=MODES, shells=shells, costs=costs,
                            on_progress=progress, online_cpu_rate=True, streams=(stream,), keep=keeper([pattern]),
                            **shape)
        dump(result)
    else:
        result["state"] = "complete"
    dump(result)
    _table(result)
    return 0


def exact(shell, costs, device, batches) -> list[dict]:
    """Every mode's layer output against the plain MoE under both keys (``offload_cpu_anatomy.exactness``), printed."""
    rows = []
    for keys in ("version", "address"):
        with version_keys() if keys == "version" else contextlib.nullcontext():
            for r in exactness(shell, costs, device, batches, MODES):
                rows.append({**r, "keys": keys})
                print(f"exact [{keys}] {r['mode']:>4} M={r['M']:<3} rel_l2 {r['rel_l2']:.2e} "
                      f"{'PASS' if r['pass'] else 'FAIL'}")
    sys.stdout.flush()
    return rows


def _table(result: dict) -> None:
    c = result["costs"]
    print(f"\n{result['device']}, torch {result['torch']}, shape {result['shape']}; {result['state']}; total "
          f"{time.perf_counter() - START:.0f} s; issue {c['issue_s'] * 1e6:.1f} us an expert")
    print_contention(result["contention"])
    fails = [r for r in result["exact"] if not r["pass"]]
    print(f"exactness: {len(result['exact']) - len(fails)} of {len(result['exact'])} PASS")
    print("cell keys run | per mode: step ms, x floor | auto/best | copy call ms")
    for run in sorted({r["run"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["run"] == run]
        keys = rows[0]["keys"]
        for key, modes in modes_by_cell(rows).items():
            q = auto_vs_best(modes)
            r0 = next(iter(modes.values()))
            print(f"{cell_name(key[0], key[1], key[3], key[4]):<20} {keys:<7} {run:>2} | " + " | ".join(
                f"{mode} {modes[mode]['step_ms']:7.3f} {modes[mode]['x_floor']:.2f}" for mode in MODES if mode in modes)
                + f" | {'-' if q is None else f'{q:.3f}'} | {r0['copy_call_ms']:.3f}")
    for keys in ("version", "address"):
        cc = [r["copy_call_ms"] for r in result["rows"] if r["keys"] == keys]
        if cc:
            print(f"copy call ms [{keys}]: median {statistics.median(cc):.3f}, range {min(cc):.3f}-{max(cc):.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
