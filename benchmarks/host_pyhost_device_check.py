"""Host check of issue 13 (<= 40 µs host per experts call), session 23 helper pyhost: the fast path's Python, old vs
new, and the one-pass alignment's grid at one program per SM.

    PYTHONPATH=$PWD timeout 170 python3 benchmarks/host_pyhost_device_check.py --out $OUT/pyhost [--deadline-s 140]
        [--parts align calls]

Parts (a line per cell as it goes, JSON rewritten after each, a table last):
1. align: the alignment alone (Qwen3 E = 128, DeepSeek-V3 E = 256, top-8, uniform routing) at M = 4096 and 16384:
   ``two`` (the fused hist + scan and the scatter), ``one2`` (the one-pass launch, at most two programs per SM: the
   merged main's grid) and ``one1`` (``triton_align.ONE_PASS_ONE_PER_SM``: one per SM while the chunk programs fit).
   Layouts equal to ``two``'s; GPU µs (events around 20 alignments behind a sleep) and host µs, 3 interleaved rounds.
2. calls: whole eager calls ``old`` (``triton_fast.READ_ONCE`` and ``ONE_PASS_ONE_PER_SM`` off: merged main) vs
   ``new`` (both on: this tree's defaults) at Qwen3 bf16 M = 1 / 1024 / 4096 / 16384, fp8_block 4096, DeepSeek-V3
   bf16 4096, 3 interleaved rounds: ``new``'s output bit-equal to ``old``'s, ``old``'s near ``experts_reference``
   (round 1); eager / host_rest µs (``time_eager``), events µs, and ``noop`` (host_rest of 16 back-to-back calls with
   every kept launch a no-op: the path's Python and ``empty_like`` alone).
Look for: align one1 GPU µs <= one2's at 4096 (same grid at 16384); calls: new host_rest / noop lower, events equal.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import moekit.experts.triton as tri
import moekit.experts.triton_align as talign
import moekit.experts.triton_fast as fast
from host_big3_device_check import DEEPSEEK, QWEN3, TOL, Deadline, _align_gpu_us, _med, _rel, _weights, host_rest
from moekit.bench.cells import Shape, make_sets
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import get_backend
from moekit.experts.reference import experts_reference
from moekit.experts.triton_align import align_launches, one_pass_programs, plan_align
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.layouts.grouping import max_padded_rows

ALIGN_CELLS = [(4096, 64), (16384, 128)]  # (M, block): the fused route's 64-row blocks, the Gluon route's 128
CALL_CELLS = [(QWEN3, "bfloat16", 1), (QWEN3, "bfloat16", 1024), (QWEN3, "bfloat16", 4096),
              (QWEN3, "bfloat16", 16384), (QWEN3, "fp8_block", 4096), (DEEPSEEK, "bfloat16", 4096)]
VARIANTS = {"old": (False, False), "new": (True, True)}  # (READ_ONCE, ONE_PASS_ONE_PER_SM)
_OUT = [None]


def save(results: dict) -> None:
    if _OUT[0] is not None:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=1, default=str)


def use(variant: str) -> None:
    """The variant's switches, the caches dropped (the plans hold the one-pass grid)."""
    fast.READ_ONCE, talign.ONE_PASS_ONE_PER_SM = VARIANTS[variant]
    tri.clear_launch_caches()


def align_plans(num_assignments: int, num_experts: int, block: int) -> dict:
    device, rows = torch.device("cuda"), max_padded_rows(num_assignments, num_experts, block)
    plans = {}
    for name, start, cap in (("two", 0, True), ("one2", 1, False), ("one1", 1, True)):
        talign.ONE_PASS_ONE_PER_SM = cap
        options = resolve_launch_options(LaunchOptions(align_one_pass_from=start), device)
        plans[name] = plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0,
                                 one_pass=one_pass_programs(options, device))
    talign.ONE_PASS_ONE_PER_SM = True
    return plans


def part_align(results: dict, deadline: Deadline) -> None:
    out, device = results.setdefault("align", {}), torch.device("cuda")
    for preset in (QWEN3, DEEPSEEK):
        shape = Shape.from_preset(preset)
        for m, block in ALIGN_CELLS:
            if deadline.left() < deadline.stops["align"]:
                print(f"deadline: align stops before {preset} M={m}", flush=True)
                return
            ids = make_sets(shape, m, 1, torch.bfloat16, device)[0].topk_ids.contiguous()
            plans = align_plans(ids.numel(), shape.num_experts, block)
            bufs, sync, launches = {}, {}, {}
            for name, plan in plans.items():
                bufs[name] = {n: torch.full(s, -5, dtype=d, device=device) for n, d, s in plan.regions}
                sync[name] = torch.zeros(8, dtype=torch.int32, device=device)
                launches[name] = align_launches(plan, ids, ids, bufs[name], sync[name])
                for launch, ptrs in launches[name]:
                    launch(*ptrs)
            torch.cuda.synchronize()
            row = {"grid": {n: p.one.grid[0] for n, p in plans.items() if p.one is not None}}
            b2, used = bufs["two"], int(bufs["two"]["num_padded"].item())
            for name in ("one2", "one1"):
                b = bufs[name]
                row[f"{name}_equal"] = bool(
                    torch.equal(b["counts"], b2["counts"]) and torch.equal(b["num_padded"], b2["num_padded"])
                    and torch.equal(b["sorted_ids"], b2["sorted_ids"])
                    and torch.equal(b["expert_ids"], b2["expert_ids"])
                    and bool((b["sorted_ids"][used:] == ids.numel()).all()) and int(sync[name].abs().sum()) == 0)
            for rnd in range(3):
                for name in plans:
                    one = [lambda ls=launches[name]: [launch(*p) for launch, p in ls]]
                    row.setdefault(f"{name}_gpu", []).append(_align_gpu_us(one[0]))
                    row.setdefault(f"{name}_host", []).append(host_rest(one, False, 21, 5))
            ok = row["one2_equal"] and row["one1_equal"]
            key = f"{preset} M={m} B={block}"
            out[key] = row
            print(("PASS" if ok else "FAIL") + f" align {key}: " + json.dumps(row), flush=True)
            save(results)


def noop_rest(calls: list) -> float:
    """host_rest µs of ``calls`` with every kept sequence's launches no-ops (the fast path's Python + empty_like)."""
    kept = list({id(e.sequence): (e.sequence, e.sequence.steps) for e in list(fast._MEMO.values())}.values())
    for sequence, steps in kept:
        sequence.steps = [((lambda *a: None), t, s, r) for (e, t, s, r) in steps]
    try:
        return host_rest(calls, False)
    finally:
        for sequence, steps in kept:
            sequence.steps = steps


def _round(row: dict, calls: list, variant: str, want, check_ref):
    use(variant)
    for c in calls * 2:
        c()
    got = calls[0]()
    if want is None:
        want = got
        if check_ref is not None:
            row["ref_err"] = _rel(got, check_ref())
    row.setdefault(f"{variant}_equal", []).append(bool(torch.equal(got, want)))
    row.setdefault(f"{variant}_kept", []).append(len(fast._MEMO))
    e = time_eager(calls, torch.device("cuda"))
    row.setdefault(f"{variant}_eager", []).append(round(e.eager_us, 1))
    row.setdefault(f"{variant}_rest", []).append(round(e.host_rest_us, 1))
    row.setdefault(f"{variant}_events", []).append(round(time_stats(calls, torch.device("cuda"), budget_s=0.03).us, 1))
    row.setdefault(f"{variant}_noop", []).append(noop_rest(calls))
    return want


def part_calls(results: dict, deadline: Deadline) -> None:
    fn, out, held = get_backend("triton"), results.setdefault("calls", {}), {}
    for preset, dtype, m in CALL_CELLS:
        if deadline.left() < deadline.stops["calls"]:
            print(f"deadline: calls stop before {preset} {dtype} M={m}", flush=True)
            break
        shape = Shape.from_preset(preset)
        if (preset, dtype) not in held:
            held.clear()
            torch.cuda.empty_cache()
            held[(preset, dtype)] = _weights(shape, dtype)
        w13, w2 = held[(preset, dtype)]
        sets = make_sets(shape, m, 2, torch.bfloat16, torch.device("cuda"))
        calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
        s0 = sets[0]
        ref = lambda: experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights)  # noqa: E731
        row, want = {}, None
        for rnd in range(3):
            for variant in VARIANTS:
                try:
                    want = _round(row, calls, variant, want, ref if rnd == 0 else None)
                except RuntimeError as e:  # a refused launch: say so, go on
                    row[f"{variant}_error"] = str(e)[:200]
                    print(f"FAIL calls {variant}: {str(e)[:200]}", flush=True)
        use("new")
        ok = (all(all(v) for k, v in row.items() if k.endswith("_equal")) and row.get("ref_err", 1.0) < TOL
              and not any(k.endswith("_error") for k in row))
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" calls {key}: " + json.dumps(row), flush=True)
        save(results)


def table(results: dict) -> None:
    print("\n== align alone: GPU µs / host µs per alignment (medians of 3 rounds) ==")
    for key, r in results.get("align", {}).items():
        cols = "  ".join(f"{n} {_med(r.get(n + '_gpu', [])):7.2f}/{_med(r.get(n + '_host', [])):5.1f}"
                         for n in ("two", "one2", "one1"))
        print(f"{key:24} {cols}  grid {r['grid']}  equal {r['one2_equal']} {r['one1_equal']}")
    print("\n== calls: eager / host_rest / events / noop µs (medians of 3 rounds), old -> new ==")
    for key, r in results.get("calls", {}).items():
        cols = "  ".join(f"{v} {_med(r.get(v + '_eager', [])):8.1f} {_med(r.get(v + '_rest', [])):5.1f} "
                         f"{_med(r.get(v + '_events', [])):8.1f} {_med(r.get(v + '_noop', [])):5.1f}" for v in VARIANTS)
        print(f"{key:28} {cols}  err {r.get('ref_err', float('nan')):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host_pyhost_out"))
    parser.add_argument("--deadline-s", type=float, default=140.0)
    parser.add_argument("--parts", nargs="+", default=["align", "calls"], choices=["align", "calls"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    _OUT[0] = os.path.join(args.out, "host_pyhost.json")
    deadline = Deadline(args.deadline_s)
    deadline.stops = dict(align=0.75 * args.deadline_s if len(args.parts) > 1 else 10.0, calls=12.0)
    import triton

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    t0 = time.perf_counter()
    parts = dict(align=part_align, calls=part_calls)
    with torch.no_grad():
        for part in args.parts:
            try:
                parts[part](results, deadline)
            except Exception as e:  # noqa: BLE001 (out of memory, a refused launch: report, go on with the next part)
                print(f"FAIL {part}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                torch.cuda.empty_cache()
            use("new")
            save(results)
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    table(results)


if __name__ == "__main__":
    main()
