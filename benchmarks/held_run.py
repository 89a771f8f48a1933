"""The run of the weight-only checks whose presets' weights are held while their cells run, beside compile workers
(``wolean_device_check.py``, ``wo38_device_check.py``): the command line, the cell loop, the
JSON and table of the cells so far, and a watchdog past the deadline (a hung kernel).

    specs = [HeldCell(ci, preset, 6.0, f"{preset} M={m}", preset, preset) for ci, (preset, m) in enumerate(CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, weights, run, ARGS.out, "x.json",
                                            ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Callable

from bench_run import ceilings, run_info, write_json
from compile_workers import collect_workers


@dataclasses.dataclass(frozen=True)
class HeldCell:
    """A cell of ``held_cells``: its index, its preset (whose weights it runs on), the seconds it needs before the
    deadline, its "skipped (deadline): LABEL" line's label, its compile workers' key in ``procs`` and the name its
    "NAME compiled: ..." line gives them."""

    ci: int
    preset: str
    budget: float
    label: str
    key: object
    name: str


@dataclasses.dataclass(frozen=True)
class HeldRun:
    """What ``held_cells`` takes of its script: the deadline (s), the clock, the failed list, the device, a preset's
    weights, a cell's run (``run(ci, weights, compile status)``: its cells), the JSON's folder (None: no JSON) and
    name, the ceilings (in the JSON), the table's title and a cell's lines in it, and the watchdog's margin past the
    deadline (None: no watchdog)."""

    deadline: float
    elapsed: Callable[[], float]
    failed: list
    dev: object
    weights: Callable[[str], object]
    run: Callable[[int, object, dict], list]
    out: str | None
    name: str
    ceil: dict
    title: str
    rows: Callable[[object], list]
    watchdog_s: float | None

    def dump(self, cells: list) -> None:
        if self.out:
            cells = [dataclasses.asdict(c) for c in cells]
            write_json(os.path.join(self.out, self.name), {**run_info(), **self.ceil, "cells": cells,
                                                           "failed": self.failed, "seconds": self.elapsed()})

    def table(self, cells: list) -> None:
        print(f"\n{self.title}")
        for c in cells:
            print("\n".join(self.rows(c)))
        print(f"FAILED: {self.failed or 'none'} ({self.elapsed():.1f} s)", flush=True)


def held_cells(specs: list[HeldCell], procs: dict, r: HeldRun) -> int:
    """Each of ``specs`` that fits before the deadline: its preset's weights (kept while the preset's cells run, built
    again where they are not adjacent), its compile workers collected (given until half the time left), its cells
    run, the JSON written; then the workers left collected at once and the table. 1 if any check failed."""
    import torch

    cells, held, status = [], {}, {}
    if r.watchdog_s is not None:
        start_watchdog(r.deadline + r.watchdog_s, r.elapsed, procs, r.failed, lambda: r.table(list(cells)),
                       lambda: r.dump(list(cells)))
    for c in specs:
        if r.elapsed() + c.budget > r.deadline:
            print(f"skipped (deadline): {c.label}", flush=True)
            continue
        if c.preset not in held:
            held.clear()
            if r.dev.type == "cuda":
                torch.cuda.empty_cache()  # the last preset's weights back before this one's
            held[c.preset] = r.weights(c.preset)
        if c.key in procs:
            status.update(collect_workers(procs.pop(c.key), lambda: (r.deadline + r.elapsed()) / 2 - r.elapsed()))
            print(f"[{r.elapsed():5.1f}s] {c.name} compiled: {sorted(set(status.values()))}"[:400], flush=True)
        cells.extend(r.run(c.ci, held[c.preset], status))
        r.dump(cells)
    for rest in procs.values():
        collect_workers(rest, lambda: 0.1)
    r.table(cells)
    return 1 if r.failed else 0


def start_watchdog(until: float, elapsed: Callable[[], float], procs: dict, failed: list, *finish: Callable[[], None]):
    """A daemon thread: past ``until`` s (the deadline and a margin: a hung kernel), the compile workers left killed
    (none outlives the run), "watchdog" failed, each of ``finish`` (the table and JSON so far), then the process
    ends (exit 1)."""

    def wait() -> None:
        time.sleep(max(1.0, until - elapsed()))
        print(f"watchdog: {elapsed():.0f} s, exiting", flush=True)
        for p, _ in [w for workers in list(procs.values()) for w in workers]:
            p.kill()
        failed.append("watchdog")
        for step in finish:
            step()
        os._exit(1)

    threading.Thread(target=wait, daemon=True).start()


def held_device(smoke: bool, args: argparse.Namespace, fakes: Callable[[], None] | None = None):
    """The device: the CPU under --smoke (then ``fakes()``, default ``install_test_fakes``, and no deadline: the
    interpreter takes minutes), else CUDA."""
    import torch

    if smoke:
        (fakes or install_test_fakes)()
        args.deadline = float("inf")
    return torch.device("cpu" if smoke else "cuda")


def held_ceilings(dev, elapsed: Callable[[], float]) -> dict:
    """This run's ceilings (``bench_run.ceilings``), printed with torch's version."""
    import torch

    ceil = ceilings(dev)
    print(f"[{elapsed():5.1f}s] {torch.__version__} copy {ceil['copy_TBps']:.2f} TB/s, mm {ceil['bf16_mm_TFLOPs']:.0f} "
          "TFLOP/s", flush=True)
    return ceil


def install_test_fakes() -> None:
    """CPU (--smoke): the Gluon GEMMs replaced by the tests' torch stand-ins (``tests/_gluon_fakes.py``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from _gluon_fakes import install_fakes

    install_fakes()


def held_entry(main: Callable[[], int], worker: Callable[[list], None], args: argparse.Namespace, out: str,
               *flags: tuple[str, str]) -> None:
    """A held check's entry: ``script --worker TASKS`` runs ``worker(the JSON tasks)`` (a compile worker); else
    --smoke, each of ``flags`` ((option, help): a switch), --deadline and --out (for ``out``; defaults ``args``')
    are parsed into ``args`` and ``main()``'s status ends the process."""
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    for flag, text in flags:
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--deadline", type=float, default=args.deadline, help="no cell starts past it (s)")
    parser.add_argument("--out", default=args.out, help=f"folder for {out} (default $OUT)")
    parser.parse_args(namespace=args)
    sys.exit(main())
