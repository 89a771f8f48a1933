"""OpenMP's wait policy against the offload table: ``offload_cal_device_check.py`` run once per policy, each
in its own process (libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it), then the two compared.

    PYTHONPATH=$PWD python benchmarks/offload_omp_device_check.py --out $OUT/offload --cells close --limit 50
    PYTHONPATH=$PWD python benchmarks/offload_omp_device_check.py --out /tmp/o --smoke        (CPU, tiny shapes)

Unset, libgomp's threads spin ~300k rounds after a parallel region before they sleep; PASSIVE, they sleep at
once. The CPU branch runs on the host thread that feeds the GPU: its team spinning after the branch may take
the cores the host thread and the driver need next, or a sleeping team may wake slowly at the next branch.
Each child writes its log and JSON under ``--out``/POLICY; a child is killed ``--grace`` s past its own
``--limit`` (then the JSON it rewrote after its last group is read). The comparison prints last, per group:
the cpu mode's x floor (headline, and with the probe's rate), cpu step over gpu step (same process, so the
process-to-process drift of the host cancels), auto over the better pure mode; then the CPU branch's
anatomy and ``cpu_check`` by policy. The processes run one after the other, unset first: the order is not
balanced, so a policy's win is read from the in-process ratios, not the absolute steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("unset", "PASSIVE")


def _child(policy: str, out: str, passed: list[str], limit: float, grace: float) -> dict:
    folder = os.path.join(out, policy)
    os.makedirs(folder, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    env["OUT"] = folder
    start = time.perf_counter()
    with open(os.path.join(folder, "offload_cal.log"), "w") as log:
        try:
            code = subprocess.run([sys.executable, os.path.join(HERE, "offload_cal_device_check.py"), *passed],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit + grace).returncode
        except subprocess.TimeoutExpired:
            code = "killed"
    print(f"{policy}: exit {code} after {time.perf_counter() - start:.0f} s, log {folder}/offload_cal.log", flush=True)
    path = os.path.join(folder, "offload_cal_device_check.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def _cells(doc: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in doc.get("rows", []):
        name = f"{r['stream']}/{round(r['cache_fraction'] * 100)}/{r['prefetch']}/{r['M']}"
        out.setdefault(name, {})[r["compute_misses_on"]] = r
    return out


def _ratio(modes: dict, a: str, b: str) -> float | None:
    return modes[a]["step_ms"] / modes[b]["step_ms"] if a in modes and b in modes else None


def _best(modes: dict) -> float | None:
    pure = [modes[m]["step_ms"] for m in ("gpu", "cpu") if m in modes]
    return modes["auto"]["step_ms"] / min(pure) if pure and "auto" in modes else None


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def compare(docs: dict[str, dict]) -> list[str]:
    """The comparison's lines: per group and policy, then the medians by policy."""
    cells = {p: _cells(d) for p, d in docs.items()}
    names = [n for n in cells[POLICIES[0]] if all(n in c for c in cells.values())]
    lines = ["group              | " + " | ".join(f"{p:^44}" for p in POLICIES),
             "                   | " + " | ".join("cpu xfl (probe)  cpu/gpu  gpu xfl  auto/best" for _ in POLICIES)]
    keep: dict[str, dict[str, list[float]]] = {p: {"xfl": [], "probe": [], "cg": [], "gxfl": [], "ab": []}
                                               for p in POLICIES}
    for name in names:
        parts = []
        for p in POLICIES:
            modes = cells[p][name]
            cpu, gpu = modes.get("cpu", {}), modes.get("gpu", {})
            vals = {"xfl": cpu.get("x_floor"), "probe": cpu.get("x_floor_probe"), "cg": _ratio(modes, "cpu", "gpu"),
                    "gxfl": gpu.get("x_floor"), "ab": _best(modes)}
            for k, v in vals.items():
                if v is not None:
                    keep[p][k].append(v)
            parts.append(f"{_f(vals['xfl']):>7} ({_f(vals['probe'])})  {_f(vals['cg']):>7}  {_f(vals['gxfl']):>7}  "
                         f"{_f(vals['ab'], '{:.3f}'):>9}")
        lines.append(f"{name:<18} | " + " | ".join(parts))
    for p in POLICIES:
        k = keep[p]
        med = {key: statistics.median(v) if v else None for key, v in k.items()}
        lines.append(f"{p:>7} over {len(names)} groups: median cpu x floor {_f(med['xfl'])} (probe "
                     f"{_f(med['probe'])}), {sum(x > 1.2 for x in k['xfl'])} > 1.2 (probe "
                     f"{sum(x > 1.2 for x in k['probe'])}); median cpu/gpu {_f(med['cg'])}; gpu x floor "
                     f"{_f(med['gxfl'])}; auto/best worst {_f(max(k['ab'], default=None), '{:.3f}')}")
    if all(keep[p]["cg"] for p in POLICIES) and len(keep[POLICIES[0]]["cg"]) == len(keep[POLICIES[1]]["cg"]):
        q = [b / a for a, b in zip(keep[POLICIES[0]]["cg"], keep[POLICIES[1]]["cg"])]
        lines.append(f"PASSIVE / unset of cpu step / gpu step, by group: median {statistics.median(q):.3f}, "
                     f"range {min(q):.3f}-{max(q):.3f}, {sum(x < 1 for x in q)} of {len(q)} lower")
    for p in POLICIES:
        d = docs[p]
        parts = [f"n{r['experts']} {r['total_ms']:.2f} ({r['gemm']} {r['compute_ms']:.2f}, warm "
                 f"{r['compute_warm_ms']:.2f}, "
                 + ", ".join(f"{g} {r[f'compute_{g}_ms']:.2f}" for g in r["others"]) + f"; gemms {r['gemms_ms']:.2f}, "
                 f"warm {r['gemms_warm_ms']:.2f}, 1t {r['gemms_1t_ms']:.2f})" for r in d.get("anatomy", [])]
        checks = d.get("cpu_check", [])
        by_n = {n: statistics.median(r["ms"] for r in checks if r["experts"] == n and not r.get("fixed"))
                for n in sorted({r["experts"] for r in checks})}
        fails = [f"{r['mode']}/{r['M']}" for r in d.get("exact", []) if not r["pass"]]
        lines.append(f"{p:>7}: anatomy ms {'; '.join(parts) or '-'}; cpu_check median ms by experts "
                     + ", ".join(f"{n}: {v:.2f}" for n, v in by_n.items())
                     + f"; exact {'FAIL ' + ','.join(fails) if fails else 'PASS'} ({len(d.get('exact', []))} checks)")
    return lines


def main(argv: list[str]) -> int:
    out = argv[argv.index("--out") + 1] if "--out" in argv else os.environ.get("OUT", "/tmp/offload_omp")
    limit = float(argv[argv.index("--limit") + 1]) if "--limit" in argv else 50.0
    grace = float(argv[argv.index("--grace") + 1]) if "--grace" in argv else 40.0
    passed = [a for i,
              a in enumerate(argv) if a not in ("--out", "--grace")
              and (i == 0 or argv[i - 1] not in ("--out", "--grace"))]
    if "--limit" not in passed:
        passed += ["--limit", str(limit)]
    docs = {p: _child(p, out, passed, limit, grace) for p in POLICIES}
    with open(os.path.join(out, "offload_omp_device_check.json"), "w") as f:
        json.dump({"policies": list(POLICIES), "argv": passed, "lines": compare(docs)}, f)
    for p in POLICIES:
        print(f"{p}: state {docs[p].get('state', 'no JSON')}, total {docs[p].get('total_s', 0):.0f} s, OMP_WAIT_POLICY "
              f"{docs[p].get('omp_wait_policy', '-')}")
    print("\n".join(compare(docs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
