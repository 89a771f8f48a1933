"""The compile-worker pool of the device checks (``decode_q3_device_check.py``, ``held_run.py``'s weight-only
checks).

Each worker is the check script itself run with ``--worker TASKS`` (a JSON list of (cell, variant) pairs): it
compiles and runs its part once, printing ``START ci vi`` / ``OK ci vi`` / ``ERR ci vi message`` lines, so the main
process knows which variants compiled while it builds the real weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch


def spawn_workers(script: str, parts: list, smoke: bool, tag: str) -> list:
    """One process per part of the (cell, variant) tasks, running ``script --worker`` (it compiles its part and
    prints START / OK / ERR lines); its output goes to a log under /tmp."""
    procs = []
    for j, part in enumerate(parts):
        log = Path(f"/tmp/{tag}_worker_{os.getpid()}_{j}.log")
        with open(log, "w") as out:
            args = [sys.executable, script, "--worker", json.dumps(part)] + (["--smoke"] if smoke else [])
            procs.append((subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), log))
    return procs


def collect_workers(procs, seconds_left) -> dict:
    """{(cell, variant): "ok" | "crashed" | "error: ..."} from the workers' logs, each waited for until
    ``seconds_left()`` runs out (then killed)."""
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, seconds_left()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return task_status(procs)


def task_status(procs) -> dict:
    """{(cell, variant): "ok" | "crashed" (started, not finished: still compiling where the worker runs) | "error:
    ..."} from the workers' logs as they stand, waiting for nothing."""
    status = {}
    for _, log in procs:
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if parts[0] in ("START", "OK", "ERR") and len(parts) >= 3:
                status[(int(parts[1]), int(parts[2]))] = {"START": "crashed", "OK": "ok"}.get(
                    parts[0], "error: " + (parts[3] if len(parts) > 3 else ""))
    return status


def held_weights(held: dict, key, build: Callable, free_cache: bool = False):
    """``held[key]``, built by ``build()`` after the previous key's weights are dropped (one key's weights at a
    time; ``free_cache``: CUDA's cached blocks released before the build)."""
    if key not in held:
        held.clear()
        if free_cache:
            torch.cuda.empty_cache()
        held[key] = build()
    return held[key]


def compile_one(ci: int, vi: int, run: Callable[[], None], smoke: bool) -> None:
    """A worker's task (cell ci, variant vi): ``START``, ``run()`` and (on the GPU) a sync, ``OK``; ``ERR`` with the
    error where it raises, which the main process reads (``collect_workers``) to skip the variant."""
    print(f"START {ci} {vi}", flush=True)
    try:
        run()
        if not smoke:
            torch.cuda.synchronize()
        print(f"OK {ci} {vi}", flush=True)
    except Exception as err:  # noqa: BLE001  (reported; the main process compiles or skips it)
        print(f"ERR {ci} {vi} {type(err).__name__}: {str(err)[:200]!r}".replace("\n", " "), flush=True)


def smoke_shape(preset: str, smoke: bool):
    """``preset``'s ``Shape``; under --smoke a tiny one (at most 8 experts, N 128, K 256, top-k at most 2)."""
    from moekit.bench.cells import Shape

    real = Shape.from_preset(preset)
    if smoke:
        return Shape(f"{preset}/smoke", min(real.num_experts, 8), 128, 256, min(real.top_k, 2))
    return real
