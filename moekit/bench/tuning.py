"""The kernel-config tuner behind ``moekit tune``: times candidate launch configs of the Triton experts
path on this GPU and writes a config file that ``moekit.experts.configs`` picks up with no code change.

Search, per batch size M (coordinate descent, so the cost is a sum, not a product, of the choices):
for each candidate BLOCK_M near the mean rows per expert, try the gate-up tiles with the down tile
fixed, keep the best, then the down tiles; keep the best BLOCK_M. The heuristic default is timed too,
and both times are stored beside the entry (``measured``), so the default's shortfall is on record.

Resumable: each finished M is written to ``<file>.partial.json`` at once; a rerun skips those M.
An existing file keeps its entries for the M not tuned in this run (``--batches`` retunes a few).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moekit.bench.cells import GPU_BATCHES, Shape, make_sets, make_weights
from moekit.bench.run import GRAPH_MAX_M
from moekit.bench.timing import time_calls
from moekit.experts.configs import (
    GemmTile, KernelConfig, config_file_name, default_user_dir, device_key, heuristic_config, write_configs,
)

TUNE_BATCHES = GPU_BATCHES  # tuned at the M values the bench times


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


def _timer(shape: Shape, num_tokens: int, dtype, device):
    from moekit.experts.triton import fused_experts

    weights = make_weights(shape, dtype, device)
    w13, w2 = weights.w13, weights.w2
    sets = make_sets(shape, num_tokens, 2 if num_tokens > 64 else 4, dtype, device, seed=7)

    def measure(cfg: KernelConfig) -> float:
        calls = [lambda s=s: fused_experts(s.x, w13, w2, s.topk_ids, s.topk_weights, config=cfg) for s in sets]
        try:
            return time_calls(calls, device, graph=num_tokens <= GRAPH_MAX_M, budget_s=0.08, min_reps=3, max_reps=20)
        except Exception:  # noqa: BLE001  (a config that does not compile or fit: out of the running)
            torch.cuda.synchronize()
            return float("inf")

    return measure


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one M."""

    config: KernelConfig  # the fastest config timed; the heuristic default when nothing beat it
    us: float  # its median µs per call
    heuristic_us: float  # the heuristic default's median µs per call, timed in the same search


def tune_one(shape: Shape, num_tokens: int, dtype, device) -> TuneResult:
    """Search the configs for one M (coordinate descent, see the module docstring)."""
    measure = _timer(shape, num_tokens, dtype, device)
    default = heuristic_config(num_tokens, shape.num_experts, shape.n, shape.k, shape.top_k)
    default_us = measure(default)
    best, best_us = default, default_us
    for block_m in block_m_candidates(num_tokens, shape):
        cfg = replace(default, BLOCK_M=block_m)
        cfg_us = measure(cfg)
        for which in ("up", "down"):
            for tile in tile_candidates(block_m, which):
                cand = replace(cfg, **{which: tile})
                if cand == cfg:
                    continue
                us = measure(cand)
                if us < cfg_us:
                    cfg, cfg_us = cand, us
        if cfg_us < best_us:
            best, best_us = cfg, cfg_us
    return TuneResult(best, best_us, default_us)


def tune(shape: Shape, batches, dtype=torch.bfloat16, device=None, out_dir: Path | None = None,
         budget_s: float | None = None, progress=None) -> Path:
    """Tune every M of ``batches`` (resuming a partial run), write the config file, return its path.
    With ``budget_s``, no new M is started once that many seconds have passed (at least one M is
    tuned per run); the rest waits for a rerun."""
    device = torch.device(device or "cuda")
    out_dir = Path(out_dir) if out_dir else default_user_dir()
    dev = device_key(device)
    path = out_dir / config_file_name(shape.num_experts, shape.n, shape.k, dtype, dev)
    partial = path.with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if partial.exists() else {"configs": {}, "measured": {}}
    todo = [m for m in batches if str(m) not in done["configs"]]
    task = progress.add_task(f"tune {shape.name}", total=len(batches), completed=len(batches) - len(todo)) if progress else None
    start = time.monotonic()
    for m in todo:
        result = tune_one(shape, m, dtype, device)
        done["configs"][str(m)] = result.config.to_dict()
        done["measured"][str(m)] = {"us": round(result.us, 2), "heuristic_us": round(result.heuristic_us, 2)}
        out_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(done, indent=1))
        if progress:
            progress.update(task, advance=1,
                            description=f"tune {shape.name} M={m}: {result.us:.1f} µs (default {result.heuristic_us:.1f})")
        if budget_s is not None and time.monotonic() - start > budget_s:
            break  # checked after each M, so every run makes progress
    configs = {int(m): KernelConfig.from_dict(c) for m, c in done["configs"].items()}
    if not configs:
        return path
    measured = {int(m): v for m, v in done["measured"].items()}
    if path.exists():  # entries of M not tuned in this run stay as they were
        old = json.loads(path.read_text())
        configs = {**{int(m): KernelConfig.from_dict(c) for m, c in old["configs"].items()}, **configs}
        measured = {**{int(m): v for m, v in old.get("measured", {}).items()}, **measured}
    write_configs(path, shape.num_experts, shape.n, shape.k, dtype, dev, configs, measured=measured)
    if all(str(m) in done["configs"] for m in batches):
        partial.unlink()
    return path
