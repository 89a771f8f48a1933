"""hop41: on a GPU without tuned files of its own (an H100), the nearest sibling's files (``configs.tuned_files``: the
H200's packaged ones) against the heuristic it got before, bf16 and fp8_block, at bench cells. It decides
``moekit.experts.configs.SIBLING_CONFIGS`` (the fallback's default, off until this has run).

    PYTHONPATH=$PWD timeout 90 python3 benchmarks/hop41_device_check.py --out $OUT/hop41 --deadline 68   # H100
    PYTHONPATH=$PWD python3 benchmarks/hop41_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

The user config directories ($MOEKIT_CONFIG_DIR, $XDG_CONFIG_HOME) are pointed at an empty one first, so the device
has no file of its own (a copy of the H200's files under its name, as earlier sessions made by hand, would blur the
comparison). Per cell (preset, M, dtype; CELLS, in the order of their weights): the lookup under each setting
(``$MOEKIT_SIBLING_CONFIGS`` 0: "heuristic", 1: "sibling") and whose file served (``configs.served_by``); a cell is
skipped where the route takes a Gluon path (no file is read there: ``triton_gluon.DEFAULT_CHOICE``,
``triton_gluon_fp8.DEFAULT_FP8_CHOICE``) or both lookups give the same entry (on an H200: its own files both ways).
Else the ``triton`` backend's output on the first input set under each setting against the reference (bf16
``experts_reference``, fp8 ``experts_fp8_block_reference``; rel L2 < TOLERANCE: PASS / FAIL), then each setting's
calls over the rotated input sets captured in one CUDA graph and the two graphs timed in ROUNDS settled rounds
(``bench_rounds.settled``): median µs a call, heuristic / sibling, rounds the sibling took <= 0.97x the heuristic
(and the reverse); the route's plan checked to hold the looked-up tiles. Compile: WORKERS subprocesses run every
(cell, setting) to be timed once first, eagerly and captured, on zero weights (Triton's disk cache), for at most
--worker-deadline seconds. Lines as it goes, <out>/hop41.json after each cell, the table last with the verdict:
SIBLING_CONFIGS = True where every check PASS, the sibling is >= 3% faster in every round of at least one timed cell
(the defaults rule, per cell) and >= 3% slower in no round of any (the fallback serves them all); the counts say how
far from it a run is.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
# this device's own files: none; made by the main process (removed as it exits), inherited by its workers
if "HOP41_CONFIG_DIR" not in os.environ:
    os.environ["HOP41_CONFIG_DIR"] = tempfile.mkdtemp(prefix="hop41_configs_")
    atexit.register(shutil.rmtree, os.environ["HOP41_CONFIG_DIR"], True)
EMPTY_CONFIG_DIR = os.environ["HOP41_CONFIG_DIR"]
os.environ["MOEKIT_CONFIG_DIR"] = os.environ["XDG_CONFIG_HOME"] = EMPTY_CONFIG_DIR

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import graph_of, settled, wins  # noqa: E402
from bench_run import RunLog, rel_l2, run_info, write_json  # noqa: E402
from compile_workers import collect_workers, compile_one, held_weights, smoke_shape, spawn_workers  # noqa: E402
from compile_workers import zero_fp8_weights  # noqa: E402
from decode_q3_device_check import fp8_weights, reference  # noqa: E402

# (preset, M, dtype): bench cells of the three presets, weights built once per (preset, dtype) in this order
CELLS = [(p, m, d) for p, ms in (("mixtral-8x7b", (1, 64, 512, 1024)), ("qwen3-30b-a3b", (1, 64, 1024, 4096)),
                                 ("deepseek-v3", (8, 512))) for d in ("bf16", "fp8") for m in ms]
SMOKE_CELLS = [("qwen3-30b-a3b", 1, "bf16"), ("qwen3-30b-a3b", 8, "fp8")]
SETTINGS = {"heuristic": "0", "sibling": "1"}  # name -> $MOEKIT_SIBLING_CONFIGS
ROUNDS, REPLAYS, WORKERS = 5, 3, 2 if SMOKE else 12
TOLERANCE = 2e-2  # rel L2 against the reference (decode_q3_device_check's; measured 2.5e-3 - 4.3e-3 fp8)
ROTATION_BYTES = 256 << 20  # rotate input sets until a pass's touched weights exceed ~4x the L2 (the bench's rule)
# The smoke's stand-in for a GPU: the route's lookups take this device key, and the sibling's files (an entry unlike
# the heuristic's, per smoke cell) lie in the empty user directory under the H200's name
SMOKE_DEVICE = "NVIDIA_H100_80GB_HBM3"
RUN = RunLog("hop41: the sibling's (H200) tuned files against the heuristic on this device (graph µs a call, "
             f"median of {ROUNDS} settled rounds)", stall_s=60)
RESULT: dict = {"run": {}, "cells": [], "failed": RUN.failed}
ARGS = argparse.Namespace()


@dataclass
class CellResult:
    """One cell: what each setting looked up and whose file served it, the checks, the timings."""

    preset: str
    M: int
    dtype: str  # "bf16" or "fp8"
    status: str = ""  # "timed", "gluon route", "same lookup", "not reached", "error: ..."
    served: dict = field(default_factory=dict)  # setting -> ``configs.served_by``
    lookup: dict = field(default_factory=dict)  # setting -> the entry looked up (its dict)
    rel_l2: dict = field(default_factory=dict)  # setting -> against the reference
    us: dict = field(default_factory=dict)  # setting -> [µs a call, each round]


def shape_of(preset: str):
    return smoke_shape(preset, SMOKE)


def label_of(cell: tuple) -> str:
    preset, m, dtype = cell
    return f"{dtype}:{preset}:{m}"


def cells() -> list[tuple]:
    """The cells of this run: SMOKE_CELLS, or CELLS (those $HOP41_CELLS names, where set: ``--cells``, which the
    workers inherit this way)."""
    chosen = os.environ.get("HOP41_CELLS", "").split()
    return SMOKE_CELLS if SMOKE else [c for c in CELLS if not chosen or label_of(c) in chosen]


def use_setting(name: str) -> None:
    """$MOEKIT_SIBLING_CONFIGS for ``name``, and every cached lookup and plan dropped (a plan keeps the config it
    was built with, keyed by the call, not by the variable)."""
    from moekit.experts.configs import clear_config_cache
    from moekit.experts.triton import clear_launch_caches

    os.environ["MOEKIT_SIBLING_CONFIGS"] = SETTINGS[name]
    clear_config_cache()
    clear_launch_caches()


def device_key_of(dev) -> str:
    from moekit.experts.configs import device_key

    return SMOKE_DEVICE if SMOKE else device_key(dev)


def lookup(preset: str, m: int, dtype: str, dev) -> tuple[dict, str]:
    """(the entry the route's lookup takes under the current setting, as a dict; whose file served it)."""
    from moekit.experts.configs import config_file_name, get_config, served_by
    from moekit.experts.triton_fp8_plan import config_file_name as fp8_name
    from moekit.experts.triton_fp8_plan import fp8_entry

    s, key = shape_of(preset), device_key_of(dev)
    if dtype == "fp8":
        entry = fp8_entry(m, s.num_experts, s.n, s.k, s.top_k, 128, key)
        got = {**entry.config.to_dict(), **{k: v for k, v in asdict(entry).items() if k != "config" and v is not None}}
        return got, served_by(m, lambda dev_key: fp8_name(s.num_experts, s.n, s.k, dev_key), key)
    config = get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, key)
    return config.to_dict(), served_by(m, lambda dev_key: config_file_name(s.num_experts, s.n, s.k, torch.bfloat16,
                                                                            dev_key), key)


def gluon_route(preset: str, m: int, dtype: str, dev) -> bool:
    """Whether the route takes a Gluon path at this cell on ``dev`` (then no tuned file is read)."""
    from moekit.experts.triton_gluon import DEFAULT_CHOICE
    from moekit.experts.triton_gluon_fp8 import DEFAULT_FP8_CHOICE
    from moekit.experts.triton_gluon_launch import gluon_supported

    s = shape_of(preset)
    if not gluon_supported(dev):
        return False
    if dtype == "fp8":
        return DEFAULT_FP8_CHOICE.wants(m, s.top_k, s.n, s.k, s.num_experts)
    return DEFAULT_CHOICE.wants(m, s.n, s.top_k, s.num_experts)


def build_weights(preset: str, dtype: str, dev, zeros: bool = False) -> tuple:
    """(w13, w2): bf16 tensors (``bench.cells.make_weights``) or ``Fp8BlockWeight``s (random e4m3, random block
    scales); ``zeros``: for compiling only."""
    s = shape_of(preset)
    if dtype == "fp8":
        return zero_fp8_weights(s, dev) if zeros else fp8_weights(s, dev)
    if zeros:
        return (torch.zeros(s.num_experts, 2 * s.n, s.k, device=dev, dtype=torch.bfloat16),
                torch.zeros(s.num_experts, s.k, s.n, device=dev, dtype=torch.bfloat16))
    from moekit.bench.cells import make_weights

    w = make_weights(s, torch.bfloat16, dev)
    return w.w13, w.w2


def input_sets(preset: str, m: int, dtype: str, dev) -> list:
    """The rotated input sets of the cell (the bench's rule: 2 to 8, a pass's touched weights >= ROTATION_BYTES)."""
    from moekit.bench.cells import make_sets

    s = shape_of(preset)
    expert_bytes = 3 * s.n * s.k * (1 if dtype == "fp8" else 2)
    num_sets = max(2, min(8, math.ceil(ROTATION_BYTES / (max(1, min(s.num_experts, m * s.top_k)) * expert_bytes))))
    return make_sets(s, m, num_sets, torch.bfloat16, dev)


def call(w, t):
    from moekit.experts import get_backend

    return get_backend("triton")(t.x, w[0], w[1], t.topk_ids, t.topk_weights)


def tiles_of(entry: dict) -> tuple:
    """(BLOCK_M, gate-up BLOCK_N, down BLOCK_N) of a looked-up entry (a plan may shrink stages and BLOCK_K to fit)."""
    return entry["BLOCK_M"], entry["up"]["BLOCK_N"], entry["down"]["BLOCK_N"]


def planned_tiles(dtype: str) -> list:
    """``tiles_of`` every plan the route built since the last ``use_setting`` (which dropped them all)."""
    import moekit.experts.triton_fp8_plan as fp8_plan
    import moekit.experts.triton_plan as plan

    plans = (fp8_plan if dtype == "fp8" else plan)._PLANS.values()
    return [tiles_of(p.config.to_dict()) for p in plans]


def timed_tasks() -> list[tuple[int, str]]:
    """(cell index, setting) of every cell that may be timed (not a Gluon-route cell, lookups that differ)."""
    dev, tasks = torch.device("cpu" if SMOKE else "cuda"), []
    for ci, (preset, m, dtype) in enumerate(cells()):
        if gluon_route(preset, m, dtype, dev):
            continue
        looked = set()
        for name in SETTINGS:
            use_setting(name)
            looked.add(json.dumps(lookup(preset, m, dtype, dev)[0], sort_keys=True))
        tasks += [(ci, name) for name in SETTINGS] if len(looked) > 1 else []
    return tasks


def worker_main(tasks: list) -> None:
    """Compile (cell, setting) tasks: the call once eagerly and once captured (a capture plans fp8's x quantization
    apart), on zero weights of the real shape."""
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    setting_names = list(SETTINGS)
    for ci, si in tasks:
        preset, m, dtype = cells()[ci]
        w = held_weights(held, (preset, dtype), lambda: build_weights(preset, dtype, dev, zeros=True), free_cache=True)
        t = make_sets(shape_of(preset), m, 1, torch.bfloat16, dev)[0]
        use_setting(setting_names[si])
        compile_one(ci, si, lambda: graph_of([lambda: call(w, t)], dev, warmups=1, replay=False) if not SMOKE
                    else call(w, t), SMOKE)


def start_workers() -> list:
    """DeepSeek-V3's tasks (22 GB of bf16 weights) on one worker, the rest round-robin over the others."""
    setting_names = list(SETTINGS)
    tasks = [(ci, setting_names.index(name)) for ci, name in timed_tasks()]
    big = [t for t in tasks if cells()[t[0]][0] == "deepseek-v3"]
    light = [t for t in tasks if cells()[t[0]][0] != "deepseek-v3"]
    n = max(1, WORKERS - (1 if big else 0))
    parts = ([big] if big else []) + [light[j::n] for j in range(n) if light[j::n]]
    RUN.log(f"compile: {len(tasks)} tasks on {len(parts)} workers")
    return spawn_workers(__file__, parts, SMOKE, "hop41")


def run_cell(ci: int, held: dict, dev) -> CellResult:
    preset, m, dtype = cells()[ci]
    cell = CellResult(preset, m, dtype)
    RESULT["cells"].append(cell)
    label = f"{dtype} {preset} M={m}"
    for name in SETTINGS:
        use_setting(name)
        cell.lookup[name], cell.served[name] = lookup(preset, m, dtype, dev)
    RUN.log(f"{label}: served by " + ", ".join(f"{n}: {cell.served[n]}" for n in SETTINGS))
    if gluon_route(preset, m, dtype, dev):
        cell.status = "gluon route"
        return cell
    if cell.lookup["heuristic"] == cell.lookup["sibling"]:
        cell.status = "same lookup"
        return cell
    w = held_weights(held, (preset, dtype), lambda: build_weights(preset, dtype, dev), free_cache=not SMOKE)
    sets = input_sets(preset, m, dtype, dev)
    ref = reference("fp8" if dtype == "fp8" else "bf16", sets[0], w)
    graphs = {}
    for name in SETTINGS:
        use_setting(name)
        cell.rel_l2[name] = rel_l2(call(w, sets[0]), ref)
        RUN.check(f"{label} {name}", cell.rel_l2[name] < TOLERANCE,
                  f"rel_l2={cell.rel_l2[name]:.2e}  {cell.served[name]}: {cell.lookup[name]}")
        ran = planned_tiles(dtype)
        RUN.check(f"{label} {name}: the route ran the looked-up tiles", tiles_of(cell.lookup[name]) in ran, str(ran))
        graphs[name] = (graph_of([lambda t=t: call(w, t) for t in sets], dev), None)  # (timed, no warm graph)
    until = time.time() + ARGS.deadline - RUN.elapsed()
    cell.us = settled(graphs, len(sets), dev, ROUNDS, REPLAYS, until=until)
    cell.status = "timed"
    RUN.log(f"{label}: " + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in cell.us.items()))
    return cell


def summarize() -> None:
    """The table: a line per cell, then the verdict on SIBLING_CONFIGS."""
    RUN.summary.append(f"device {RESULT['run'].get('device')}; heuristic / sibling µs, x = heuristic / sibling, "
                       "rounds the sibling took <= 0.97x (>= 3% faster) / >= 1.03x")
    timed = []
    for c in RESULT["cells"]:
        label = f"{c.dtype:<5}{c.preset:<14}M={c.M:<6}"
        if c.status != "timed" or not all(c.us.get(n) and not math.isnan(c.us[n][0]) for n in SETTINGS):
            RUN.summary.append(f"{label}{c.status or 'not reached'}  ({c.served.get('sibling', '-')})")
            continue
        h, s = c.us["heuristic"], c.us["sibling"]
        faster, slower = wins(s, h), wins(h, s)
        timed.append((c, faster, len(s), slower))
        RUN.summary.append(f"{label}{statistics.median(h):9.1f} / {statistics.median(s):9.1f}  "
                           f"x{statistics.median(h) / statistics.median(s):.3f}  faster {faster}/{len(s)}  "
                           f"slower {slower}/{len(s)}  ({c.served['sibling']})")
    won = sum(f == n == ROUNDS for _, f, n, _ in timed)
    lost = sum(sl > 0 for _, _, _, sl in timed)
    on = won > 0 and lost == 0 and not RUN.failed
    RUN.summary.append(f"verdict: SIBLING_CONFIGS = {on} ({won} of {len(timed)} timed cells >= 3% faster in "
                       f"{ROUNDS}/{ROUNDS} rounds, {lost} >= 3% slower in some round; failed checks: "
                       f"{len(RUN.failed)})")


def write_out() -> None:
    if ARGS.out:
        write_json(os.path.join(ARGS.out, "hop41.json"), {**RESULT, "cells": [asdict(c) for c in RESULT["cells"]]})


def write_smoke_siblings() -> None:
    """The smoke's sibling files: per smoke cell an entry unlike the heuristic's, under the H200's name, in the
    (otherwise empty) user directory: the sibling fallback finds them for SMOKE_DEVICE."""
    from moekit.experts.configs import GemmTile, KernelConfig, config_file_name, write_config_data
    from moekit.experts.triton_fp8_plan import config_file_name as fp8_name

    tile = GemmTile(64, 128, 1, 4, 2)  # 64 wide: the heuristic's smoke tiles are 32 (bf16) and 128 (fp8)
    for preset, m, dtype in SMOKE_CELLS:
        s = shape_of(preset)
        entry = KernelConfig(16, tile, tile).to_dict()
        name = (fp8_name(s.num_experts, s.n, s.k, "NVIDIA_H200") if dtype == "fp8" else
                config_file_name(s.num_experts, s.n, s.k, torch.bfloat16, "NVIDIA_H200"))
        data = {"E": s.num_experts, "N": s.n, "K": s.k, "dtype": "fp8_block" if dtype == "fp8" else "bfloat16",
                "device": "NVIDIA_H200", "configs": {str(m): {**entry, **({"weight_tma": False} if dtype == "fp8"
                                                                           else {})}}}
        write_config_data(Path(EMPTY_CONFIG_DIR, name), data)


def patch_smoke_device() -> None:
    """The smoke's route looks its configs up under SMOKE_DEVICE (the CPU's own key is "cpu", which has no
    siblings): the plans' ``device_key`` replaced."""
    import moekit.experts.triton_fp8_plan as fp8_plan
    import moekit.experts.triton_plan as plan

    plan.device_key = fp8_plan.device_key = lambda device=None: SMOKE_DEVICE


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=68.0, help="seconds: no cell starts after it")
    p.add_argument("--worker-deadline", type=float, default=35.0, help="seconds the compile workers may take")
    p.add_argument("--cells", nargs="*", default=None, help="DTYPE:PRESET:M (e.g. fp8:qwen3-30b-a3b:64); default all")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.parse_args(namespace=ARGS)
    unknown = sorted(set(ARGS.cells or ()) - {label_of(c) for c in CELLS})
    if unknown:
        p.error(f"--cells: {unknown} are not among {[label_of(c) for c in CELLS]}")
    if ARGS.cells:
        os.environ["HOP41_CELLS"] = " ".join(ARGS.cells)
    if SMOKE:
        write_smoke_siblings()
        patch_smoke_device()
    if ARGS.worker:
        worker_main(json.loads(ARGS.worker))
        return 0
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "config_dir": EMPTY_CONFIG_DIR, "cells": cells()}
    procs = start_workers()
    status = collect_workers(procs, lambda: ARGS.worker_deadline - RUN.elapsed())
    RUN.log(f"compile: {sum(v == 'ok' for v in status.values())} of {len(status)} tasks ok")
    held: dict = {}
    index = {label_of(c): ci for ci, c in enumerate(cells())}
    RUN.each_cell(list(index), lambda label: (run_cell(index[label], held, dev), write_out()), ARGS.deadline)
    summarize()
    write_out()
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
