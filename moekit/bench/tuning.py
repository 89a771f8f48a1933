"""The kernel-config tuner behind ``moekit tune``: times candidate launch configs of a Triton experts
path on this GPU and writes a config file that the path's lookup picks up with no code change.

    tune(shape, batches, dtype) -> scheme_for(dtype): TuneScheme (what differs per weight format)
        per M: tune_one -> coordinate descent, each stage's candidates compiled together, then timed
        -> E{E}_N{N}_K{K}_{dtype or scheme}_{device}.json (``moekit.experts.configs``' format)

Weight formats (``TuneScheme``): the 16-bit/float32 path (``bfloat16``, ``float16``, ``float32``; here)
and the quantized ones (``fp8_block``, ``int8_w8a16``, ``int4_w4a16``, ``mxfp4``; ``tuning_quant``).

Search, per batch size M (coordinate descent, so the cost is a sum, not a product, of the choices):
for each candidate BLOCK_M near the mean rows per expert, try the gate-up tiles with the down tile
fixed, keep the best, then the down tiles, then (a scheme with ``switches``: fp8) the same tiles with the path's
switches; keep the best BLOCK_M. The heuristic default is timed too, and so is the entry the lookup takes today
(``current``; the search at its height starts from its tiles): their times are stored beside the entry
(``measured``: heuristic_us, current_us), so the default's shortfall and today's are on record, and a tuned entry is
never one the search timed slower than today's.
Each stage hands its candidates to the timer at once: on a GPU their kernels compile together in a
thread pool (``precompile``) before any is timed.

Resumable: each finished M is written to ``<file>.partial.json`` at once; a rerun skips those M.

A tuned entry adds or replaces its own M and nothing else (``tuning_merge``): an existing file keeps its entries of
the M not tuned in this run as they were, switches and all (``--batches`` retunes a few); the lookups overlay a user
file's M over the packaged file's (``configs.overlay``), so tuning M = 128 into a fresh user directory leaves the
other M on the packaged entries; ``install`` merges a finished file into the packaged config directory's file of
that name the same way (for committing). A tuned fp8 entry names the switches it was timed with
(``tuning_switches``); the other formats' are plain. Where one replaces an entry whose switches (the fp8 files'
"weight_tma", "pair_dot", ...) it leaves off or sets otherwise, ``note`` is told which.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from moekit.bench.cells import GPU_BATCHES, CellInputs, Shape, make_sets, make_weights
from moekit.bench.compiler_output import stderr_to
from moekit.bench.run import GRAPH_MAX_M
from moekit.bench.timing import time_calls
from moekit.bench.tuning_merge import dropped_switches, looked_up, merge, raw_entries, switch_notes
from moekit.experts.configs import (
    PACKAGED_DIR, GemmTile, KernelConfig, config_file_name, default_user_dir, device_key, dtype_key, get_config,
    heuristic_config, read_configs, write_config_data,
)
from moekit.triton_bind import BoundLaunch, interpreting

TUNE_BATCHES = GPU_BATCHES  # tuned at the M values the bench times
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TuneScheme:
    """What the search needs of one weight format: its weights, the call it times, the plan's default
    and file name, and the candidate tiles (each one the plan's own config checks accept)."""

    name: str  # the file name's dtype part and its "dtype" field: "bfloat16", "fp8_block", "int4_w4a16", ...
    x_dtype: torch.dtype  # the activations of the timed calls
    make_weights: Callable[[Shape, torch.device], object]  # made once per shape, passed to ``call``
    call: Callable[[object, CellInputs, KernelConfig], torch.Tensor]  # one experts call on an explicit config
    heuristic: Callable[[int, Shape], KernelConfig]  # (M, shape) -> the plan's default without a file
    block_ms: Callable[[int, Shape], list[int]]  # (M, shape) -> the tile heights worth timing
    tiles: Callable[[int, str], list[GemmTile]]  # (BLOCK_M, "up" or "down") -> the tiles tried there
    file_name: Callable[[int, int, int, str], str]  # (E, N, K, device key) -> the name the lookup reads
    validate: Callable[[KernelConfig], None] = lambda config: None  # the plan's own check; raises ValueError
    # (shape, device) -> None, or a ValueError/TypeError for a shape the path cannot take (a quick check on device)
    check_shape: Callable[[Shape, torch.device], None] = lambda shape, device: None
    # (M, shape, config) -> the same tiles with the path's other switches (fp8: ``tuning_switches``), each one the
    # plan takes; timed in one stage after each height's tiles. None: the path has none.
    switches: Callable[[int, Shape, KernelConfig], list[KernelConfig]] | None = None
    # (M, shape, device key) -> the entry the path's lookup takes at M today, switches and all: timed with the
    # default, and the search at its height starts from it. None: not timed.
    current: Callable[[int, Shape, str], KernelConfig] | None = None


def tiles_of(config: KernelConfig) -> KernelConfig:
    """The tile config of a candidate (a ``KernelConfig`` subclass with switches, ``tuning_switches``) alone."""
    return KernelConfig(config.BLOCK_M, config.up, config.down, config.swap_ab)


def block_m_candidates(num_tokens: int, shape: Shape) -> list[int]:
    """Tile heights worth timing: the powers of two around the mean rows per expert (16 minimum)."""
    rows = num_tokens * shape.top_k / shape.num_experts
    if num_tokens * shape.top_k * 4 <= shape.num_experts:
        return [16]  # the naive path: one assignment per block
    cands = [b for b in (16, 32, 64, 128) if rows / 4 <= b <= max(2 * rows, 16)]
    return cands or [128]


def tile_candidates(block_m: int, which: str) -> list[GemmTile]:
    """Tiles for one GEMM at tile height ``block_m``: narrow streaming tiles for short blocks, wide
    tensor-core tiles for tall ones."""
    if block_m <= 16:
        bns = (16, 32, 64) if which == "up" else (32, 64, 128)
        return [GemmTile(bn, bk, 1, 4, st) for bn in bns for bk, st in ((128, 4), (256, 3))]
    if block_m <= 64:
        return [GemmTile(bn, bk, g, w, st) for (bn, bk, g, w, st) in (
            (64, 128, 1, 4, 4), (64, 64, 8, 4, 5), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3), (32, 128, 1, 4, 4),
            (128, 64, 8, 8, 5), (256, 64, 8, 8, 3))]
    # Deeper pipelines too: TMA weight loads hold every stage in shared memory, and a tile that does not
    # fit is shrunk by ``fit_shared_memory`` before it is timed.
    return [GemmTile(bn, bk, g, w, st) for (bn, bk, g, w, st) in (
        (128, 64, 8, 8, 4), (256, 64, 8, 8, 3), (128, 128, 8, 8, 3), (128, 64, 8, 4, 4), (64, 64, 8, 4, 4),
        (128, 64, 8, 8, 5), (256, 64, 8, 8, 4), (128, 64, 4, 8, 4), (64, 128, 8, 4, 4))]


def float_scheme(dtype: torch.dtype) -> TuneScheme:
    """The 16-bit (or float32) path, ``moekit.experts.triton.fused_experts``, on random weights."""
    from moekit.experts.triton import fused_experts

    def call(w, s: CellInputs, config: KernelConfig) -> torch.Tensor:
        return fused_experts(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights, config=config)

    return TuneScheme(
        name=dtype_key(dtype), x_dtype=dtype,
        make_weights=lambda shape, device: make_weights(shape, dtype, device), call=call,
        heuristic=lambda m, s: heuristic_config(m, s.num_experts, s.n, s.k, s.top_k),
        block_ms=block_m_candidates, tiles=tile_candidates,
        file_name=lambda e, n, k, device: config_file_name(e, n, k, dtype, device),
        current=lambda m, s, device: get_config(m, s.num_experts, s.n, s.k, s.top_k, dtype, device),
    )


def scheme_for(dtype: torch.dtype | str) -> TuneScheme:
    """The scheme of a float dtype (a ``torch.dtype`` or its name) or of a quantization scheme name."""
    from moekit.bench.tuning_quant import QUANT_SCHEMES, quant_scheme

    if isinstance(dtype, str) and dtype in FLOAT_DTYPES:
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype_key(dtype) in FLOAT_DTYPES:
        return float_scheme(dtype)
    if dtype in QUANT_SCHEMES:
        return quant_scheme(dtype)
    raise ValueError(f"dtype must be one of {[*FLOAT_DTYPES, *QUANT_SCHEMES]}, got {dtype!r}")


@contextlib.contextmanager
def _compile_only():
    """Inside, every ``BoundLaunch`` call asks Triton to compile its kernel for those arguments
    (``warmup``) and launches nothing. So one pass through a path's real call submits the compiles of
    exactly the kernels, constexprs and pointer specialisations its timed calls will use, without this
    module restating any path's launch arguments. Single-threaded use only (it swaps a class method)."""
    launch = BoundLaunch.__call__

    def warm(self, *pointers) -> None:
        args, kwargs = self.compile_arguments(pointers)  # as the launch will compile (num_warps by name)
        self.kernel.warmup(*args, grid=self.grid, **kwargs)

    BoundLaunch.__call__ = warm
    try:
        yield
    finally:
        BoundLaunch.__call__ = launch


def precompile(calls: list[Callable[[], object]], device: torch.device) -> None:
    """Compile the kernels of ``calls`` (one call per config) together in a thread pool (Triton's
    AsyncCompileMode, Triton >= 3.5) instead of one at a time on first use. A kernel that fails to
    compile, or a Triton without AsyncCompileMode, is left to compile (and fail) when it is timed."""
    if device.type != "cuda" or interpreting():
        return
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True), _compile_only():
        for call in calls:
            with contextlib.suppress(Exception):  # its config is then timed (as inf) like any that fails
                call()


def _timer(shape: Shape, num_tokens: int, scheme: TuneScheme, device: torch.device, weights):
    """``measure(configs) -> µs of each`` for one M: the configs' kernels compiled together, then each
    timed over rotated input sets (CUDA-graph replay up to GRAPH_MAX_M); inf for one that fails."""
    sets = make_sets(shape, num_tokens, 2 if num_tokens > 64 else 4, scheme.x_dtype, device, seed=7)

    def calls(config: KernelConfig) -> list[Callable[[], torch.Tensor]]:
        return [lambda s=s: scheme.call(weights, s, config) for s in sets]

    def one(config: KernelConfig) -> float:
        try:
            return time_calls(calls(config), device, graph=num_tokens <= GRAPH_MAX_M, budget_s=0.08, min_reps=3,
                              max_reps=20)
        except Exception:  # noqa: BLE001  (a config that does not compile or fit: out of the running)
            torch.cuda.synchronize()
            return float("inf")

    def measure(configs: list[KernelConfig]) -> list[float]:
        precompile([calls(c)[0] for c in configs], device)
        return [one(c) for c in configs]

    return measure


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one M."""

    config: KernelConfig  # the fastest config timed; the heuristic default when nothing beat it
    us: float  # its median µs per call
    heuristic_us: float  # the heuristic default's median µs per call, timed in the same search
    failed: int = 0  # configs that failed to compile or run (timed as inf, out of the running)
    timed: int = 0  # configs timed in the search
    current_us: float | None = None  # today's entry's (``TuneScheme.current``) median µs, timed in the search


def tune_one(shape: Shape, num_tokens: int, scheme: TuneScheme, device, weights) -> TuneResult:
    """Search the configs for one M (coordinate descent, see the module docstring). A config is timed
    once; ties keep the one met first (the default, then the stage's starting point)."""
    measure = _timer(shape, num_tokens, scheme, device, weights)
    timed: dict[KernelConfig, float] = {}

    def best_of(configs: list[KernelConfig]) -> tuple[KernelConfig, float]:
        new = [c for c in dict.fromkeys(configs) if c not in timed]
        timed.update(zip(new, measure(new)) if new else ())
        return min(((c, timed[c]) for c in configs), key=lambda p: p[1])  # min keeps the first of equals

    default = scheme.heuristic(num_tokens, shape)
    current = scheme.current(num_tokens, shape, device_key(device)) if scheme.current else None
    heights = scheme.block_ms(num_tokens, shape)
    starts = [default] + ([current] if current is not None else [])
    best, best_us = best_of(starts + [replace(default, BLOCK_M=b) for b in heights])  # ties: the default
    for block_m in heights:
        # the tiles searched plain (a switch may not take every tile), from today's entry at its height
        cfg = tiles_of(current) if current is not None and current.BLOCK_M == block_m else (
            replace(default, BLOCK_M=block_m))
        for which in ("up", "down"):
            cfg, cfg_us = best_of([cfg] + [replace(cfg, **{which: t}) for t in scheme.tiles(block_m, which)])
        if scheme.switches is not None:
            cfg, cfg_us = best_of([cfg] + scheme.switches(num_tokens, shape, cfg))
        if cfg_us < best_us:
            best, best_us = cfg, cfg_us
    return TuneResult(best, best_us, timed[default], sum(math.isinf(us) for us in timed.values()), len(timed),
                      None if current is None else timed[current])


def tune(shape: Shape, batches, dtype: torch.dtype | str = torch.bfloat16, device=None, out_dir: Path | None = None,
         budget_s: float | None = None, progress=None, note: Callable[[str], None] | None = None) -> Path:
    """Tune every M of ``batches`` (resuming a partial run), put the entries into the config file (``_save``: the
    file's other M stay as they were), return its path. ``dtype``: a float dtype (or its name) or a quantization
    scheme (``scheme_for``). With ``budget_s``, no new M is started once that many seconds have passed (at least
    one M is tuned per run); the rest waits for a rerun. The weights are made once, when the first M is tuned.
    ``note``: told, a line per M, where a tuned entry replaces one with switches in what the lookups read, and where
    configs failed to compile or run: their compiler output (Triton prints a failing kernel's IR from C++) goes to
    ``<file>.compile.log`` beside the config file (``compiler_output.stderr_to``), not the console."""
    scheme, device = scheme_for(dtype), torch.device(device or "cuda")
    out_dir = Path(out_dir) if out_dir else default_user_dir()
    dev = device_key(device)
    path = out_dir / scheme.file_name(shape.num_experts, shape.n, shape.k, dev)
    partial = path.with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if partial.exists() else {"configs": {}, "measured": {}}
    todo = [m for m in batches if str(m) not in done["configs"]]
    label = f"tune {shape.name} {scheme.name}"
    task = progress.add_task(label, total=len(batches), completed=len(batches) - len(todo)) if progress else None
    start, weights, log = time.monotonic(), None, path.with_suffix(".compile.log")
    for m in todo:
        weights = scheme.make_weights(shape, device) if weights is None else weights
        with stderr_to(log):
            result = tune_one(shape, m, scheme, device, weights)
        if result.failed and note:
            note(f"M={m}: {result.failed} of {result.timed} configs failed to compile or run (timed as failed, out "
                 f"of the running); their compiler output: {log}")
        done["configs"][str(m)] = result.config.to_dict()
        done["measured"][str(m)] = {"us": round(result.us, 2), "heuristic_us": round(result.heuristic_us, 2)}
        if result.current_us is not None:  # today's entry, where the scheme names it
            done["measured"][str(m)]["current_us"] = round(result.current_us, 2)
        out_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(done, indent=1))
        if progress:
            progress.update(task, advance=1,
                            description=f"{label} M={m}: {result.us:.1f} µs (default {result.heuristic_us:.1f})")
        if budget_s is not None and time.monotonic() - start > budget_s:
            break  # checked after each M, so every run makes progress
    if log.is_file() and not log.stat().st_size:
        log.unlink()  # nothing was printed: no file left beside the configs
    for line in _save(path, shape, scheme.name, dev, done):
        if note:
            note(line)
    if all(str(m) in done["configs"] for m in batches):
        partial.unlink(missing_ok=True)
    return path


def _save(path: Path, shape: Shape, name: str, dev: str, done: dict) -> list[str]:
    """Put the tuned entries of ``done`` into ``path`` (``tuning_merge.merge``: the file's entries of other M stay
    as they were, switches and all). Returns ``switch_notes`` on the entries the lookups read before at the tuned
    M (``path``'s own, else the config directories'): which of them lose switches."""
    if not done["configs"]:
        return []
    tuned = {"E": shape.num_experts, "N": shape.n, "K": shape.k, "dtype": name, "device": dev, **done}
    dropped = dropped_switches(looked_up(path), {int(m): entry for m, entry in done["configs"].items()})
    write_config_data(path, merge(json.loads(path.read_text()) if path.exists() else None, tuned, str(path)).data)
    return switch_notes(dropped)


def check_tuned_file(path: Path) -> str:
    """The name ``path`` gets in the config directories, after checking it: a ValueError unless it is a
    config file whose name is the one its scheme's lookup reads for its own E, N, K, dtype and device,
    and whose entries the scheme's plan accepts."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        e, n, k, dtype, device = (int(data["E"]), int(data["N"]), int(data["K"]), str(data["dtype"]),
                                  str(data["device"]))
        configs = read_configs(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a tuned config file ({type(err).__name__}: {err})") from None
    scheme = scheme_for(dtype)
    expected = scheme.file_name(e, n, k, device)
    if path.name != expected:
        raise ValueError(f"{path.name}: its fields say it must be named {expected}")
    for m, config in configs.items():
        try:
            scheme.validate(config)
        except ValueError as err:
            raise ValueError(f"{path.name}, M={m}: {err}") from None
    return expected


def install(path: Path, packaged_dir: Path | None = None, note: Callable[[str], None] | None = None) -> Path:
    """Merge a finished tuned file (as ``tune`` writes it, e.g. fetched from the GPU machine) into its namesake in
    ``packaged_dir`` (default: the packaged config directory, where every lookup finds it after the user
    directories) per M (``tuning_merge.merge``): its M replace or join the packaged file's, whose other M stay as
    they were. Refused (``check_tuned_file``) before anything is written. ``note``: told which M were added and
    replaced, and which replaced entries had switches. Returns the packaged file's path."""
    target = Path(packaged_dir or PACKAGED_DIR) / check_tuned_file(path)
    tuned = json.loads(Path(path).read_text())
    old = json.loads(target.read_text()) if target.is_file() else None
    merged = merge(old, tuned, str(target))
    dropped = dropped_switches(raw_entries(target) if old else {}, raw_entries(path))
    write_config_data(target, merged.data)
    if note:
        for line in [f"{target.name}: {merged.summary()}", *switch_notes(dropped)]:
            note(line)
    return target
