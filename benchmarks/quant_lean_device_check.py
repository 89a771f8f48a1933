"""The quantized paths' lean eager calls (``moekit/experts/triton_quant_fast.py``) on the GPU (issue 13 item 1
on the fp8 and weight-only paths): is the lean output the plain path's bit for bit, and the host, eager and
graph time per experts call of each.

    PYTHONPATH=$PWD OUT=/tmp/ql python benchmarks/quant_lean_device_check.py [--budget-s 110]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/quant_lean_device_check.py --smoke \
        --presets qwen3-30b-a3b --batches 1 8   (CPU, tiny shapes: checks the script)

For Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B expert weights (random, quantized once per scheme) at M =
1, 8, 64, 512, 1024 (no_grad, uniform routing, bf16 activations), schemes fp8_block and int4_w4a16 first
(every preset), then int8_w8a16 and mxfp4 while the budget lasts; two variants of ``experts_triton``:
  plain   LaunchOptions(lean_launch=False): the fp8 path's BoundLaunch calls with every argument checked,
          the weight-only path through its custom op (fresh workspace per call)
  lean    the defaults: a repeated call launches the recorded sequence of its kept entry
Per cell: ``same`` (lean equals plain bit for bit, two routings), ``hit`` (the lean calls were served by the
fast path: its launch counted), ``err`` (relative L2 of lean against ``experts_reference`` on the same
quantized weights, M <= 64), host µs per call (N calls started on an idle GPU, one sync; plain and lean
samples interleaved ABBA; median), eager µs (back-to-back calls, one sync), graph µs (a CUDA graph of the
calls replayed); of the kept entry: ``#l`` launches, ``raw`` (each through the C launch), ``launches`` (host µs
of the recorded launches alone: the rest of ``host lean`` is the fast path's Python). Look for: same = yes and hit = yes
everywhere (fp8 cells the Gluon choice takes and weight-only cells the scratch decode runs say hit = no: not on this
path), lean host <= 40 µs, err < 2e-2. JSON to $OUT/quant_lean.json (./quant_lean_out/ without OUT), the table printed
last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import host_align_device_check as ha
import host_lean_device_check as hl
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts import triton_quant_fast
from moekit.experts.reference import experts_reference
from moekit.experts.triton import clear_launch_caches, experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.quant import quantize

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (1, 8, 64, 512, 1024)
FIRST, THEN = ("fp8_block", "int4_w4a16"), ("int8_w8a16", "mxfp4")
VARIANTS = {"plain": LaunchOptions(lean_launch=False), "lean": LaunchOptions()}
REF_MAX_M = 64
HITS = [0]


def _count_hits() -> None:
    """Count the fast path's launches (``triton_quant_fast._launch``)."""
    real = triton_quant_fast._launch

    def counted(*args):
        HITS[0] += 1
        return real(*args)

    triton_quant_fast._launch = counted


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(x, q13, q2, ids, weights) -> torch.Tensor:
    """``experts_reference`` on the touched experts only (a DeepSeek-V3 layer dequantized whole is 30 GB)."""
    used = ids.long().unique()  # sorted
    local = torch.searchsorted(used, ids.long()).int()  # [M, k]: each id's position among the used
    return experts_reference(x, q13.select_experts(used), q2.select_experts(used), local, weights)


def kept_entry(q13, x):
    """The fast path's entry of calls on ``q13`` with x's shape, or None."""
    for key, entry in triton_quant_fast._MEMO.items():
        if key[0] == id(q13) and key[2] == x.shape and entry.w13() is q13:
            return entry
    return None


def launches_only(entry, args: tuple, m: int) -> dict:
    """The kept sequence: its launches, whether each is raw (the C launch), and the host µs of the launches
    alone (no fast-path checks, no output allocation): the rest of ``host lean`` is the Python around them."""
    x, _, _, ids, weights = args
    regions = ()
    if entry.fresh is not None:  # kept for the whole measurement: only the launches are timed
        regions = tuple(entry.fresh.carve(torch.empty(entry.fresh.nbytes, dtype=torch.uint8, device=x.device)).values())
    values = (x, ids, weights, torch.empty_like(x), *regions)
    median, _ = hl.host_us({"launches": lambda: entry.sequence.launch(values)}, m)
    steps = entry.sequence.steps
    return {"launches": len(steps), "raw": all(step[3] for step in steps), "launches_us": median["launches"]}


def cell(m: int, q13, q2, shape: Shape) -> dict:
    dev, row, fns = hl.Run.device, {"same": True}, {}
    for seed in (m, m + 1):  # two routings: the second reuses the kept entry
        x = torch.randn(m, shape.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(m, shape, dev, seed=seed)
        args = (x, q13, q2, routing.topk_ids, routing.topk_weights)
        outs = {}
        for name, options in VARIANTS.items():
            fns[name] = lambda a=args, o=options: experts_triton(*a, options=o)  # noqa: E731
            for _ in range(3):  # compiles, records, served
                outs[name] = fns[name]()
        hits = HITS[0]
        outs["lean"] = fns["lean"]()
        row["hit"] = HITS[0] > hits
        row["same"] = row["same"] and torch.equal(outs["lean"], outs["plain"])
    if m <= REF_MAX_M:
        row["err"] = rel_l2(outs["lean"], reference(*args))
    median, _ = hl.host_us(fns, m)
    row["host_us"] = median
    row["eager_us"] = {name: hl.eager_us(fn, m) for name, fn in fns.items()}
    row["graph_us"] = {name: hl.graph_us(fn, m) for name, fn in fns.items()}
    entry = kept_entry(q13, args[0])
    if entry is not None:
        row.update(launches_only(entry, args, m))
    return row


def table(results: dict) -> str:
    lines = ["host / eager / graph µs per quantized experts call, plain -> lean (same: bit-equal; hit: the fast "
             "path served the lean calls; err: lean vs experts_reference, rel L2)",
             f"{'cell':34}{'same':>5}{'hit':>4}{'err':>9}{'host plain':>11}{'host lean':>10}{'eager plain':>12}"
             f"{'eager lean':>11}{'graph plain':>12}{'graph lean':>11}{'#l':>4}{'raw':>4}{'launches':>10}"]
    for key, r in results.items():
        if "host_us" not in r:
            lines.append(f"{key:34}{next(iter(r.values()))}")
            continue
        lines.append(f"{key:34}{ha._yn(r['same']):>5}{ha._yn(r['hit']):>4}{r.get('err', float('nan')):>9.2e}"
                     f"{r['host_us']['plain']:>11.1f}{r['host_us']['lean']:>10.1f}{r['eager_us']['plain']:>12.1f}"
                     f"{r['eager_us']['lean']:>11.1f}{r['graph_us']['plain']:>12.1f}{r['graph_us']['lean']:>11.1f}"
                     f"{r.get('launches', '-'):>4}{ha._yn(r['raw']) if 'raw' in r else '-':>4}"
                     f"{r.get('launches_us', float('nan')):>10.1f}")
    return "\n".join(lines)


def measure(a, start: float, results: dict) -> None:
    _count_hits()
    with torch.no_grad():
        first = True
        for schemes in (FIRST, THEN):
            for preset in a.presets:
                shape = Shape.from_preset(preset, hl.Run.scale)
                weights = make_weights(shape, torch.bfloat16, hl.Run.device)
                for scheme in [s for s in schemes if s in a.schemes]:
                    if time.perf_counter() - start > a.budget_s:
                        results[f"{preset} {scheme}"] = {"skipped": f"time budget ({a.budget_s:.0f} s) spent"}
                        continue
                    q13, q2 = quantize(weights.w13, scheme), quantize(weights.w2, scheme)
                    if first:  # throwaway: a process's first cell runs slow
                        cell(1, q13, q2, shape)
                        first = False
                    for m in a.batches:
                        ha.budgeted_cell(results, f"{preset} {scheme} M={m}", start, a.budget_s,
                                         lambda: cell(m, q13, q2, shape))
                    del q13, q2
                    clear_launch_caches()
                del weights
                if hl.Run.device.type == "cuda":
                    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=110.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=130, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--schemes", nargs="+", default=[*FIRST, *THEN])
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        hl.Run.device, hl.Run.scale = torch.device("cpu"), ha.SMOKE_SCALE
        hl.Run.host_samples, hl.Run.host_calls, hl.Run.eager_samples, hl.Run.eager_calls, hl.Run.graph_calls = (
            1, 1, 1, 1, 1)
    else:
        hl.Run.device = torch.device("cuda", torch.cuda.current_device())
        hl.Run.host_samples, hl.Run.host_calls = 9, 32  # fewer samples than host_lean: four schemes to fit
    ha.Run.device = hl.Run.device
    out_dir = Path(os.environ.get("OUT", "quant_lean_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "quant_lean.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
