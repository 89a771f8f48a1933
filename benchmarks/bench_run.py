"""What a device check keeps besides its timings: the PASS / FAIL lines and the failed list, a log stamped with the
run's seconds, the table printed last, a watchdog that prints the table so far and ends the run when nothing was
logged for a while (a hung kernel), the JSON header (device, torch, triton), the ceilings in this run, a
case-by-case run's command line and loop, a check's common options (``check_parser``), the phases of a run against
its deadline, host / wall µs of eager calls, a transformers ``generate``. Timing: ``bench_rounds``.

    RUN = RunLog("whole calls, graph replay, median of the rounds", stall_s=30.0)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RUN.log("ceilings: ...")        # [   1.2s] ceilings: ...
    RUN.check("M=8 pick", err < TOL, f"rel_err={err:.2e}")
    RUN.print_table()               # the title, RUN.summary, FAILED: ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import torch


class RunLog:
    """One run's start, its failed checks, its summary lines (the table) and its last log line (the watchdog's)."""

    def __init__(self, title: str = "", stall_s: float = 100.0):
        self.t0 = time.perf_counter()
        self.title = title  # the table's first line
        self.stall_s = stall_s  # the watchdog's silence limit (s)
        self.failed: list[str] = []
        self.summary: list[str] = []
        self.last = [self.t0, "start"]  # [perf_counter, message] of the last ``log``

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """``PASS  name  detail`` or ``FAIL ...`` (then ``name`` failed)."""
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def log(self, msg: str) -> None:
        self.last[:] = [time.perf_counter(), msg]
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def print_table(self) -> None:
        print(f"\n{self.title}", flush=True)
        print("\n".join(self.summary))
        print(f"FAILED: {', '.join(self.failed) or 'none'}; {self.elapsed():.0f} s", flush=True)

    def each_cell(self, specs, run_one: Callable, deadline: float, after: Callable = lambda: None) -> None:
        """``run_one(spec)`` for each of ``specs`` that starts before ``deadline`` (s from the start; the others
        logged SKIP, "not reached" in the table); a cell that raises is logged FAIL and the others still run;
        ``after()`` after each (outside the handler: its traceback holds the cell's tensors)."""
        for spec in specs:
            if self.elapsed() > deadline:
                self.log(f"SKIP {spec}: deadline")
                self.summary.append(f"{spec}: not reached")
                continue
            try:
                run_one(spec)
            except Exception as exc:  # noqa: BLE001 (one cell's failure is reported, the others still run)
                self.log(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[-800:]}")
                self.failed.append(str(spec))
            after()

    def watchdog(self, stall_s: Callable[[], float] | None = None, poll_s: float = 2.0) -> None:
        """Forever (a daemon thread's target): past ``stall_s()`` (default: ``self.stall_s``) seconds without a log
        line, the table so far, then the process ends (exit 3)."""
        limit = stall_s or (lambda: self.stall_s)
        while True:
            time.sleep(poll_s)
            if time.perf_counter() - self.last[0] > limit():
                print(f"\nSTALLED {limit():.0f} s after: {self.last[1]}", flush=True)
                self.print_table()
                os._exit(3)


def smoke_mode() -> bool:
    """Whether the device check runs as ``--smoke`` (the CPU, tiny shapes); then ``TRITON_INTERPRET=1``, which must be
    set before moekit imports its kernels: call this before importing moekit."""
    smoke = "--smoke" in sys.argv
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    return smoke


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; inf where ``out`` is not finite."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def run_info() -> dict:
    """The JSON header: the device's name, torch's and Triton's versions."""
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__}


def begin_layers_run(run: RunLog, result: dict, layers: dict) -> None:
    """A layer-grid check's start (trn50, trn51): the JSON header and the layers into ``result``, the first log line,
    the watchdog thread."""
    result.update(run_info(), layers={k: list(map(str, v)) for k, v in layers.items()})
    run.log(f"layers {list(layers)}; {run_info()}")
    threading.Thread(target=run.watchdog, daemon=True).start()


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)



def raise_recompile_limit(at_least: int = 64) -> None:
    """dynamo's recompile limit (``cache_size_limit`` on older torch) at least ``at_least``: a check that compiles
    several implementations or modes never falls back to eager."""
    import torch._dynamo.config as cfg

    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, limit, max(getattr(cfg, limit), at_least))


def run_phases(run: RunLog, phases: dict, names, deadline: float, needs_s: dict, path: str, result: dict) -> int:
    """``phases[name]()`` for each of ``names`` that starts before ``deadline - needs_s.get(name, 4)`` s (a device
    check's phases, ``RunLog.each_cell``'s rules), "<name> done" logged and ``result`` written to ``path`` (JSON; none
    where ``path`` is "") after each; then the table. Returns the exit status: 1 where a check failed, else 0."""
    for name in names:
        run.each_cell([name], lambda _, phase=phases[name]: phase(), deadline - needs_s.get(name, 4))
        run.log(f"{name} done")
        if path:
            write_json(path, result)
    run.print_table()
    return 1 if run.failed else 0


def phase_args(doc: str, phases: dict, json_name: str) -> argparse.Namespace:
    """A device check's options: ``--out DIR`` (the JSON ``DIR/json_name``, ``path``; none without), ``--deadline S``
    (a phase past it is skipped), ``--smoke`` (CPU, tiny shapes), ``--phases a,b`` (of ``phases``, all by default)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default="", help=f"directory for {json_name} (none: no file)")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds; a phase past it is skipped")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=tuple(phases),
                   help="comma-separated, of " + ", ".join(phases))
    args = p.parse_args()
    args.path = args.out and os.path.join(args.out, json_name)
    return args


def warm_then_time(run: RunLog, label: str, fns: dict, dev, calls: int, rounds: int, warm: int = 3):
    """``warm`` calls of each of ``fns`` (the kernels compile, caches fill, fast paths keep their entries), ``label``
    logged, then ``host_and_wall_us`` under no_grad -> (its times, name -> (median host µs, median wall µs))."""
    with torch.no_grad():
        for _ in range(warm):
            for fn in fns.values():
                fn()
        run.log(label)
        times = host_and_wall_us(fns, dev, calls, rounds)
    return times, {name: (statistics.median(h), statistics.median(w)) for name, (h, w) in times.items()}


def host_and_wall_us(fns: dict, dev, calls: int, rounds: int) -> dict:
    """name -> ([host µs a call, each round], [wall µs a call, each round]): host is ``calls`` calls queued behind
    ~1 ms of GPU work on CUDA (the host's time alone), wall the same to completion; the order reversed every other
    round."""
    out = {name: ([], []) for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            for i, busy in enumerate((True, False)):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    if busy:
                        torch.cuda._sleep(2_000_000)
                start = time.perf_counter()
                for _ in range(calls):
                    fns[name]()
                if dev.type == "cuda" and not busy:
                    torch.cuda.synchronize()
                out[name][i].append((time.perf_counter() - start) * 1e6 / calls)
    return out

def run_generate(model, prompt, tokens: int, config=None, processor=None, logits: bool = False):
    """Greedy ``model.generate`` of ``tokens`` tokens under no_grad: compiled with a static cache under
    ``config`` (a CompileConfig), eager when None; ``processor`` a logits processor (a step clock), or None."""
    from transformers import LogitsProcessorList

    kwargs = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=logits)
    if config is None:
        kwargs["disable_compile"] = True
    else:
        kwargs.update(cache_implementation="static", compile_config=config)
    if processor is not None:
        kwargs["logits_processor"] = LogitsProcessorList([processor])
    with torch.no_grad():
        return model.generate(prompt, **kwargs)


def check_parser(deadline: float) -> argparse.ArgumentParser:
    """A device check's common options, the script adding its own: ``--out DIR`` (its JSON's folder; "" none),
    ``--deadline S`` (seconds: the check stops timing by then), ``--smoke`` (CPU, interpreted, tiny shapes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=deadline)
    p.add_argument("--smoke", action="store_true")
    return p


def case_args(doc: str, deadline: float, cases, namespace=None) -> argparse.Namespace:
    """The command line of a check run case by case (``run_cases``): --out (the JSON's folder; none: not written),
    --deadline (s: no case starts past it), --rounds (2 under --smoke), --cases (default: all, in order), --smoke."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=deadline)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", nargs="*", default=list(cases))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(namespace=namespace)
    if args.smoke:
        args.rounds = 2
    return args


def run_cases(run: RunLog, result: dict, args: argparse.Namespace, name: str, run_case: Callable) -> None:
    """``case_args``' run: the watchdog started, the header (``run_info``, smoke, rounds) logged and kept as
    ``result["run"]``, ``run_case(case)`` for each of ``args.cases`` that starts before ``args.deadline``,
    <out>/<name>.json rewritten after each; the table last."""
    threading.Thread(target=run.watchdog, daemon=True).start()
    result["run"] = run_info() | {"smoke": args.smoke, "rounds": args.rounds}
    run.log(f"{result['run']}")

    def after() -> None:
        if args.out:
            write_json(os.path.join(args.out, f"{name}.json"), result)

    run.each_cell(args.cases, run_case, args.deadline, after)
    run.print_table()


def ceilings(dev, fp8: bool = False) -> dict:
    """This run's ceilings (``moekit.bench.ceilings``: copy, bf16 mm 8192^3; ``fp8``: the fp8 mm rate too)."""
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    base = measure_ceilings(dev)
    got = {"copy_TBps": base.copy_TBps, "bf16_mm_TFLOPs": base.mm_TFLOPs}
    if fp8:
        got["fp8_mm_TFLOPs"] = measure_fp8_mm(dev).TFLOPs
    return got


def cells_check(run: RunLog, smoke: bool, name: str, deadline: float, cells: dict, run_cell: Callable,
                margin_s: float = 8.0) -> int:
    """A cell-by-cell device check's main: ``--out DIR`` (its <name>.json, rewritten after each cell), ``--deadline``
    (default ``deadline`` s; no cell starts past it less ``margin_s``), ``--cells 0,2`` (positions in ``cells``, label
    -> cell, in order; default all), ``--smoke``. Runs with no user config file of this machine, the watchdog, the
    device (the CPU under ``smoke``), the JSON's header {"run": ``run_info`` and smoke, "cells": {}, "ceilings"} and
    this run's ceilings (``ceilings`` on the GPU; a copy rate of 1 TB/s in the smoke) logged; then ``run_cell(cell,
    dev, ceilings, until, result)`` for each (``until``: the deadline as ``time.time()``), the table last. Returns the
    exit status: 1 where a check failed."""
    p = check_parser(deadline)
    p.add_argument("--cells", default="", help="positions of the check's cells, comma-separated (default: all)")
    args = p.parse_args()
    path = args.out and os.path.join(args.out, f"{name}.json")
    os.environ["MOEKIT_CONFIG_DIR"] = tempfile.mkdtemp()  # no user file of this machine in any lookup
    threading.Thread(target=run.watchdog, daemon=True).start()
    dev = torch.device("cpu" if smoke else "cuda")
    result = {"run": run_info() | {"smoke": smoke}, "cells": {}}
    result["ceilings"] = ceil = {"copy_TBps": 1.0} if smoke else ceilings(dev)
    run.log(f"{result['run']} {ceil}")
    labels = list(cells) if not args.cells else [list(cells)[int(i)] for i in args.cells.split(",")]
    until = time.time() + args.deadline - run.elapsed()

    def after() -> None:
        if path:
            write_json(path, result)

    run.each_cell(labels, lambda label: run_cell(cells[label], dev, ceil, until, result), args.deadline - margin_s,
                  after)
    run.print_table()
    return 1 if run.failed else 0
