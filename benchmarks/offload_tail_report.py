"""``offload_tail_device_check``'s printed tables: the team part's rows by kind and gap, a cell's marks and modes."""

from __future__ import annotations

import time

from offload_step_anatomy import _median  # benchmarks/ on sys.path

GAPS_S = (0.0, 0.002, 0.01, 0.05, 0.2, 0.6)  # the check's idle gaps (``offload_tail_device_check.GAPS_S``)


def team_lines(rows: list[dict]) -> list[str]:
    out = []
    for what in ("probe", "branch", "wake+branch"):
        for gap in GAPS_S:
            got = [r for r in rows if r["kind"] == what and r["gap_ms"] == gap * 1e3]
            if not got:
                continue
            ivcsw = (f"ivcsw {sum(r['ivcsw'] for r in got)}/main {sum(r['ivcsw_main'] for r in got)} minflt "
                     f"{sum(r['minflt'] for r in got)}")
            if what == "probe":
                out.append(f"  probe  gap {gap * 1e3:5.0f}: wall {_median([r['wall_ms'] for r in got]):6.3f} (max "
                           f"{max(r['wall_ms'] for r in got):6.3f}) wake max "
                           f"{_median([r['wake_max_ms'] for r in got]):.3f} (worst "
                           f"{max(r['wake_max_ms'] for r in got):.3f}, median thread "
                           f"{_median([r['wake_median_ms'] for r in got]):.3f}) work med/max "
                           f"{_median([r['work_median_ms'] for r in got]):.3f}/"
                           f"{_median([r['work_max_ms'] for r in got]):.3f} late thread's wake/work "
                           f"{_median([r['late_wake_ms'] for r in got]):.3f}/"
                           f"{_median([r['late_work_ms'] for r in got]):.3f} "
                           f"cpus {min(r['distinct_cpus'] for r in got)}-"
                           f"{max(r['distinct_cpus'] for r in got)} of {got[0]['threads']}; {ivcsw}")
            else:
                out.append(f"  {what:<11} gap {gap * 1e3:5.0f}: {_median([r['ms'] for r in got]):6.3f} (max "
                           f"{max(r['ms'] for r in got):6.3f}) compute {_median([r['compute_ms'] for r in got]):6.3f} "
                           f"model {got[0]['model_ms']:.3f} wall {_median([r['wall_ms'] for r in got]):6.3f}; {ivcsw}")
    return out


def cell_lines(cell: dict, layers: int) -> list[str]:
    out = [f"cell {cell['cell']}: slots {cell['slots']}, fixed {cell['fixed_ms']:.3f} ms (all-hit stack among the "
           f"turns {cell['ref_fixed_ms']:.3f}, by its mean step {cell['ref_fixed_mean_ms']:.3f}), overlap "
           f"{cell['overlap_ms']:.3f}, prefetch layer {cell['prefetch_layer_ms']:.3f}, fetch layer "
           f"{cell['fetch_layer_ms']:.3f}, call {cell['call_ms']:.3f}, issue {cell['issue_us']:.1f} us, copy call "
           f"{cell['copy_call_ms']:.3f}, branch layer {cell.get('branch_layer_ms', 0.0):.3f}"]
    kinds = cell["kinds"]
    if kinds:
        names = sorted({n for k in kinds.values() for n in k},
                       key=lambda n: min(k[n][0] for k in kinds.values() if n in k))
        out.append("  mark: host/GPU ms from the layer's start (median, n) | " + " | ".join(f"{k:>20}" for k in kinds))
        for n in names:
            out.append(f"  {n:<20} | " + " | ".join("{:6.3f}/{:6.3f} n{:<4d}".format(*k[n]) if n in k else f"{'-':>20}"
                                                   for k in kinds.values()))
    for mode, r in cell["modes"].items():
        b = r.get("branch_summary") or {}
        text = (f"  {mode:>9}: step {r['step_ms']:.3f}±{r['sem_ms']:.3f} ms over {r['steps']}, floor "
                f"{r['floor_ms']:.3f} x{r['step_ms'] / r['floor_ms']:.2f} (medians {r['step_median_ms']:.3f} / "
                f"{r['floor_median_ms']:.3f}; CPU by the model x{r['step_ms'] / r['floor_model_ms']:.2f}, as ran "
                f"x{r['step_ms'] / r['floor_ran_ms']:.2f}, paired x{r['step_ms'] / r['floor_paired_ms']:.2f}); excess "
                f"a layer {(r['step_ms'] - r['floor_ms']) / layers:.3f} ms; steps > 1.5x floor {r['over_1_5']}; hits "
                f"{r['hits']:.2f} fetched {r['fetched']:.2f} prefetched {r['prefetched']:.2f} used "
                f"{r['prefetch_used']:.2f} a step")
        if b:
            text += (f"; {r['branches']} branches x{b['ratio_median']:.2f} median (rate {r['branch_rate']:.2f}) max "
                     f"x{b['ratio_max']:.2f}, {b['slow']} > 2x: ivcsw {b['slow_ivcsw']:.1f} vs {b['rest_ivcsw']:.1f} "
                     f"(main {b['slow_ivcsw_main']:.1f} vs {b['rest_ivcsw_main']:.1f}), minflt {b['slow_minflt']:.0f} "
                     f"vs {b['rest_minflt']:.0f}, gap {b['slow_gap_ms']:.1f} vs {b['rest_gap_ms']:.1f} ms")
            if b.get("team_cpus_min"):
                text += (f"; team wake max median {b['team_wake_max_ms']:.3f} worst {b['team_wake_worst_ms']:.3f} ms, "
                         f"cpus >= {b['team_cpus_min']}")
        out.append(text)
        for o in r["outliers"][:6]:
            t = o.get("team") or {}
            out.append(f"      > 3x: layer {o['layer']} {o['ms']:.2f}/{o['model_ms']:.2f} ms (compute "
                       f"{o['compute_ms']:.2f}) {o['experts']} experts, gap {o['gap_ms']:.1f} ms, ivcsw {o['ivcsw']} "
                       f"(main {o['ivcsw_main']}), minflt {o['minflt']}"
                       + (f", team wake max {t['wake_max_ms']:.3f} ms (thread {t['late']} cpu "
                                                  f"{t['late_cpu']}), {t['distinct_cpus']} cpus" if t else ""))
    return out


def print_result(result: dict, start: float) -> None:
    c = result["costs"]
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus (affinity {result['affinity']}), "
          f"torch threads {result['torch_threads']}; CPU {c['cpu_gemm']} at {c['cpu_threads']} threads, "
          f"{c['cpu_step_s'] * 1e3:.3f} ms a call; team probe: {result['probe']}; total "
          f"{time.perf_counter() - start:.0f} s")
    for mode in dict.fromkeys(r["mode"] for r in result["exact"]):
        for m in dict.fromkeys(r["M"] for r in result["exact"]):
            got = [r for r in result["exact"] if r["mode"] == mode and r["M"] == m]
            print(f"exact {mode:>9} M={m}: rel_l2 max {max(r['rel_l2'] for r in got):.2e}, bit-equal to cpu "
                  f"{sum(r['same_as_cpu'] for r in got)} of {len(got)}, cpu experts "
                  f"{sum(r['cpu_experts'] for r in got)}: {'PASS' if all(r['pass'] for r in got) else 'FAIL'}")
    if result.get("team"):
        print("team: host idle gap (ms, asleep) before; probe: torch's OpenMP team reading one cold expert (ms from "
              "the call; median over repeats); branch: one cold expert, idle link (ms, medians); counters summed")
        for line in team_lines(result["team"]):
            print(line)
    for cell in result["cells"]:
        for line in cell_lines(cell, result["shape"]["layers"]):
            print(line)
