"""The Gluon paths' lean launch (``moekit.experts.triton_gluon_lean``; issue 13: host <= 40 µs per experts call,
issue 15: the fp8 Gluon path's host cost), on the device: outputs and host / eager / graph µs, old against new.

    PYTHONPATH=$PWD OUT=/tmp/gl python benchmarks/gluon_lean_device_check.py [--budget-s 120]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gluon_lean_device_check.py --smoke   (CPU: checks the script)

Per cell (bf16, then fp8_block; Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B; M = 4096 first, then 16384; uniform
routing, no_grad; fp8 weights ``fp8_device_check.quantize_blocks`` of the bf16 ones), each variant:
  old       ``experts_gluon(..., lean=False)`` / ``experts_gluon_fp8(..., lean=False)``: the plain launches (the
            alignment's custom op, fresh buffers, six descriptors, ``kernel[grid](...)`` per launch)
  new       the same with ``lean=True`` (the default): kept plan, weight descriptors, workspace, recorded launches
  backend   what a user's call runs: ``experts_triton_gluon`` on bf16 weights (its ``GluonChoice`` may send the
            cell to the Triton kernels: ``path`` says which), ``experts_triton_unchecked`` on ``Fp8BlockWeight``s
            (what ``MoE`` and ``call_backend`` call after their check; its ``Fp8GluonChoice`` decides); both with
            their fast path for a repeated call; and ``triton_fp8``: the Triton fp8 kernels on the same call
per variant: host µs per call (20 back-to-back eager calls, ``time.perf_counter`` around the issue loop, before
the one sync; median of 5), eager µs per call (the same loop with its sync), graph-replay µs (16-call CUDA
graph, ``moekit.bench.timing``), ``same`` (new's output bit-equal to old's; backend's too where it took the Gluon
path; ``/g``: a CUDA graph of one call, replayed, wrote the eager output bit for bit, ``/G!`` where not) and rel L2
against the torch twin (``experts_gluon_twin`` / ``experts_gluon_fp8_twin``; < 1e-2 bf16, < 2e-2 fp8); under
each cell the lean call's host µs step by step (``probe_steps``). Last, budget permitting, fp8 cells at M = 1024
(``--extra-fp8-batches``: where ``Fp8GluonChoice`` is open). Cells run until --budget-s; --hard-limit-s stops at
once. JSON to $OUT/gluon_lean.json, table last (look for: every ``same`` yes/g, every rel below its bound; new
host <= 40 µs; eager new <= eager old; graph new = graph old; fp8: new against triton_fp8, eager and graph).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import host_align_device_check as ha
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.bench.timing import time_calls, time_eager

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (4096, 16384)
DTYPES = ("bf16", "fp8_block")
BOUND = {"bf16": 1e-2, "fp8_block": 2e-2}


class Run:
    device = torch.device("cuda")
    calls, repeats, smoke = 20, 5, False


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def smoke_shape(name: str) -> Shape:
    """The preset's k with E <= 8 and N = 128, K = 256 (multiples of the tiles; the interpreter is slow)."""
    s = Shape.from_preset(name)
    return Shape(f"{name}/smoke", min(s.num_experts, 8), 128, 256, min(s.top_k, 4))


def variants(dtype: str, w13, w2, q) -> dict:
    """name -> fn(x, ids, weights); the twin last."""
    from moekit.experts.triton import experts_triton_unchecked
    from moekit.experts.triton_gluon import experts_gluon, experts_gluon_twin, experts_triton_gluon

    if dtype == "bf16":
        return {
            "old": lambda x, i, w: experts_gluon(x, w13, w2, i, w, lean=False),
            "new": lambda x, i, w: experts_gluon(x, w13, w2, i, w),
            "backend": lambda x, i, w: experts_triton_gluon(x, w13, w2, i, w),
            "twin": lambda x, i, w: experts_gluon_twin(x, w13, w2, i, w),
        }
    from moekit.experts.triton_fp8 import fused_experts_fp8
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, experts_gluon_fp8_twin
    from moekit.quant.fp8_block import Fp8BlockWeight

    q13, s13, q2, s2 = q
    qw13, qw2 = (Fp8BlockWeight(q=q13, scale=s13, dtype=torch.bfloat16),
                 Fp8BlockWeight(q=q2, scale=s2, dtype=torch.bfloat16))
    return {
        "old": lambda x, i, w: experts_gluon_fp8(x, q13, s13, q2, s2, i, w, lean=False),
        "new": lambda x, i, w: experts_gluon_fp8(x, q13, s13, q2, s2, i, w),
        "backend": lambda x, i, w: experts_triton_unchecked(x, qw13, qw2, i, w),
        "triton_fp8": lambda x, i, w: fused_experts_fp8(x, q13, s13, q2, s2, i, w),
        "twin": lambda x, i, w: experts_gluon_fp8_twin(x, q13, s13, q2, s2, i, w),
    }


def backend_path(dtype: str, shape: Shape, m: int) -> str:
    """Which path the backend row's call takes (by the choices' own rules)."""
    if dtype == "bf16":
        from moekit.experts.triton_gluon import DEFAULT_CHOICE

        return "gluon" if DEFAULT_CHOICE.wants(m, shape.n, shape.top_k, shape.num_experts) else "triton"
    from moekit.experts.triton_gluon_fp8 import DEFAULT_FP8_CHOICE

    return "gluon" if DEFAULT_FP8_CHOICE.wants(m, shape.top_k, shape.n, shape.k, shape.num_experts) else "triton"


def cell(dtype: str, shape: Shape, m: int, w13, w2, q) -> dict:
    routing = uniform_routing(m, shape, Run.device, seed=m)
    x = torch.randn(m, shape.k, device=Run.device, dtype=torch.bfloat16, generator=torch.Generator(
        device=Run.device).manual_seed(m + 1))
    args = (x, routing.topk_ids, routing.topk_weights)
    fns = variants(dtype, w13, w2, q)
    twin = fns.pop("twin")(*args)
    outs = {name: fn(*args) for name, fn in fns.items()}
    path = backend_path(dtype, shape, m)
    row = {"M": m, "backend_path": path, "rows": {}}
    for name, fn in fns.items():
        call = lambda fn=fn: fn(*args)  # noqa: E731
        eager = time_eager([call], Run.device, calls=Run.calls, repeats=Run.repeats)
        graph = time_calls([call] * 16, Run.device, graph=True) if Run.device.type == "cuda" else float("nan")
        same = (torch.equal(outs[name], outs["old"])
                if name in ("new", "old") or (name == "backend" and path == "gluon") else None)
        row["rows"][name] = {"host_us": eager.host_us, "eager_us": eager.eager_us, "eager_spread_pct": eager.spread_pct,
                             "graph_us": graph, "same": same,
                             "rel_vs_twin": rel_l2(outs[name], twin),
                             "graph_same": graph_equals_eager(call, outs[name])}
    row["steps_us"] = probe_steps(dtype, args, w13, w2, q, backend=lambda: fns["backend"](*args))
    row["ok"] = all(r["same"] is not False and r["graph_same"] is not False and r["rel_vs_twin"] < BOUND[dtype]
                    for r in row["rows"].values())
    return row


def graph_equals_eager(call, eager_out: torch.Tensor) -> bool | None:
    """Whether a CUDA graph of one call, replayed, writes the eager call's output bit for bit (None off CUDA)."""
    if Run.device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture asks
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, eager_out)


def _per_call_us(fn, reps: int) -> float:
    """Host µs per call of ``fn`` repeated ``reps`` times back to back (a sync before, none inside)."""
    if Run.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def probe_steps(dtype: str, args: tuple, w13, w2, q, backend) -> dict:
    """Where the lean call's host µs go: each step of ``run_lean`` repeated alone (the launches too, with the
    call's own tensors), next to the whole call, the fit checks ``experts_gluon`` runs before it, and the backend's
    call (its fast path where the cell takes the Gluon path: no checks, no lookups)."""
    import moekit.experts.triton_gluon_lean as lean
    from moekit.experts.triton_gluon import experts_gluon, gluon_unfit
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, gluon_fp8_unfit
    from moekit.experts.triton_gluon_launch import gluon_supported, plan_gluon

    x, ids, weights = args
    reps = 50 if Run.device.type == "cuda" else 2
    if dtype == "bf16":
        a, b, s13, s2 = w13, w2, None, None
        whole = lambda: experts_gluon(x, w13, w2, ids, weights)  # noqa: E731
        checks = lambda: (gluon_supported(x.device), gluon_unfit(x, w13, w2))  # noqa: E731
    else:
        a, s13, b, s2 = q
        whole = lambda: experts_gluon_fp8(x, *q, ids, weights)  # noqa: E731
        checks = lambda: (gluon_supported(x.device), gluon_fp8_unfit(x, *q))  # noqa: E731
    tiles = plan_gluon(x.shape[0], ids.shape[1], b.shape[0], b.shape[2]) if dtype == "bf16" else None
    whole()
    plan = lean.plan_for(x, a, b, ids, weights, None, *((tiles.up, tiles.down) if tiles else _fp8_tiles()), s13, s2)
    pair = lean._DESCRIPTORS.get(a, b, plan.weight_key, lean.weight_pair)
    views = lean._WORKSPACES.pooled(plan.workspace, x.device)
    sequence = lean._sequence(plan, views, pair, a, False, s13, s2)
    values = (x, ids, weights, torch.empty_like(x), None, None, None, s13, s2, None, None)
    steps = {
        "checks": lambda: checks(),
        "plan": lambda: lean.plan_for(x, a, b, ids, weights, None, *((tiles.up, tiles.down) if tiles else _fp8_tiles()),
                                      s13, s2),
        "out": lambda: torch.empty_like(x),
        "weight_desc": lambda: lean._DESCRIPTORS.get(a, b, plan.weight_key, lean.weight_pair),
        "pool": lambda: lean._WORKSPACES.pooled(plan.workspace, x.device),
        "sequence": lambda: lean._sequence(plan, views, pair, a, False, s13, s2),
        "fill_saved": lambda: views["dst"].fill_(-1),  # what the plain path's dst fill costs (the lean one has none)
        "launches": (lambda: sequence.launch(values)) if sequence is not None else None,
        "whole": whole,
        "backend": backend,
    }
    out = {name: (_per_call_us(fn, reps) if fn is not None else None) for name, fn in steps.items()}
    out["launch_count"] = None if sequence is None else len(sequence.steps)
    out["raw_launches"] = None if sequence is None else sum(bool(step[3]) for step in sequence.steps)
    return out


def _fp8_tiles() -> tuple:
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

    return UP_TILE, DOWN_TILE


def measure_cells(a, start: float, results: dict) -> None:
    from moekit.experts.triton import clear_launch_caches

    for dtype, batches in [(d, a.batches) for d in a.dtypes] + [("fp8_block", a.extra_fp8_batches)]:
        for preset in a.presets if batches else ():
            shape = smoke_shape(preset) if Run.smoke else Shape.from_preset(preset)
            if time.perf_counter() - start > a.budget_s:
                for m in batches:
                    results[f"{dtype} {preset} M={m}"] = {"skipped": f"time budget ({a.budget_s:.0f} s) spent"}
                continue
            weights = make_weights(shape, torch.bfloat16, Run.device)
            q = None
            if dtype == "fp8_block":
                from fp8_device_check import quantize_blocks

                q = (*quantize_blocks(weights.w13), *quantize_blocks(weights.w2))
                weights = None
            with torch.no_grad():
                for m in batches:
                    ha.budgeted_cell(results, f"{dtype} {preset} M={m}", start, a.budget_s,
                                     lambda: cell(dtype, shape, m, weights and weights.w13, weights and weights.w2, q))
            del weights, q
            clear_launch_caches()  # the kept workspaces (GBs at M = 16384) go with the preset
            if Run.device.type == "cuda":
                torch.cuda.empty_cache()


def table(results: dict) -> str:
    head = f"{'cell':<34} {'variant':<10} {'host':>8} {'eager':>9} {'graph':>9} {'same':>7} {'rel':>8}"
    lines = ["gluon lean: µs per call (host = issue time of back-to-back eager calls)", head]
    for key, row in results.items():
        if "rows" not in row:
            lines.append(f"{key:<34} {next(iter(row.values()))}")
            continue
        for name, r in row["rows"].items():
            label = f"{key} ({row['backend_path']})" if name == "backend" else key
            same = "-" if r["same"] is None else ("yes" if r["same"] else "NO")
            same += "" if r["graph_same"] is None else ("/g" if r["graph_same"] else "/G!")
            lines.append(f"{label:<34} {name:<10} {r['host_us']:8.1f} {r['eager_us']:9.1f} {r['graph_us']:9.1f} "
                         f"{same:>7} {r['rel_vs_twin']:8.1e}")
        steps = row.get("steps_us") or {}
        lines.append(f"{'':<34} steps µs: " + " ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in steps.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=140, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--extra-fp8-batches", nargs="*", type=int, default=[1024],
                   help="fp8 cells after the rest (Fp8GluonChoice's open cells)")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:  # the Gluon GEMMs do not run in the interpreter: the tests' torch stand-ins take their launches
        os.environ["TRITON_INTERPRET"] = "1"
        Run.device, Run.calls, Run.repeats, Run.smoke = torch.device("cpu"), 2, 1, True
        a.batches, a.extra_fp8_batches = [a.batches[0] // 64], []  # one M: the interpreter takes a minute a cell
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from _gluon_fakes import install_fakes

        install_fakes()
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(os.environ.get("OUT", "gluon_lean_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "gluon_lean.json", lambda results: measure_cells(a, start, results),
                           table)


if __name__ == "__main__":
    main()
