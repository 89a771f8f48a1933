"""``offload_cal_device_check.py``'s log of every "auto" / "cpu" / "gpu" forward's plan (host ms, the mode it
planned by; cProfile over auto's plans during a profile pass) and CPU branch (measured and model ms by phase,
the threads, the host time since the previous branch), by group: ``OffloadedMoE._plan`` and ``run_routed``
wrapped (``install``); ``close`` files a finished group's entries as a summary under its name."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

from moekit.offload import OffloadedMoE

MODES = ("gpu", "cpu", "auto")


class BranchLog:
    """Every forward's plan (host ms, the mode it planned by) and CPU branch, by group: ``OffloadedMoE._plan``
    and ``run_routed`` wrapped; ``close`` files a finished group's entries under its name."""

    def __init__(self) -> None:
        self.entries, self.cells = [], {}
        self.profile_cell, self.profile_on, self.profiler = None, False, cProfile.Profile()
        self.last_branch = 0.0  # when the latest CPU branch's forward ended (perf_counter)

    def profiling(self, layer) -> bool:
        """Whether ``layer``'s plan is profiled now: an "auto" layer during the profile pass."""
        return self.profile_on and layer.compute_misses_on == "auto"

    def profile_text(self, top: int = 25) -> str:
        """The profiled plans' top functions by cumulative time, in ms and us a call ("" when none ran)."""
        try:
            stats = pstats.Stats(self.profiler).stats
        except TypeError:  # no data: the cell never ran
            return ""
        rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]
        lines = ["   calls  tot ms  cum ms  cum us/call  function"]
        for (path, line, name), (_, calls, tot, cum, _) in rows:
            where = f"{path.split('moekit/')[-1] if 'moekit/' in path else os.path.basename(path)}:{line}"
            lines.append(f"  {calls:6d} {tot * 1e3:7.3f} {cum * 1e3:7.3f} {cum / calls * 1e6:12.2f}  {name} ({where})")
        return "\n".join(lines)

    def install(self) -> None:
        run, plan, log = OffloadedMoE.run_routed, OffloadedMoE._plan, self

        def timed_plan(layer, tokens, hits, place, issue=None):
            profiler = log.profiler if log.profiling(layer) else None
            early, start = [0.0], time.perf_counter()

            def timed_issue(experts):  # the early fetches' issue is host time the gpu path pays later too
                if profiler is not None:
                    profiler.disable()
                clock = time.perf_counter()
                issue(experts)
                early[0] += time.perf_counter() - clock
                if profiler is not None:
                    profiler.enable()

            if profiler is not None:
                profiler.enable()
            out = plan(layer, tokens, hits, place, timed_issue if issue is not None else None)
            if profiler is not None:
                profiler.disable()
            log.entries.append({"mode": layer.compute_misses_on, "place": place, "misses": len(tokens),
                                "plan_ms": (time.perf_counter() - start - early[0]) * 1e3, "early_ms": early[0] * 1e3})
            return out

        def logged(layer, x2d, routing):
            out = run(layer, x2d, routing)
            p, rows, end = layer.last_cpu, list(layer.last_stats.cpu_rows), time.perf_counter()
            if p is not None and layer.costs is not None and rows:
                log.entries.append({"mode": layer.compute_misses_on, "layer": layer.layer_id, "rows": rows,
                                    "ms": p.total_s * 1e3, "compute_ms": p.compute_s * 1e3, "back_ms": p.back_s * 1e3,
                                    "model_ms": layer.costs.cpu_side_s(rows) * 1e3, "threads": p.threads,
                                    "gap_ms": (end - log.last_branch) * 1e3 - p.total_s * 1e3})
                log.last_branch = end
            return out

        OffloadedMoE.run_routed, OffloadedMoE._plan = logged, timed_plan

    def close(self, name: str) -> None:
        """File the group's entries as a summary (``summarize``) under ``name``."""
        self.cells[name], self.entries = self.summarize(self.entries), []

    @staticmethod
    def summarize(entries: list[dict]) -> dict:
        """Per mode: forwards planned, plan ms mean / max, the places planned by; per CPU mode its branches,
        measured and model ms summed, the ratio's median and max, ms in the result's copy back."""
        out = {}
        for mode in MODES:
            plans = [e for e in entries if e["mode"] == mode and "plan_ms" in e]
            got = [e for e in entries if e["mode"] == mode and "plan_ms" not in e]
            ratios = [e["ms"] / e["model_ms"] for e in got if e["model_ms"] > 0]
            out[mode] = {"plans": len(plans),
                         "plan_ms": statistics.fmean(e["plan_ms"] for e in plans) if plans else 0.0,
                         "plan_max_ms": max((e["plan_ms"] for e in plans), default=0.0),
                         "early_ms": statistics.fmean(e["early_ms"] for e in plans) if plans else 0.0,
                         "places": sorted({e["place"] for e in plans}), "branches": len(got),
                         "ms": sum(e["ms"] for e in got), "model_ms": sum(e["model_ms"] for e in got),
                         "back_ms": sum(e["back_ms"] for e in got),
                         "ratio_median": statistics.median(ratios) if ratios else 0.0,
                         "ratio_max": max(ratios, default=0.0),
                         **BranchLog.outliers(got)}
        return out

    @staticmethod
    def outliers(got: list[dict], over: float = 3.0) -> dict:
        """The branches over ``over`` x their model: how many, the share of their time in compute, and the
        median host time since the previous branch ended before them and before the others (a long idle gap
        lets the CPU's threads sleep and its clocks drop)."""
        out = [e for e in got if e["model_ms"] > 0 and e["ms"] > over * e["model_ms"]]
        rest = [e for e in got if e not in out]
        return {"outliers": len(out),
                "outlier_compute": sum(e["compute_ms"] for e in out) / max(sum(e["ms"] for e in out), 1e-9),
                "gap_outliers_ms": statistics.median(e["gap_ms"] for e in out) if out else 0.0,
                "gap_others_ms": statistics.median(e["gap_ms"] for e in rest) if rest else 0.0}

    @staticmethod
    def line(summary: dict) -> str:
        """One group's summary in a line."""
        parts = []
        for mode, v in summary.items():
            text = f"{mode} plan {v['plan_ms']:.3f}/{v['plan_max_ms']:.3f} by {'+'.join(v['places']) or '-'}"
            text += f" (+{v['early_ms']:.3f} early fetches)" if v.get("early_ms") else ""
            if v["branches"]:
                text += (f", {v['branches']} br {v['ms']:.1f}/{v['model_ms']:.1f} ms x{v['ratio_median']:.2f} "
                         f"max x{v['ratio_max']:.2f}")
                text += (f" ({v['outliers']} > 3x: {v['outlier_compute']:.0%} compute, gap {v['gap_outliers_ms']:.1f} "
                         f"vs {v['gap_others_ms']:.1f} ms)") if v.get("outliers") else ""
            parts.append(text)
        return " | ".join(parts)
