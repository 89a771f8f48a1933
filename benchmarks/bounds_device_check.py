"""Issues 13 item 4, 19, 15, 16: what the H200 can do at decode sizes at all, beside what moekit does.

    PYTHONPATH=$PWD timeout 170 python3 benchmarks/bounds_device_check.py --out $OUT/bounds --deadline-s 140  # H200
    PYTHONPATH=$PWD python3 benchmarks/bounds_device_check.py --smoke        # CPU: interpreter, tiny shapes, no timing

Per cell (a shape, a weight format, M tokens; rotated routing sets, so replays stream from HBM), in CUDA-graph
replay, on exactly the bytes the cell's touched experts hold (``bounds_cells``):
1. one pure-read launch of those bytes (``bounds_kernels.read_parts_kernel``), a sweep of chunk size, warps,
   programs per SM and Triton stages, then the best again with PDL (waiting before its first load, as ours);
2. the same bytes as dependency chains: gate-up read -> down read (which reads words the first wrote), with and
   without PDL, the down read waiting first (what a GEMM that needs h does) or last (the loosest legal chain), + a
   tiny k-sum launch, + a gate launch before them (reads x and the gate weight, writes the ids the reads take);
3. torch's own reads (``.sum()``, a copy) of as many expert rows, and moekit: the experts call (experts cells) or
   the ``MoE`` layer forward and its gate + router alone (layer cells), plus ``layer_measure.time_layer`` itself.
Timing (``bounds_cells.GraphTimer``): every variant as queued graph replays (the calls' own cost); moekit, the best
read and the chains of the length the computation needs also the way the issue's number is taken (experts: ``moekit
bench``'s, one replay of a graph of every set on an idle GPU; layer: ``moekit analyze --measure``'s, one replay of a
graph of one call), and the verdict compares like with like that way.
Every variant is checked first (read words xor-folded against the host's fold, ours against the reference; PASS /
FAIL); then the variants are timed interleaved, median of rounds. Copy bandwidth: ``moekit.bench.ceilings``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import bounds_cells as bc  # noqa: E402
import bounds_ours as bo  # noqa: E402

T0 = time.perf_counter()
SWEEP_ROUNDS, ROUNDS = 3, 5
# Replays before a phase's first round: run 1 (091ac29) timed a sweep's first rounds up to 15% slow after the host's
# checks left the GPU idle (DeepSeek-V3 int4 M = 8: 336 µs in the sweep, 291.6 for the same launch in the next phase)
WARM_S = 0.15
Q3, MIX, DS = "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"


@dataclass(frozen=True)
class CellSpec:
    kind: str  # "experts" (the experts call) or "layer" (the MoE forward: gate, routing, experts)
    preset: str
    fmt: str  # bf16, fp8, int4
    m: int  # tokens
    target_x: float  # the target: at most target_x times the floor (issue 13: 1.15; >= 80% of the floor: 1.25)
    note: str  # which issue's bar
    relative_to: str = ""  # a cell's name: the target is target_x times moekit's µs there, not the floor

    @property
    def name(self) -> str:
        return f"{self.kind} {self.preset} {self.fmt} M={self.m}"


P80, P90, L115 = 1 / 0.8, 1 / 0.9, 1.15
CELLS = [
    CellSpec("experts", Q3, "bf16", 1, P80, "#19 M=1 >= 80% of floor"),
    CellSpec("experts", Q3, "fp8", 1, P80, "#15 M=1 >= 80% of the fp8 floor"),
    CellSpec("layer", Q3, "bf16", 1, L115, "#13.4 layer graph <= 1.15 x floor"),
    CellSpec("layer", Q3, "bf16", 2, L115, "#13.4"),
    CellSpec("layer", Q3, "bf16", 4, L115, "#13.4"),
    CellSpec("layer", Q3, "bf16", 8, L115, "#13.4"),
    CellSpec("layer", MIX, "bf16", 1, L115, "#13.4"),
    CellSpec("layer", MIX, "bf16", 2, L115, "#13.4"),
    CellSpec("experts", Q3, "bf16", 2, L115, "(#13.4's bar on the experts alone)"),
    CellSpec("experts", Q3, "bf16", 4, L115, "(#13.4's bar on the experts alone)"),
    CellSpec("experts", Q3, "bf16", 8, P90, "#19 8 <= M: >= 90% of floor"),
    CellSpec("experts", Q3, "int4", 1, 0.45, "#16: <= 0.45 x moekit's bf16", "experts qwen3-30b-a3b bf16 M=1"),
    CellSpec("experts", DS, "int4", 1, P80, "#16 >= 80% of the packed floor"),
    CellSpec("experts", MIX, "int4", 1, P80, "#16"),
    CellSpec("experts", DS, "int4", 8, P80, "#16"),
    CellSpec("experts", MIX, "int4", 8, P80, "#16"),
    CellSpec("experts", MIX, "bf16", 1, P80, "#19 M=1"),
    CellSpec("experts", DS, "fp8", 1, P80, "#15 M=1"),
    CellSpec("experts", DS, "bf16", 1, P80, "#19 M=1"),
]
SMOKE_CELLS = [CellSpec("experts", "smoke", f, 2, P80, "smoke") for f in ("bf16", "fp8", "int4")] + [
    CellSpec("layer", "smoke", "bf16", 2, L115, "smoke")]
BEST: dict = {}  # preset -> the configs of its first timed cell, fastest first (a layer cell sweeps only these)


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def check_all(variants: list) -> None:
    for v in variants:
        try:
            v.fns[0]()
            if not SMOKE:
                torch.cuda.synchronize()
            v.status = v.check()
        except Exception as e:  # noqa: BLE001  (one variant's failure never ends the run)
            v.status = f"error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
        if not v.status.startswith("PASS") or SMOKE:
            log(f"  check {v.name}: {v.status}")


def time_all(variants: list, rounds: int, deadline: float) -> None:
    """Graph µs of every passing variant, interleaved over rounds; v.us = the median (None: never timed)."""
    timers = {}  # variant index -> its GraphTimer
    for i, v in enumerate(variants):
        if v.status.startswith("PASS") and elapsed() < deadline:
            try:
                timers[i] = bc.GraphTimer(v.fns, v.per_graph)
            except Exception as e:  # noqa: BLE001
                v.status = f"graph error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
    if timers:  # the GPU idled while the host checked: clocks up again before the first round
        warm = timers[next(iter(timers))]
        stop = time.perf_counter() + WARM_S
        while time.perf_counter() < stop:
            warm.graph.replay()
        torch.cuda.synchronize()
    for _ in range(rounds):
        for i, v in enumerate(variants):
            if i in timers and elapsed() < deadline:
                v.samples.append(timers[i].sample())
    for v in variants:
        v.us = statistics.median(v.samples) if v.samples else None
    del timers


def sweep(cell, rs, sms: int, deadline: float) -> list:
    configs = BEST.get(cell.spec.preset, [])[:4] or (bc.SMOKE_SWEEP if SMOKE else bc.SWEEP)
    variants = [bc.read1(rs, c, sms) for c in configs]
    check_all(variants)
    if SMOKE:
        return variants
    time_all(variants, SWEEP_ROUNDS, deadline)
    timed = sorted([v for v in variants if v.us is not None], key=lambda v: v.us)
    BEST.setdefault(cell.spec.preset, [v.config for v in timed])
    return variants


def run_cell(spec: CellSpec, dev, copy_tbps: float, sms: int, deadline: float) -> dict:
    cell = bo.build_cell(spec, dev, copy_tbps, SMOKE)
    log(f"{spec.name}: touched {cell.touched} over {len(cell.touched)} sets, floor {cell.floor_us:.1f} µs "
        f"(x{spec.target_x:.2f} = {spec.target_x * cell.floor_us:.1f}), {cell.note}")
    rs = bc.read_sets(cell.touched, cell.parts, cell.gate_words, dev)
    swept = sweep(cell, rs, sms, deadline)
    ranked = sorted([v for v in swept if getattr(v, "us", None) is not None], key=lambda v: v.us)
    best = ranked[0].config if ranked else swept[0].config
    best_ptr = next(v.config for v in ranked + swept if not v.config.tma)  # for PDL and dependency words
    variants = [bc.read1(rs, best, sms), bc.read1(rs, best_ptr, sms, pdl=not SMOKE)]
    variants[1].name += " (as ours: waits first)" if not SMOKE else ""
    variants += [bc.read1(rs, best, sms, part=part) for part in ("gate-up", "down")]
    chains = [bc.chain(rs, best_ptr, c, sms, cell.gate_io) for c in bc.CHAINS if not (SMOKE and c.pdl)]
    way = bo.ISSUE_WAY[spec.kind]  # the chains of the needed length and the best read, timed as the issue times ours
    needed = [bc.timed_as(v, way) for v in chains if v.name in bc.LENGTHS[bc.NEEDED[spec.kind]]]
    variants += chains + [bc.timed_as(variants[0], way)] + needed + bc.torch_peers(rs) + cell.ours
    check_all(variants)
    if not SMOKE:
        time_all(variants, ROUNDS, deadline)
    row = dict(cell=spec.name, kind=spec.kind, preset=spec.preset, fmt=spec.fmt, M=spec.m, note=spec.note,
               relative_to=spec.relative_to,
               target_x=spec.target_x, touched=cell.touched, bytes_per_call=cell.bytes_per_call,
               floor_us=cell.floor_us, target_us=spec.target_x * cell.extra.get("analyze_floor_us", cell.floor_us),
               extra=cell.extra,
               sweep=[_v(v) for v in swept], variants=[_v(v) for v in variants])
    if spec.kind == "layer" and not SMOKE and elapsed() < deadline:
        row["extra"]["analyze_time_layer_graph_us"] = bo.analyze_time_layer(cell)
    for v in variants:
        print(f"    {v.name + bc.WAYS[v.per_graph]:<52} {_us(v)} {v.status}", flush=True)
    del cell, rs, swept, variants
    if not SMOKE:
        torch.cuda.empty_cache()
    return row


def _v(v) -> dict:
    return dict(name=v.name, kind=v.kind, status=v.status, us=getattr(v, "us", None), samples=v.samples,
                per_graph=v.per_graph)


def _us(v) -> str:
    us = getattr(v, "us", None)
    return f"{us:9.2f} µs" if us is not None else "        -   "


def relative_targets(rows: list) -> None:
    """A row with ``relative_to`` takes its target from moekit's µs in that row (None when it was not timed)."""
    by_name = {r["cell"]: r for r in rows}
    for r in rows:
        if r.get("relative_to"):
            base = by_name.get(r["relative_to"])
            ours = bo.pick(base, names=(bo.OURS,), per_graph=bo.ISSUE_WAY[base["kind"]])[0] if base else None
            r["target_us"] = None if ours is None else r["target_x"] * ours


def best_of(row: dict, length: str, way: int = bc.QUEUED) -> float | None:
    return bo.pick(row, names=bc.LENGTHS[length], per_graph=way)[0]


def verdict(row: dict) -> str:
    """Against the issue's target, all timed the issue's way: the best chain of pure reads of the length the
    computation needs (experts: 2 launches, layer: gate + 2) and moekit."""
    way = bo.ISSUE_WAY[row["kind"]]
    t, need = row["target_us"], bc.NEEDED[row["kind"]]
    chain, ours = best_of(row, need, way), bo.pick(row, names=(bo.OURS,), per_graph=way)[0]
    if t is None or chain is None:
        return "incomplete"
    if chain > t:
        return f"OUT OF REACH: {need} of pure reads {chain:.1f} > target {t:.1f}"
    text = f"reachable: {need} of pure reads {chain:.1f} <= {t:.1f} ({t - chain:.1f} µs to spare)"
    if ours is None:
        return text
    return text + (f"; ours {ours:.1f} met" if ours <= t else f"; ours {ours:.1f}, {ours - t:.1f} over")


def table(rows: list, copy_tbps: float) -> None:
    print(f"\nper cell, CUDA-graph µs (medians of {ROUNDS} interleaved rounds; copy {copy_tbps:.2f} TB/s): floor = "
          "touched bytes + x/out at copy speed; target = target_x * floor (layer cells: * analyze's floor); columns "
          "to 'route': queued replays (best variant of each chain length); 'need' and 'ours*': the issue's way "
          "(experts: moekit bench's, one replay of every set; layer: analyze's, one call a graph)")
    heads = ["floor", "target", "1 read", "2 dep", "3 dep", "g+1", "g+2", "g+3", "ours", "route", "need*", "ours*"]
    print(f"{'cell':<33}" + "".join(f"{h:>8}" for h in heads) + "  verdict (the issue's way)")
    for r in rows:
        way = bo.ISSUE_WAY[r["kind"]]
        cols = [r["floor_us"], r["target_us"], bo.pick(r, "read1")[0]]
        cols += [best_of(r, n) for n in ("2 launches", "3 launches", "gate + 1", "gate + 2", "gate + 3")]
        cols += [bo.pick(r, names=(bo.OURS,))[0], bo.pick(r, names=(bo.ROUTE,))[0],
                 best_of(r, bc.NEEDED[r["kind"]], way), bo.pick(r, names=(bo.OURS,), per_graph=way)[0]]
        text = "".join(f"{c:8.1f}" if c is not None else f"{'-':>8}" for c in cols)
        print(f"{r['cell'][:32]:<33}{text}  {verdict(r)}", flush=True)


def main(args) -> int:
    import triton

    dev = torch.device("cpu" if SMOKE else "cuda")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    log(f"torch {torch.__version__} triton {triton.__version__} {name}")
    if SMOKE:
        copy_tbps, sms = 1.0, 2
    else:
        from moekit.bench.ceilings import measure_ceilings

        copy_tbps = measure_ceilings(dev).copy_TBps
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    log(f"copy {copy_tbps:.3f} TB/s, {sms} SMs")
    cells = SMOKE_CELLS if SMOKE else [c for i, c in enumerate(CELLS) if not args.cells or i in args.cells]
    rows = []
    out = Path(args.out) if args.out else None
    for spec in cells:
        if elapsed() > args.deadline_s:
            log(f"deadline: {spec.name} not run")
            continue
        try:
            rows.append(run_cell(spec, dev, copy_tbps, sms, args.deadline_s))
        except Exception as e:  # noqa: BLE001  (a cell's failure never ends the run)
            log(f"{spec.name}: error {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(cell=spec.name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bounds.json").write_text(json.dumps(dict(device=name, torch=torch.__version__,
                                                             triton=triton.__version__, copy_TBps=copy_tbps, sms=sms,
                                                             rows=rows), indent=1) + "\n")
    done = [r for r in rows if "error" not in r]
    relative_targets(done)
    bo.fit_lines(done)
    table(done, copy_tbps)
    failed = [f"{r['cell']}: {v['name']}" for r in done for v in r["variants"] + r["sweep"]
              if not v["status"].startswith("PASS")] + [r["cell"] for r in rows if "error" in r]
    print(f"FAILED: {failed or 'none'}  ({elapsed():.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for bounds.json")
    p.add_argument("--deadline-s", type=float, default=140.0, help="seconds after which nothing new is timed")
    p.add_argument("--cells", type=int, nargs="*", help="indices into CELLS (default: all, in order)")
    p.add_argument("--smoke", action="store_true", help="CPU: the interpreter, tiny shapes, checks only")
    sys.exit(main(p.parse_args()))
