"""Tables of ``offload_stall_device_check``'s JSON (printed last by it; or ``python3 offload_stall_report.py FILE``)."""

from __future__ import annotations

import json
import statistics
import sys
import time


def _q(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def micro_lines(rows: list[dict]) -> list[str]:
    """Part 2 by (variant, how, gap, experts): ratio to the model median / p90 / max, slow (> 3x) branches and
    what was in them: collections, the threads' run-queue wait, context switches."""
    out = ["micro: CPU branch after the host idled (1 row an expert, cold, idle link): ms median/max, x model "
           "median/max, slow (> 3x); slow ones' mean gc ms, run-queue wait ms (all threads / worst thread), ivcsw"]
    keys = sorted({(r["runner"], r["how"], r["gap_ms"], r["experts"]) for r in rows})
    for key in keys:
        got = [r for r in rows if (r["runner"], r["how"], r["gap_ms"], r["experts"]) == key]
        x = [r["ms"] / r["model_ms"] for r in got]
        slow = [r for r in got if r["ms"] > 3 * r["model_ms"]]

        def mean(k, rs=slow):
            return statistics.fmean(r[k] for r in rs) if rs else 0.0
        out.append(f"  {key[0]:>6} {key[1]:>5} {key[2]:3.0f} ms n{key[3]}: "
                   f"{statistics.median(r['ms'] for r in got):6.2f}/{max(r['ms'] for r in got):6.2f} "
                   f"x{statistics.median(x):.2f}/{max(x):.2f} slow {len(slow)}/{len(got)}; slow: gc "
                   f"{mean('gc_ms'):.2f} wait {mean('wait_ms'):.2f}/{mean('wait_max_ms'):.2f} ivcsw "
                   f"{mean('ivcsw'):.1f} nvcsw {mean('nvcsw') if slow and 'nvcsw' in slow[0] else 0.0:.1f} run/ms "
                   f"{statistics.fmean(r['run_ms'] / r['ms'] for r in slow) if slow else 0.0:.1f} (others: wait "
                   f"{mean('wait_ms', [r for r in got if r not in slow]):.2f}/"
                   f"{mean('wait_max_ms', [r for r in got if r not in slow]):.2f})")
    for r in sorted((r for r in rows if r["ms"] > 3 * r["model_ms"] and r.get("threads")), key=lambda r: -r["ms"])[:6]:
        out.append(f"    slow {r['runner']} {r['how']} {r['gap_ms']:.0f} n{r['experts']} {r['ms']:.2f} ms: threads "
                   f"(run ms, wait ms, slices) {r['threads'][:10]}")
    by_runner = {}
    for r in rows:
        by_runner.setdefault(r["runner"], []).append(r["ms"] / r["model_ms"])
    out.append("  by variant, all gaps: " + "; ".join(
        f"{k} x{statistics.median(v):.2f} p90 {_q(v, 0.9):.2f} max {max(v):.2f} slow {sum(x > 3 for x in v)}/{len(v)}"
        for k, v in sorted(by_runner.items())))
    return out


def cell_lines(cell: dict) -> list[str]:
    out = [f"cell {cell['cell']} ({cell['slots']} slots): stack mean / median ±sem ms, n, stalled (> 1.5x median), "
           f"max, mean without stalled | gc ms in steps (steps with gc, stalled with gc) | branches, slow > 3x (with "
           f"gc), median x model | hits, CPU experts a step"]
    for name, s in cell["stacks"].items():
        out.append(f"  {name:<11} {s['mean_ms']:7.2f} / {s['median_ms']:7.2f} ±{s['sem_ms']:.2f} n{s['steps']} "
                   f"st{s['stalled']} max {s['max_ms']:7.2f} unst {s['mean_unstalled_ms']:7.2f} | gc {s['gc_ms']:6.1f} "
                   f"({s['gc_steps']}, {s['stalled_gc']}) | br {s['branches']} slow {s['slow']} ({s['slow_gc']}) "
                   f"x{s['ratio_median']:.2f} | {s['hits']:.1f} / {s['cpu_experts']:.2f}")
        for b in s["slow_list"][:3]:
            out.append(f"      slow branch {b}")
    auto = cell["stacks"].get("auto")
    for name, p in cell["paired"].items():
        out.append(f"  {name} - auto, paired by step: {p['mean_ms']:+.2f} ±{p['sem_ms']:.2f} ms (n{p['n']})"
                   + (f" = {p['mean_ms'] / auto['mean_ms']:+.3f} of auto's mean" if auto else ""))
    best = min((cell["stacks"][m]["mean_ms"], m) for m in ("gpu", "cpu") if m in cell["stacks"])
    for name in (n for n in cell["stacks"] if n.startswith("auto")):
        s = cell["stacks"][name]
        med_best = min(cell["stacks"][m]["median_ms"] for m in ("gpu", "cpu") if m in cell["stacks"])
        out.append(f"  {name} / best pure ({best[1]}): mean {s['mean_ms'] / best[0]:.3f}, median "
                   f"{s['median_ms'] / med_best:.3f}")
    return out


def print_result(result: dict, start: float | None = None) -> None:
    total = time.perf_counter() - start if start is not None else result.get("total_s", 0.0)
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus (affinity "
          f"{len(result['affinity'])}), torch threads {result['torch_threads']}; CPU branch {result['cpu_threads']} "
          f"threads ({result['cpu_gemm']}); gc threshold {result['gc_threshold']}, {result['gc_tracked']} objects; "
          f"total {total:.0f} s")
    ex = result.get("exact", [])
    print(f"exact: {sum(r['pass'] for r in ex)} of {len(ex)} PASS; rel L2 by variant: " + "; ".join(
        f"{k} max {max(r['rel_l2'] for r in ex if r['runner'] == k):.2e} (vs the first "
        f"{max(r['vs_inline'] for r in ex if r['runner'] == k):.1e})"
        for k in sorted({r['runner'] for r in ex})))
    for line in micro_lines(result.get("micro", [])):
        print(line)
    for cell in result.get("cells", []):
        for line in cell_lines(cell):
            print(line)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print_result(json.load(f))
