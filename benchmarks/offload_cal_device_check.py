"""Device check for issue #18's targets: each cell's step within [0.85, 1.2]x its predicted floor, hit rate at the
simulator's, and "auto" never slower than the better pure mode, beside the noise of the same run.

    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_cal_device_check.py            (H200, whole table, < 165 s)
    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_cal_device_check.py --cells 'skewed/75/router/1,*/*/*/8'
    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_cal_device_check.py --profile uniform/50/none/8
    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_cal_device_check.py --cells close --profile uniform/50/none/8
                                        (``CLOSE``: the M = 8 groups and those whose cpu cell read over 1.2 on a4689f0)
    PYTHONPATH=$PWD python benchmarks/offload_cal_device_check.py --smoke                (CPU, tiny shapes: runs)

``--cpu-tail-ms T``: auto prices T ms of stall a CPU branch (``MissCosts.cpu_tail_s``; default the calibration's
``calibrate.CPU_TAIL_S``, 1 ms since session 24; 0: as before). ``--cpu-threads N``: the CPU branch at N threads
(``CpuOptions(threads=N)``; default: the calibration's, half the CPUs since session 23; 12 on the H200 host before it).
``--out DIR``: the JSON's folder (else $OUT). ``--fixed-threads``: after ``cpu_check``, torch's thread count is set to
the calibration's for the table, so no CPU branch switches the thread team's size (``cpu_path.torch_threads``); the
header says so. ``--limit S``: no group starts past S seconds (default 155: all 27 groups in 112 / 124 s on 0efdb0f /
b89fbea, c1c5838 cut at 92 s lost uniform/50 and 75 at M = 32; a group <= ~6 s; the M = 8 groups' 12 steps since session
24: ~10 s more). The header prints ``OMP_WAIT_POLICY`` (PASSIVE: the CPU branch's threads sleep at once after their work
instead of spinning beside the host's next layer).

``moekit bench --offload``'s table at Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16, 4 layers sharing one
cache, each its own host weights): cache 25 / 50 / 75% x M = 1 / 8 / 32 x gpu / cpu / auto, lfu, the skewed stream
(prefetch none and router) then the uniform one (none); "auto" with the online CPU rate. ``--cells`` keeps the groups
whose name stream/cache%/prefetch/M matches one of its comma-separated fnmatch patterns. With the twin (default;
``--no-twin`` drops it) every group also times "gpu2", pure gpu again, interleaved: |gpu2 / gpu - 1| is the step-to-step
noise that "auto / best" is read against.

The stacks of a group (modes, twin, all-hit reference) take turns step by step in carry-over balanced orders
(``offload_cells.balanced_orders``: each follows each other equally often over the timed steps); each row keeps its mean
step by the stack before it (``after_ms``): the carry-over a CPU-heavy step leaves. Every ``OffloadedMoE._plan`` is
timed (host ms, less the early fetches' issue, with the mode it planned by: "auto" at M = 1 plans by "gpu" where no
forward can use the CPU, ``cost.cpu_never_wins``) and every CPU branch logged (measured / model ms by phase).
``--profile CELL`` (a group's name) runs that group once more after the table with cProfile over every "auto" plan (the
early fetches' issue left out, as in the plan time; the profiler's overhead stays out of the table's steps), printed
before the table, top 25 by cumulative time; the group's plan line is filed as "CELL (profiled)". The JSON
($OUT/offload_cal_device_check.json) is rewritten after every group, so a machine taken back mid-run leaves the groups
done; the table prints last.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import statistics
import sys
import time
import traceback

import torch

from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, measure_costs, measure_offload
from moekit.bench.offload_report import auto_vs_best, modes_by_cell
from moekit.offload import CpuOptions
from offload_cal_log import MODES, BranchLog  # benchmarks/ on sys.path
from offload_cpu_anatomy import cpu_check, passes, print_passes
from offload_setting import offload_setting

LIMIT_S = 155.0  # no group starts past it (the one in flight finishes; its rows kept and printed): total < 175 s
PROFILE_LIMIT_S = 168.0  # the --profile pass (one group after the table, ~10 s) does not start past it
START = time.perf_counter()
TWIN = "gpu2"
CLOSE = ("*/*/*/8,skewed/25/router/1,skewed/50/router/1,skewed/75/none/1,uniform/75/none/1,"
         "skewed/75/router/32")  # ``--cells close``: 14 groups, ~70 s on the H200


class OutOfTime(Exception):
    pass


BRANCHES = BranchLog()


def cell_name(stream: str, fraction: float, prefetch: str, m: int) -> str:
    return f"{stream}/{round(fraction * 100)}/{prefetch}/{m}"


def keeper(patterns: list[str]):
    """``measure_offload``'s ``keep``: a group runs when its name matches a pattern (all when none given)."""
    def keep(stream, m, run) -> bool:
        name = cell_name(stream, run.fraction, "router" if run.prefetch else "none", m)
        return not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)
    return keep


def dump(result: dict) -> None:
    if os.environ.get("OUT"):
        result["total_s"] = time.perf_counter() - START
        path = os.path.join(os.environ["OUT"], "offload_cal_device_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, default=str)
        os.replace(path + ".tmp", path)


def _options(argv: list[str]) -> list[str]:
    """``--cells``' patterns (``CLOSE`` for "close"); sets ``BRANCHES.profile_cell`` from ``--profile`` (the
    smoke run's default one exercises the profiler too), ``LIMIT_S`` from ``--limit`` (two runs in one call)
    and ``OUT`` from ``--out`` (a folder, made)."""
    global LIMIT_S, PROFILE_LIMIT_S
    if "--out" in argv:
        os.environ["OUT"] = argv[argv.index("--out") + 1]
        os.makedirs(os.environ["OUT"], exist_ok=True)
    if "--limit" in argv:
        LIMIT_S = float(argv[argv.index("--limit") + 1])
        PROFILE_LIMIT_S = LIMIT_S + 13.0
    cells = argv[argv.index("--cells") + 1] if "--cells" in argv else ""
    BRANCHES.profile_cell = argv[argv.index("--profile") + 1] if "--profile" in argv else None
    parts = (BRANCHES.profile_cell or "skewed/0/none/1").split("/")
    if len(parts) != 4 or parts[0] not in ("skewed", "uniform") or not parts[3].isdigit():
        raise SystemExit(f"--profile takes a group name stream/cache%/prefetch/M, got {BRANCHES.profile_cell!r}")
    if "--smoke" in argv and BRANCHES.profile_cell is None:
        BRANCHES.profile_cell = "skewed/50/none/8"
    return [p for p in (CLOSE if cells == "close" else cells).split(",") if p]


def main(argv: list[str]) -> int:
    smoke, twin = "--smoke" in argv, "--no-twin" not in argv
    patterns = _options(argv)
    s = offload_setting(smoke)
    cuda, device, dtype, shape, config = s.cuda, s.device, s.dtype, s.shape, s.config
    options = (CpuOptions(threads=int(argv[argv.index("--cpu-threads") + 1])) if "--cpu-threads" in argv
               else CpuOptions())
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "shape": shape,
              "cells_asked": patterns, "twin": twin, "rows": [], "state": "running",
              "cpu_threads_asked": options.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}
    BRANCHES.install()
    shells = host_shells(config, dtype, device, layers=shape["layers"])
    batches = (1, 8, 32) if cuda else (1, 8)
    costs = _costs(argv, shells[0], device, options, batches)
    result["costs"], result["setup_s"] = dataclasses.asdict(costs), time.perf_counter() - START
    result["cpu_check"] = cpu_check(shells[0], costs, device, repeats=2 if smoke else 4)
    logged = len(BRANCHES.entries)
    result.update(passes(shells[0], costs, device, batches, MODES, repeats=2 if smoke else 6))
    del BRANCHES.entries[logged:]  # the exactness forwards stay out of the first group's log
    if "--fixed-threads" in argv and costs.cpu_threads:  # torch's count at the branch's for the table: no
        torch.set_num_threads(costs.cpu_threads)  # team-size switch a branch (``cpu_check``'s "=" rows)
        result["torch_threads"] = f"{result['torch_threads']} -> {costs.cpu_threads} after cpu_check (--fixed-threads)"
    result["branches"], group_size = BRANCHES.cells, len(MODES) + twin
    dump(result)

    def progress(r, key: str = "rows", suffix: str = "") -> None:
        result[key].append({**dataclasses.asdict(r)})
        if len(result[key]) % group_size == 0:  # a group's rows all in
            BRANCHES.close(cell_name(r.stream, r.cache_fraction, r.prefetch, r.M) + suffix)
            dump(result)
            if time.perf_counter() - START > LIMIT_S:
                raise OutOfTime

    def table(streams, keep, on_progress, ms=batches) -> str:
        try:
            measure_offload(device, batches=ms, policies=("lfu",), places=MODES, shells=shells, costs=costs,
                            cpu_options=options, on_progress=on_progress, online_cpu_rate=True, streams=streams,
                            variants={TWIN: ("gpu", {})} if twin else None, keep=keep, **shape)
            return "complete"
        except OutOfTime:
            return f"cut at {LIMIT_S:.0f} s"
        except Exception as e:  # noqa: BLE001 - the rows so far still print
            traceback.print_exc()
            return f"error {type(e).__name__}: {e}"

    result["state"] = table(("skewed", "uniform"), keeper(patterns), progress)
    if BRANCHES.profile_cell and time.perf_counter() - START < PROFILE_LIMIT_S:
        stream, _, _, m = BRANCHES.profile_cell.split("/")  # a pass of its own: cProfile stays out of the table's steps
        result["profile_rows"], BRANCHES.profile_on = [], True
        state = table((stream,), keeper([BRANCHES.profile_cell]),
                      lambda r: progress(r, "profile_rows", " (profiled)"), (int(m),))
        BRANCHES.profile_on = False
        result["profile"] = {"cell": BRANCHES.profile_cell, "state": state, "text": BRANCHES.profile_text()}
    dump(result)
    _print(result)
    return 0


def _costs(argv: list[str], shell, device, options: CpuOptions, batches) -> "MissCosts":
    """The calibration (``measure_costs``), with ``--cpu-tail-ms``' ``MissCosts.cpu_tail_s`` where given."""
    costs = measure_costs(shell, device, options, cpu_rows(batches), max(batches))
    if "--cpu-tail-ms" in argv:
        costs = dataclasses.replace(costs, cpu_tail_s=float(argv[argv.index("--cpu-tail-ms") + 1]) * 1e-3)
    return costs


def _noise(rows: list[dict]) -> dict[int, float]:
    """M -> the twin's noise: the root mean square of gpu2 / gpu - 1 over the cells at M."""
    out = {}
    for key, modes in modes_by_cell(rows).items():
        if TWIN in modes and "gpu" in modes:
            out.setdefault(key[4], []).append(modes[TWIN]["step_ms"] / modes["gpu"]["step_ms"] - 1.0)
    return {m: statistics.fmean(v * v for v in vs) ** 0.5 for m, vs in out.items()}


def paired(modes: dict[str, dict]) -> tuple[float, float] | None:
    """auto's steps less the better pure mode's, step by step (the stacks take turns, so step i of each
    ran in the same rotation): (mean difference, its standard error), both over that mode's mean step."""
    best = min((m for m in ("gpu", "cpu") if m in modes), key=lambda m: modes[m]["step_ms"], default=None)
    if best is None or "auto" not in modes or not modes["auto"].get("step_times_ms"):
        return None
    d = [a - b for a, b in zip(modes["auto"]["step_times_ms"], modes[best]["step_times_ms"])]
    if len(d) < 2:
        return None
    base = modes[best]["step_ms"]
    return statistics.fmean(d) / base, statistics.stdev(d) / len(d) ** 0.5 / base


def _after_cpu(r: dict) -> str:
    """A row's mean step after the cpu stack over its mean step after the others."""
    after = r.get("after_ms", {})
    rest = [v for k, v in after.items() if k != "cpu"]
    return f"{after['cpu'] / statistics.fmean(rest):.2f}" if "cpu" in after and rest else "-"


def _mode_text(modes: dict[str, dict], mode: str) -> str:
    r = modes.get(mode)
    if r is None:
        return f"{mode} -"
    return (f"{mode} {r['step_ms']:7.2f}±{r.get('step_sem_ms', 0.0):.2f} {r['x_floor']:4.2f}x(g"
            f"{r.get('x_floor_given', 0):.2f}) {r['hit_rate']:.3f}/{r['sim_hit_rate']:.3f} ac {_after_cpu(r)}")


def _group_text(modes: dict[str, dict]) -> str:
    r = next(iter(modes.values()))
    return (f"fix {r.get('fixed_ms', 0.0):.3f}(q{r.get('fixed_quiet_ms', 0.0):.3f})+{r.get('call_ms', 0.0):.3f}/"
            f"{r.get('fetch_layer_ms', 0.0):.3f} pf {r.get('prefetch_layer_ms', 0.0):.3f} cc "
            f"{r.get('copy_call_ms', 0.0):.3f} bl {r.get('branch_layer_ms', 0.0):.3f} cpu x"
            f"{r.get('cpu_scale', 1.0):.2f} br "
            + "/".join(f"{v.get('branch_rate', 0.0):.2f}" for v in modes.values() if v.get("branch_rate")) + " probe "
            + (", ".join(f"{mode} {v['probe_shape']} b{v['probe_busy']:.2f}/i{v['probe_idle']:.2f} n{v['probes']}"
                         for mode, v in modes.items() if v.get("probes")) or "-"))


def _paired_lines(rows: list[dict]) -> list[str]:
    """Per mode the x-floor range with the group's fixed cost throughout (the reference's median step; the
    headline pairs each step with its all-hit twin in the same round)."""
    out = []
    for mode in (*MODES, TWIN):
        paired = [r["x_floor_median"] for r in rows if r["compute_misses_on"] == mode and r.get("x_floor_median")]
        if paired:
            out.append(f"{mode:>4} x floor with the fixed cost the reference's median step throughout (before session "
                       f"23): {min(paired):.2f}-{max(paired):.2f}, {sum(x > 1.2 for x in paired)} of {len(paired)} > "
                       f"1.2, {sum(x < 0.85 for x in paired)} < 0.85")
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per mode the x-floor range and cells outside [0.85, 1.2]; the hit gap; auto / best against the twin's
    noise; prefetch's hit gain; the carry-over after the cpu stack."""
    out = []
    for mode in (*MODES, TWIN):
        xs = [r["x_floor"] for r in rows if r["compute_misses_on"] == mode]
        gs = [r.get("x_floor_given", 0.0) for r in rows if r["compute_misses_on"] == mode]
        bs = [r.get("x_floor_busy", 0.0) for r in rows if r["compute_misses_on"] == mode]
        if xs:
            out.append(f"{mode:>4}: x floor {min(xs):.2f}-{max(xs):.2f}, {sum(x > 1.2 for x in xs)} of {len(xs)} "
                       f"> 1.2, {sum(x < 0.85 for x in xs)} < 0.85 (CPU by the pre-group recalibration, g: "
                       f"{min(gs):.2f}-{max(gs):.2f}, {sum(x > 1.2 for x in gs)} > 1.2, {sum(x < 0.85 for x in gs)} < "
                       f"0.85; probe's busy rate throughout: {min(bs):.2f}-{max(bs):.2f}, {sum(x > 1.2 for x in bs)} > "
                       f"1.2, {sum(x < 0.85 for x in bs)} < 0.85)")
    out += _paired_lines(rows)
    for mode in ("cpu", "auto"):
        ran = [r["x_floor_cpu_ran"] for r in rows if r["compute_misses_on"] == mode and r.get("x_floor_cpu_ran")
               and r["cpu_tokens_per_step"]]
        if ran:
            out.append(f"{mode:>4} with each CPU branch as it ran in the timeline (a check of the floor's other "
                       f"terms): x {min(ran):.2f}-{max(ran):.2f}, {sum(x > 1.2 for x in ran)} of {len(ran)} > 1.2")
        rated = [(r["x_floor_probe"], r["branch_rate"]) for r in rows if r["compute_misses_on"] == mode
                 and r.get("branch_rate") and r["cpu_tokens_per_step"]]
        if rated:
            out.append(f"{mode:>4} x floor's CPU rate, its branches' time-weighted median: "
                       f"x{min(b for _, b in rated):.2f}-{max(b for _, b in rated):.2f} the model; by the probe's "
                       f"rates instead: x {min(x for x, _ in rated):.2f}-{max(x for x, _ in rated):.2f}, "
                       f"{sum(x > 1.2 for x, _ in rated)} of {len(rated)} > 1.2")
    gap = max((abs(r["hit_rate"] - r["sim_hit_rate"]) for r in rows), default=0.0)
    out.append(f"largest |hit - sim| {gap:.4f}")
    noise, cells = _noise(rows), modes_by_cell(rows)
    q = [(v, key) for key, modes in cells.items() if (v := auto_vs_best(modes)) is not None]
    if q:
        beyond = [key for v, key in q if v - 1.0 > 2 * noise.get(key[4], 0.0)]
        out.append(f"auto / best pure: worst {max(v for v, _ in q):.3f}, mean {statistics.fmean(v for v, _ in q):.3f}; "
                   f"twin noise (rms gpu2/gpu - 1) by M: " + ", ".join(f"{m} {n:.3f}" for m, n in sorted(noise.items()))
                   + f"; {len(beyond)} of {len(q)} cells slower by more than 2x the noise at their M"
                   + ("" if not beyond else ": " + ", ".join(cell_name(k[0], k[1], k[3], k[4]) for k in beyond)))
    for m in sorted({key[4] for _, key in q}):
        at = [v for v, key in q if key[4] == m]
        plans = {mode: [v[mode]["plan_ms"] for name, v in BRANCHES.cells.items() if name.endswith(f"/{m}")
                        and v[mode]["plans"]] for mode in ("gpu", "auto")}
        pairs = [p for key, modes in cells.items() if key[4] == m and (p := paired(modes)) is not None]
        out.append(f"target auto <= best pure at M = {m}: worst {max(at):.3f}, "
                   f"{sum(v - 1.0 > 2 * noise.get(m, 0.0) for v in at)} of {len(at)} beyond 2x noise "
                   f"{noise.get(m, 0.0):.3f}; paired by step: {sum(d > 2 * se for d, se in pairs)} of {len(pairs)} "
                   f"slower by over 2 sem (worst {max((d for d, _ in pairs), default=0.0):+.3f}); plan ms a forward "
                   f"gpu {statistics.fmean(plans['gpu'] or [0.0]):.3f} auto "
                   f"{statistics.fmean(plans['auto'] or [0.0]):.3f}")
    gains = [on["hit_rate"] - cells[k[:3] + ("none",) + k[4:]][mode]["hit_rate"] for k, modes in cells.items()
             if k[3] == "router" and k[:3] + ("none",) + k[4:] in cells for mode, on in modes.items()
             if mode in cells[k[:3] + ("none",) + k[4:]]]
    if gains:
        out.append(f"prefetch hit gain on skewed: mean {statistics.fmean(gains):+.3f}, least {min(gains):+.3f}")
    ratios = [float(t) for r in rows if r["compute_misses_on"] in ("gpu", TWIN) and (t := _after_cpu(r)) != "-"]
    if ratios:
        out.append(f"gpu steps after the cpu stack over after the others: mean {statistics.fmean(ratios):.3f}, "
                   f"range {min(ratios):.2f}-{max(ratios):.2f}")
    return out


def _print(result: dict) -> None:
    c = result.get("costs", {})
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus, torch threads "
          f"{result['torch_threads']}, shape {result['shape']}; setup {result.get('setup_s', 0):.0f} s, total "
          f"{time.perf_counter() - START:.0f} s; {result['state']}; cells asked {result['cells_asked'] or 'all'}; "
          f"OMP_WAIT_POLICY {result.get('omp_wait_policy', 'unset')}")
    if c:
        print(f"costs: link {c['link_bytes_per_s'] / 1e9:.1f} GB/s, GPU read {c['gpu_bytes_per_s'] / 1e9:.0f} GB/s; "
              f"CPU {c['cpu_step_s'] * 1e3:.3f} ms a call, per expert by rows " + ", ".join(
                  f"{r} {t * 1e6:.0f}" for r, t in c.get("cpu_rows_s", ())) + f" us at {c['cpu_threads']} threads "
              f"({c['cpu_gemm']}), margin {c['cpu_margin']:.2f}; second call {c['gpu_call_s'] * 1e3:.3f} ms, fetch "
              f"layer {c['fetch_layer_s'] * 1e3:.3f} ms, issue {c.get('issue_s', 0.0) * 1e6:.1f} us a fetched expert, "
              f"auto's CPU tail {c.get('cpu_tail_s', 0.0) * 1e3:.2f} ms a branch")
    print("CPU branch vs its model (cold experts, 1 row, ms median/max; phases' medians), by threads (=: torch's count "
          "set to it throughout, no switch a branch), experts, link, host idle before it (ms):")
    checks = result.get("cpu_check", [])
    print_passes(result.get("exact", []), result.get("anatomy", []))
    for r in checks:
        print(f"  t{r['threads']:>2}{'=' if r.get('fixed') else ' '}n{r['experts']} {'busy' if r['busy'] else 'idle'} "
              f"gap{r['gap_ms']:.0f}: {r['ms']:6.2f}/{r['max_ms']:6.2f} (compute {r['compute_ms']:6.2f}, "
              f"stage+wait+back {r['copies_ms']:5.2f}) model {r['model_ms']:6.2f} x{r['ms'] / r['model_ms']:.2f}")
    slow = [b["ms"] / a["ms"] for a in checks for b in checks if a["gap_ms"] == 0 < b["gap_ms"]
            and (a["threads"], a.get("fixed"), a["experts"], a["busy"]) == (b["threads"], b.get("fixed"), b["experts"],
                                                                            b["busy"])]
    if slow:
        print(f"  after an idle gap the branch took x{statistics.median(slow):.2f} its back-to-back time (median over "
              f"settings; range {min(slow):.2f}-{max(slow):.2f})")
    key = ("threads", "experts", "busy", "gap_ms")
    switch = [(a["ms"] / b["ms"], a["max_ms"] / b["max_ms"]) for a in checks for b in checks
              if not a.get("fixed") and b.get("fixed") and all(a[f] == b[f] for f in key)]
    if switch:
        print(f"  switching the team size a branch over a fixed count: median x"
              f"{statistics.median(m for m, _ in switch):.2f} (range {min(m for m, _ in switch):.2f}-"
              f"{max(m for m, _ in switch):.2f}), max over max x{statistics.median(x for _, x in switch):.2f} (range "
              f"{min(x for _, x in switch):.2f}-{max(x for _, x in switch):.2f})")
    profile = result.get("profile", {})
    if profile.get("text"):
        print(f"cProfile of auto's plans in {profile['cell']} (top 25 by cumulative time; early fetches' issue left "
              f"out):")
        print(profile["text"])
    print("plans and CPU branches by group: mode plan ms mean/max by the places planned | CPU branches measured/model")
    for name, entries in result.get("branches", {}).items():
        print(f"  {name:<22} {BranchLog.line(entries)}")
    print("cell | mode step ms±sem x floor (g: CPU by the pre-group recalibration) hit/sim, ac: step after the cpu "
          "stack / after others | auto/best (paired by step: mean±sem over best) | twin gpu2/gpu | group: fixed layer "
          "ms (q: quiet)+call/fetch layer, pf: prefetch layer, cc: a call after a copy, bl: a layer's host work beside "
          "its CPU branch, CPU scale (pre-group), probe by mode: experts x rows, b/i: busy/idle over model, n probes")
    for (stream, fraction, _, prefetch, m), modes in modes_by_cell(result["rows"]).items():
        q, pair = auto_vs_best(modes), paired(modes)
        q_text = "-" if q is None else f"{q:.3f}" + ("" if pair is None else f"({pair[0]:+.3f}±{pair[1]:.3f})")
        tw = (f"{modes[TWIN]['step_ms'] / modes['gpu']['step_ms']:.3f}" if TWIN in modes and "gpu" in modes else "-")
        print(f"{cell_name(stream, fraction, prefetch, m):<18} | "
              + " | ".join(_mode_text(modes, mode) for mode in MODES) + f" | {q_text} | {tw} | " + _group_text(modes))
    for line in summary(result["rows"]) if result["rows"] else ["no rows"]:
        print("  " + line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
