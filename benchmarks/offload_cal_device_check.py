"""Device check for issue #18's floor targets: every cell's measured step within [0.85, 1.2]x its predicted
floor (a floor the step beats by more is a wrong model, not a fast step), and "auto" <= the better pure mode.

    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_cal_device_check.py (H200; < 150 s: LIMIT_S inside)
    PYTHONPATH=$PWD python benchmarks/offload_cal_device_check.py --smoke    (CPU, tiny shapes: runs, no numbers)

``moekit bench --offload``'s table at Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16, 4 layers
sharing one cache, each layer its own host weights: 4.8 GB pinned): cache 25 / 50 / 75% of the experts x
M = 1 / 8 / 32 x gpu / cpu / auto, lfu, on the uniform stream (no prefetch) and the skewed one (prefetch none and router), "auto" with the online CPU
rate (``moekit.offload.CpuRate``); then the same table with auto on the calibrated rate alone, as time
allows (rows marked online on / off).
The floor is ``moekit.bench.offload_floor``'s timeline: rates measured in the same run (link, GPU read,
the CPU branch's call cost and per-expert time at 1-16 rows, scaled to the host's rate before each group
of rows), a layer's fixed cost from an all-hit stack taking its turns among the group's cells
(``offload_cells``), and, on all-hit steps of the same stream and M on a cache of the group's size, a second
experts call and the least a forward with a fetch takes (one fetch forced into every layer of the same
steps, over all hits: ``FixedCosts.fetch_layer_s``, which "auto" prices too), no margin.

The skewed stream runs first (its M = 1 cells with prefetch and M = 32 at 25% are the ones over target).
The floor includes a prefetching layer's host work (``FixedCosts.prefetch_layer_s``, measured per group by one
prefetch forced after every layer); "x no-pf" is the step over the floor without it. ``measure_costs``' own
GPU terms (second call, least fetch layer, timed at M = 1 on its probe, ``gpu_terms``) print next to the
groups' M = 1 values. A probe times a CPU branch's end (a matmul at half the threads, then the result's pinned copy
queued) with the copy after the thread count is restored (the old path), inside the setting (the new one),
and with no change. Each forward's miss planning is timed (``OffloadedMoE._plan``: host time before any fetch
is issued, which no floor term holds). Every CPU branch of the cells is logged (layer, rows, measured host ms by phase, the
calibrated model's ms for its rows, the online rate's scale when it ran): per cell and mode, the branches'
measured / model (median, max) and, for the auto cells with the largest total excess, each branch.

Printed last, per cell: each mode's step ms, step / floor (and / the old floor: the fixed cost measured before
the group's cells, not by the all-hit stack among them, and no ``fetch_layer_s``), hit /
simulated hit, auto over the faster pure mode, the group's fixed ms (layer + second call / the least a forward
with a fetch takes) and CPU scale; then per mode the x-floor range and how many cells fall outside [0.85, 1.2]
(and the same for the old floor), and the CPU time per one-row expert the groups were priced at. A mode
or cell that did not run prints '-'. JSON goes to $OUT/offload_cal_device_check.json when $OUT is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch

from moekit.bench import offload_measure
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, measure_costs, measure_offload
from moekit.bench.offload_report import auto_vs_best, modes_by_cell
from moekit.config import MoEConfig
from moekit.experts.cpu_packed import onednn_linear
from moekit.offload import CpuOptions, OffloadedMoE, staging
from moekit.offload.cpu_path import torch_threads

LIMIT_S = 115.0  # the cells stop past it, after the group in flight (rows so far kept and printed): total < 150 s
START = time.perf_counter()
QWEN3_30B = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "layers": 4}
SMOKE = {"experts": 16, "hidden": 64, "inter": 32, "top_k": 2, "layers": 2}
MODES = ("gpu", "cpu", "auto")
PARTS = ((("lfu",), True), (("lfu",), False))  # (policies, online CPU rate for auto); the second as time allows


class OutOfTime(Exception):
    pass


class BranchLog:
    """Every CPU branch the cells' layers ran (``OffloadedMoE.run_routed`` wrapped), by cell: the entries of
    one ``run_cells`` call (a group) go to the cell of the group's first row (``assign``)."""

    def __init__(self) -> None:
        self.entries, self.group, self.cells = [], [], {}

    def install(self) -> None:
        run, plan, cells, log = OffloadedMoE.run_routed, OffloadedMoE._plan, offload_measure.run_cells, self

        def timed_plan(layer, tokens, hits):
            start = time.perf_counter()
            out = plan(layer, tokens, hits)
            log.entries.append({"mode": layer.compute_misses_on, "plan_ms": (time.perf_counter() - start) * 1e3,
                                "misses": len(tokens)})
            return out

        def logged(layer, x2d, routing):
            scale = layer.cpu_rate.scale if layer.cpu_rate is not None else None
            out = run(layer, x2d, routing)
            p, rows = layer.last_cpu, list(layer.last_stats.cpu_rows)
            if p is not None and layer.costs is not None and rows:
                log.entries.append({"mode": layer.compute_misses_on, "layer": layer.layer_id, "rows": rows,
                                    "hits": layer.last_stats.hits, "fetched": layer.last_stats.fetched,
                                    "ms": p.total_s * 1e3, "compute_ms": p.compute_s * 1e3, "wait_ms": p.wait_s * 1e3,
                                    "back_ms": p.back_s * 1e3,
                                    "model_ms": layer.costs.cpu_side_s(rows) * 1e3, "scale": scale})
            return out

        def grouped(*args, **kwargs):
            self.entries = []
            try:
                return cells(*args, **kwargs)
            finally:
                log.group = self.entries

        OffloadedMoE.run_routed, OffloadedMoE._plan, offload_measure.run_cells = logged, timed_plan, grouped

    def assign(self, r) -> None:
        if r.compute_misses_on == MODES[0]:
            self.cells[_cell_name(r.stream, r.cache_fraction, r.prefetch, r.M)] = self.group

    @staticmethod
    def lines_of(cells: dict[str, list[dict]], worst: int = 1, most: int = 16) -> list[str]:
        """One line per cell: auto's planning ms a forward (mean / max), then per CPU mode its branches,
        measured / model ms, the ratio's median and max; then up to ``most`` branches of the ``worst`` auto
        cells by total excess over the model (rows truncated)."""
        out, excess = [], {}
        for cell, entries in cells.items():
            plans = [e["plan_ms"] for e in entries if e["mode"] == "auto" and "plan_ms" in e]
            parts = [f"plan {statistics.fmean(plans):.3f}/{max(plans):.3f}" if plans else "plan -"]
            for mode in MODES[1:]:
                got = [e for e in entries if e["mode"] == mode and "plan_ms" not in e]
                ratios = [e["ms"] / e["model_ms"] for e in got if e["model_ms"] > 0]
                parts.append(f"{mode} {len(got)} br {sum(e['ms'] for e in got):.1f}/{sum(e['model_ms'] for e in got):.1f}"
                             f" ms x{statistics.median(ratios) if ratios else 0:.2f} max x{max(ratios, default=0):.2f}"
                             f" back {sum(e.get('back_ms', 0.0) for e in got):.1f}")
                if mode == "auto" and got:
                    excess[cell] = sum(e["ms"] - e["model_ms"] for e in got)
            out.append(f"{cell} | " + " | ".join(parts))
        for cell in sorted(excess, key=excess.get, reverse=True)[:worst]:
            out.append(f"branches of auto {cell}: layer rows | ms (wait, compute) / model | hits fetched | online scale")
            for e in [e for e in cells[cell] if e["mode"] == "auto" and "plan_ms" not in e][:most]:
                rows = e["rows"] if len(e["rows"]) <= 12 else e["rows"][:12] + ["..."]
                scale = "-" if e["scale"] is None else f"{e['scale']:.2f}"
                out.append(f"  L{e['layer']} {rows} | {e['ms']:.2f} ({e['wait_ms']:.2f}, {e['compute_ms']:.2f}) / "
                           f"{e['model_ms']:.2f} | {e['hits']} {e['fetched']} | {scale}")
        return out


def first_calls(shape: dict, dtype: torch.dtype, rows=(16, 32, 33, 61)) -> list[dict]:
    """oneDNN's linear (onednn_fused's GEMM) by rows: ms of a first call at each, then of a second. 16 and 32
    were warmed by the calibration, 33 and 61 no cell ran: a first call much dearer there is a one-off (a
    kernel built for the shape); the level by rows shows where the GEMM's time stops being linear (one H200
    run: 10-13 ms at 33-61 rows, both calls; another's calibration 0.56 ms an expert, both GEMMs, at 16)."""
    op = onednn_linear(dtype)
    if op is None:
        return []
    w = torch.randn(2 * shape["inter"], shape["hidden"], dtype=dtype)
    out = []
    for r in rows:
        x, ms = torch.randn(r, shape["hidden"], dtype=dtype), []
        for _ in range(2):
            start = time.perf_counter()
            op(x, w, None, "none", [], "")
            ms.append((time.perf_counter() - start) * 1e3)
        out.append({"rows": r, "first_ms": ms[0], "second_ms": ms[1]})
    return out


def thread_probe(shape: dict, device, dtype: torch.dtype, repeats: int = 7) -> list[dict]:
    """Host ms (median of ``repeats``) of a CPU branch's end at M = 8 and 32: a small matmul at half of torch's
    thread count, then the [M, K] result's pinned copy queued to ``device`` (``staging.to_device``): "after",
    the copy once the thread count is restored (the old path); "inside", within the same setting (this
    branch's ``CpuPath.finish``); "same": no change of thread count."""
    n = torch.get_num_threads()
    half, w = max(1, n // 2), torch.randn(shape["hidden"], shape["hidden"], dtype=dtype)
    buffers, out = staging.Buffers(pin=device.type == "cuda"), []
    for m in (8, 32):
        x, ms = torch.randn(m, shape["hidden"], dtype=dtype), {}
        for way in ("after", "inside", "same"):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                with torch_threads(n if way == "same" else half):
                    y = x @ w
                    if way != "after":
                        staging.to_device(y, device, pin=buffers.pin, buffers=buffers)
                if way == "after":
                    staging.to_device(y, device, pin=buffers.pin, buffers=buffers)
                times.append((time.perf_counter() - start) * 1e3)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            ms[way] = statistics.median(times)
        out.append({"M": m, **ms})
    return out


def _cell_name(stream: str, fraction: float, prefetch: str, m: int) -> str:
    return f"{stream[:4]} {fraction:4.0%} {prefetch[:4]:>4} M={m:<2}"


BRANCHES = BranchLog()


def _left() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def run_part(shells, device, costs, shape: dict, policies: tuple[str, ...], online: bool,
             batches) -> tuple[list[dict], dict | None]:
    """One part's rows (so far, each marked with ``online``) and its document (None when cut by the time limit)."""
    rows = []

    def progress(r):
        rows.append({**dataclasses.asdict(r), "online": online})
        BRANCHES.assign(r)
        if _left() < 0 and r.compute_misses_on == MODES[-1]:  # a group's rows all come back before it stops
            raise OutOfTime

    try:
        doc = measure_offload(device, batches=batches, policies=policies, places=MODES, shells=shells, costs=costs,
                              on_progress=progress, online_cpu_rate=online, streams=("skewed", "uniform"), **shape)
    except OutOfTime:
        doc = None
    except Exception as e:  # noqa: BLE001 - a failing part keeps its rows, and the table still prints
        traceback.print_exc()
        doc = {"error": f"{type(e).__name__}: {e}"}
    return rows, doc


def main(smoke: bool) -> int:
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    shape = dict(QWEN3_30B if cuda else SMOKE)
    config = MoEConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"], num_experts=shape["experts"],
                       top_k=shape["top_k"])
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "shape": shape, "rows": [],
              "parts": [], "fixed_ms": {}}
    BRANCHES.install()
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape["layers"])
    batches = (1, 8, 32) if cuda else (1, 8)
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows(batches), max(batches))
    result["costs"] = dataclasses.asdict(costs)
    result["setup_s"] = time.perf_counter() - START
    for policies, online in PARTS:
        name = f"{'/'.join(policies)} online={online}"
        if _left() < 90 and result["parts"]:
            result["parts"].append({"name": name, "state": "skipped"})
            continue
        clock = time.perf_counter()
        rows, doc = run_part(shells, device, costs, shape, policies, online, batches)
        result["rows"] += rows
        state = "cut" if doc is None else doc.get("error", "complete")
        if doc is not None and "fixed_ms" in doc:
            result["fixed_ms"].update({f"{name} {k}": v for k, v in doc["fixed_ms"].items()})
        result["parts"].append({"name": name, "state": state, "seconds": time.perf_counter() - clock,
                                "cpu_margin": None if doc is None else doc.get("cpu_margin")})
    result["branches"] = BRANCHES.cells
    result["first_calls"] = first_calls(shape, torch.bfloat16 if cuda else torch.float32)
    result["thread_probe"] = thread_probe(shape, device, torch.bfloat16 if cuda else torch.float32)
    result["total_s"] = time.perf_counter() - START
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "offload_cal_device_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    _print(result)
    return 0


def by_cell(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(online, stream, cache %, policy, prefetch, M) -> {mode: row}: ``offload_report``'s cells, online
    rate on first."""
    return {(online, *key): modes for online in (True, False)
            for key, modes in modes_by_cell([r for r in rows if r.get("online", False) == online]).items()}


def _mode_text(modes: dict[str, dict], mode: str) -> str:
    r = modes.get(mode)
    if r is None:
        return f"{mode} -"
    return (f"{mode} {r['step_ms']:7.2f} {r['x_floor']:4.2f}x(no-pf {r.get('x_floor_no_prefetch', 0.0):4.2f}) "
            f"{r['hit_rate']:.2f}/{r['sim_hit_rate']:.2f}")


def _group_text(modes: dict[str, dict]) -> str:
    """The group's fixed costs (ms: per layer, by the all-hit reference among the cells and, q, measured before
    them; + a second call / the least a forward with a fetch takes / how early its copies start) and CPU scale,
    from any of its rows."""
    r = next(iter(modes.values()))
    return (f"fix {r.get('fixed_ms', 0.0):.2f}(q{r.get('fixed_quiet_ms', 0.0):.2f})+{r.get('call_ms', 0.0):.2f}"
            f"/{r.get('fetch_layer_ms', 0.0):.2f}/{r.get('overlap_ms', 0.0):.2f} pf {r.get('prefetch_layer_ms', 0.0):.2f}"
            f" cpu x{r.get('cpu_scale', 1.0):.2f}")


def summary(rows: list[dict]) -> list[str]:
    """Per mode: the x-floor range, cells > 1.2; auto / best pure; the CPU rate range the groups used."""
    out = []
    for mode in MODES:
        xs = [r["x_floor"] for r in rows if r["compute_misses_on"] == mode]
        old = [r.get("x_floor_no_prefetch", 0.0) for r in rows if r["compute_misses_on"] == mode]
        out.append(f"{mode:>4}: " + ("-" if not xs else f"x floor {min(xs):.2f}-{max(xs):.2f}, "
                                    f"{sum(x > 1.2 for x in xs)} of {len(xs)} cells > 1.2, "
                                    f"{sum(x < 0.85 for x in xs)} < 0.85 (floor without prefetch_layer_s: "
                                    f"{min(old):.2f}-{max(old):.2f}, {sum(x > 1.2 for x in old)} > 1.2)"))
    q = [v for modes in by_cell(rows).values() if (v := auto_vs_best(modes)) is not None]
    out.append("auto / best pure: " + ("-" if not q else f"worst {max(q):.3f}, mean {statistics.fmean(q):.3f}, "
                                       f"{sum(v > 1.03 for v in q)} of {len(q)} cells > 1.03"))
    rates = [r.get("cpu_expert_us", 0.0) for r in rows if r["compute_misses_on"] != "gpu"]
    if rates:
        out.append(f"CPU time per one-row expert over the groups: {min(rates):.1f}-{max(rates):.1f} us")
    return out


def _print(result: dict) -> None:
    c = result.get("costs", {})
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus, torch threads "
          f"{result['torch_threads']}, shape {result['shape']}; setup {result['setup_s']:.0f} s, "
          f"total {result['total_s']:.0f} s")
    if c:
        print(f"costs: link {c['link_bytes_per_s'] / 1e9:.1f} GB/s, during CPU {(c['link_cpu_bytes_per_s'] or 0) / 1e9:.1f}"
              f" GB/s, GPU read {c['gpu_bytes_per_s'] / 1e9:.0f} GB/s; CPU {c['cpu_step_s'] * 1e3:.3f} ms + "
              f"{c['cpu_expert_s'] * 1e6:.1f} us/expert + {c['cpu_token_s'] * 1e6:.2f} us/token at "
              f"{c['cpu_threads']} threads ({c['cpu_gemm']}), margin {c['cpu_margin']:.2f}; per expert by rows: "
              + ", ".join(f"{r} {t * 1e6:.0f} us" for r, t in c.get("cpu_rows_s", ())))
        print(f"measure_costs' GPU terms (M = 1, probe): second call {c['gpu_call_s'] * 1e3:.3f} ms, least fetch layer "
              f"{c['fetch_layer_s'] * 1e3:.3f} ms (the groups' own: 'fix' below, +call/fetch layer)")
    for p in result["parts"]:
        extra = "" if p["state"] == "skipped" else f", {p['seconds']:.0f} s"
        print(f"part {p['name']}: {p['state']}{extra}")
    print("fixed per-layer ms: " + (", ".join(f"{k} {v:.3f}" for k, v in result["fixed_ms"].items()) or "-"))
    print("oneDNN linear [2N, K] first / second call ms by rows (<= max M warmed): " + (", ".join(
        f"{f['rows']} rows {f['first_ms']:.2f}/{f['second_ms']:.2f}" for f in result.get("first_calls", ())) or "-"))
    print("branch end, host ms (matmul at half the threads + result copy queued): " + (", ".join(
        f"M={t['M']} after {t['after']:.3f} inside {t['inside']:.3f} same {t['same']:.3f}"
        for t in result.get("thread_probe", ())) or "-"))
    print("by cell: auto's plan ms a forward mean/max | per CPU mode: branches, measured/model ms (no margin), "
          "ratio median, max, ms in the back phase (result copy)")
    for line in BranchLog.lines_of(result.get("branches", {})):
        print("  " + line)
    print("online cell | mode step ms, x floor (no-pf: without prefetch_layer_s), hit/sim | auto/best | "
          "group: fixed ms layer(q: before the cells)+call/fetch layer/overlap, pf: prefetch layer, CPU scale")
    for (online, stream, fraction, policy, prefetch, m), modes in by_cell(result["rows"]).items():
        q = auto_vs_best(modes)
        print(f"{'on ' if online else 'off'} {stream[:4]} {fraction:4.0%} {policy} {prefetch[:4]:>4} M={m:<2} | "
              + " | ".join(_mode_text(modes, mode) for mode in MODES) + " | " + ("-" if q is None else f"{q:.3f}")
              + " | " + _group_text(modes))
    if not result["rows"]:
        print("no rows")
    for online in (True, False):
        rows = [r for r in result["rows"] if r.get("online", False) == online]
        if rows:
            print(f"online CPU rate {'on' if online else 'off'}:")
            for line in summary(rows):
                print("  " + line)


if __name__ == "__main__":
    sys.exit(main("--smoke" in sys.argv[1:]))
