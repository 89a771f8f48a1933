"""The Gluon contiguous-layout path (``moekit.experts.triton_gluon``) on the device, in < 240 s.

    PYTHONPATH=$PWD python benchmarks/gluon_device_check.py           # JSON to $OUT/gluon.json if $OUT is set
    PYTHONPATH=$PWD python benchmarks/gluon_device_check.py --smoke   # CPU plumbing: twin, combine, fallback
    PYTHONPATH=$PWD python benchmarks/gluon_device_check.py --presets mixtral-8x7b --batches 512 1024 \
        --no-variants --no-graph --deadline-s 100                    # a subset (e.g. below the chooser's M)

Per preset (Qwen3-30B-A3B E=128 N=768 K=2048 k=8, Mixtral-8x7B E=8 N=14336 K=4096 k=2, DeepSeek-V3
E=256 N=2048 K=7168 k=8; ``--presets``) and M in 4096, 16384 (``--batches``), bf16, uniform routing:
  1. correctness: the Gluon path's output against its torch twin (``experts_gluon_twin``: same layout,
     float32 products, h and y rounded like the kernels), rel L2 < 2e-3; and against the float32
     reference of the default ``triton`` backend's output, for scale;
  2. per GEMM (gate-up, down) µs (and tile variants beside the plan's, unless ``--no-variants``), TFLOP/s on the real
     rows (2*A*2N*K, 2*A*N*K) and % of a dense bf16 8192^3 torch.mm measured in this run; permute and combine µs;
  3. a CUDA graph of the Gluon call, replayed with new routing and x, equal to eager (Mixtral M=4096;
     ``--no-graph`` skips it);
  4. whole call: the Gluon path, the default ``triton`` backend (``moekit.experts.run_experts``) and the
     ``triton_gluon`` backend (what its chooser picks), timed in the same run (CUDA events, median).
The table is printed last. Exit 1 when a correctness check fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

T0 = time.perf_counter()
DEADLINE_S = 215.0  # cells not started by then are skipped
PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
BATCHES = (4096, 16384)
TOLERANCE = 2e-3  # rel L2 against the twin (the kernels and the twin round h and y alike)
# Per-GEMM tile variants timed beside the plan's tiles (name, GluonTile fields); a variant that fails to
# compile or run is reported and skipped.
UP_VARIANTS = (("group_m=1", {"group_m": 1}), ("group_m=32", {"group_m": 32}), ("stages=3", {"stages": 3}),
               ("bk=128 stages=2", {"block_k": 128, "stages": 2}))
DOWN_VARIANTS = (("group_m=1", {"group_m": 1}), ("group_m=8", {"group_m": 8}), ("stages=4", {"stages": 4}),
                 ("bk=128 stages=3", {"block_k": 128, "stages": 3}))
VARIANTS: list[str] = []  # printed before the table


@dataclass
class Row:
    shape: str
    tokens: int
    err_twin: float
    err_triton: float  # the default backend against the same twin, for scale
    up_us: float
    up_tflops: float
    up_pct_mm: float
    down_us: float
    down_tflops: float
    down_pct_mm: float
    permute_us: float
    combine_us: float
    gluon_us: float
    triton_us: float
    auto_us: float  # the triton_gluon backend (its chooser)
    chooser_picks_gluon: bool

    @property
    def speedup(self) -> float:
        return self.triton_us / self.gluon_us if self.gluon_us > 0 else 0.0


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def time_us(fn, dev: torch.device, budget_s: float = 0.25) -> float:
    from moekit.bench.timing import time_stats

    return time_stats([fn], dev, budget_s=budget_s, max_reps=20).us


def mm_tflops(dev: torch.device) -> float:
    """Dense bf16 matmul rate, 8192^3 (the bench's ceiling)."""
    n = 8192 if dev.type == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / time_us(lambda: a @ b, dev, 0.5) / 1e6


def cell_shape(preset: str, smoke: bool):
    """The preset's routed experts; in the smoke test N = K = 128 (the smallest the Gluon path takes)."""
    from moekit.bench.cells import Shape

    real = Shape.from_preset(preset)
    return Shape(f"{preset}/smoke", real.num_experts, 128, 128, real.top_k) if smoke else real


def run_cell(preset: str, tokens: int, weights, dev: torch.device, mm: float, smoke: bool,
             variants: bool = True) -> Row:
    from moekit.bench.cells import uniform_routing
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon import (
        DEFAULT_CHOICE, experts_gluon, gluon_layout, experts_gluon_twin, experts_triton_gluon,
    )
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum, launch_gemm, plan_gluon

    shape = cell_shape(preset, smoke)
    w13, w2 = weights.w13, weights.w2
    routing = uniform_routing(tokens, shape, dev, seed=tokens)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(tokens, shape.k, device=dev, dtype=w13.dtype)
    E, N, K, k = shape.num_experts, shape.n, shape.k, shape.top_k
    twin = experts_gluon_twin(x, w13, w2, ids, rw)
    triton_out = run_experts(x, w13, w2, ids, rw, backend="triton")
    err_triton = rel_l2(triton_out, twin)
    pick = DEFAULT_CHOICE.wants(tokens, N, k, E)
    auto = lambda: experts_triton_gluon(x, w13, w2, ids, rw)  # noqa: E731
    if smoke:  # no Gluon on the CPU: the backend must fall back to the triton kernels, bit for bit
        fallback_ok = torch.equal(auto(), triton_out)
        from moekit.layouts.contiguous import combine_contiguous, permute_contiguous

        layout = permute_contiguous(x, ids, E, 128, static_rows=plan_gluon(tokens, k, E, N).rows)
        y = torch.randn(layout.total_rows, K, device=dev, dtype=x.dtype)
        combined = torch.empty_like(x)
        launch_contiguous_sum(y, layout.src_to_dst.contiguous(), rw.contiguous(), combined)
        err_sum = rel_l2(combined, combine_contiguous(y, layout, rw))
        print(f"  smoke {preset} M={tokens}: triton vs twin {err_triton:.2e}; triton_gluon falls back: {fallback_ok}; "
              f"combine kernel vs torch {err_sum:.2e}")
        err = 0.0 if fallback_ok and err_sum < 1e-2 else float("inf")
        return Row(shape.name, tokens, err, err_triton, *([0.0] * 11), pick)
    out = experts_gluon(x, w13, w2, ids, rw)
    err = rel_l2(out, twin)
    del twin, triton_out
    plan = plan_gluon(tokens, k, E, N)
    layout = gluon_layout(x, ids, E)
    used, blocks, rows = layout.rows_used, layout.block_experts, layout.x_perm.shape[0]
    h = x.new_empty(rows, N)
    y = x.new_empty(rows, K)
    w13_2d, w2_2d = w13.view(E * 2 * N, K), w2.view(E * K, N)
    dst, rwc, combined = layout.src_to_dst, rw.contiguous(), torch.empty_like(x)
    up_us = time_us(lambda: launch_gemm(layout.x_perm, w13_2d, h, blocks, used, plan.up, True, 2 * N, N), dev)
    down_us = time_us(lambda: launch_gemm(h, w2_2d, y, blocks, used, plan.down, False, K), dev)
    permute_us = time_us(lambda: gluon_layout(x, ids, E), dev)
    time_variants(f"{shape.name} M={tokens}", dev, () if not variants else (
        ("gate-up", plan.up, up_us, UP_VARIANTS,
         lambda t: launch_gemm(layout.x_perm, w13_2d, h, blocks, used, t, True, 2 * N, N)),
        ("down", plan.down, down_us, DOWN_VARIANTS, lambda t: launch_gemm(h, w2_2d, y, blocks, used, t, False, K))))
    combine_us = time_us(lambda: launch_contiguous_sum(y, dst, rwc, combined), dev)
    assignments = tokens * k
    up_tf = 2 * assignments * 2 * N * K / up_us / 1e6
    down_tf = 2 * assignments * N * K / down_us / 1e6
    gluon_us = time_us(lambda: experts_gluon(x, w13, w2, ids, rw), dev)
    triton_us = time_us(lambda: run_experts(x, w13, w2, ids, rw, backend="triton"), dev)
    auto_us = time_us(auto, dev)
    return Row(shape.name, tokens, err, err_triton, up_us, up_tf, 100 * up_tf / mm, down_us, down_tf,
               100 * down_tf / mm, permute_us, combine_us, gluon_us, triton_us, auto_us, pick)


def graph_check(dev: torch.device) -> bool:
    """The Gluon path captured in a CUDA graph (no host sync inside) and replayed with new routing and
    new x: equal to eager, bit for bit, at Mixtral M=4096."""
    from moekit.bench.cells import make_weights, uniform_routing
    from moekit.experts.triton_gluon import experts_gluon

    shape = cell_shape("mixtral-8x7b", False)
    weights = make_weights(shape, torch.bfloat16, dev)
    first, second = uniform_routing(4096, shape, dev, seed=1), uniform_routing(4096, shape, dev, seed=2)
    x = torch.randn(4096, shape.k, device=dev, dtype=torch.bfloat16)
    ids, rw = first.topk_ids.clone(), first.topk_weights.clone()
    run = lambda: experts_gluon(x, weights.w13, weights.w2, ids, rw)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    ids.copy_(second.topk_ids)
    rw.copy_(second.topk_weights)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, run())


def time_variants(cell: str, dev: torch.device, gemms) -> None:
    """Each GEMM with each tile variant (fields replaced in the plan's tile); one line per GEMM."""
    for gemm, base, base_us, variants, run in gemms:
        timed = []
        for name, fields in variants:
            try:
                timed.append(f"{name} {time_us(lambda: run(replace(base, **fields)), dev):.0f}")
            except Exception as exc:  # noqa: BLE001 (a variant that does not build is reported, not fatal)
                timed.append(f"{name} failed ({type(exc).__name__})")
        VARIANTS.append(f"{cell} {gemm}: plan {base_us:.0f} us; " + "; ".join(timed))


def print_table(rows: list[Row], mm: float) -> None:
    print(f"\nbf16 mm 8192^3: {mm:.0f} TFLOP/s. us = median per call; % = of that mm rate.")
    print("| shape | M | err vs twin | gate-up us (TF/s, % mm) | down us (TF/s, % mm) | permute us | combine us "
          "| gluon call us | triton call us | speed-up | triton_gluon us (picks gluon) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.shape} | {r.tokens} | {r.err_twin:.1e} | {r.up_us:.0f} ({r.up_tflops:.0f}, {r.up_pct_mm:.0f}%) "
              f"| {r.down_us:.0f} ({r.down_tflops:.0f}, {r.down_pct_mm:.0f}%) | {r.permute_us:.0f} | "
              f"{r.combine_us:.0f} | {r.gluon_us:.0f} | {r.triton_us:.0f} | {r.speedup:.2f}x | {r.auto_us:.0f} "
              f"({r.chooser_picks_gluon}) |")


def parse_args():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU plumbing at N = K = 128 (interpreter)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--no-variants", dest="variants", action="store_false", help="skip the per-GEMM tile variants")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph check")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="cells not started by then are skipped")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    smoke = args.smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from moekit.bench.cells import make_weights
    from moekit.experts.triton_gluon_launch import gluon_importable, gluon_supported

    dev = torch.device("cpu" if smoke else "cuda")
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, gluon importable "
          f"{gluon_importable()}, supported on {dev}: {gluon_supported(dev)}", flush=True)
    mm = mm_tflops(dev)
    rows, failed = [], []
    for preset in args.presets:
        if elapsed() > args.deadline_s:
            print(f"skip {preset}: past {args.deadline_s} s")
            continue
        weights = make_weights(cell_shape(preset, smoke), torch.bfloat16, dev)
        for tokens in ((48,) if smoke else args.batches):
            if elapsed() > args.deadline_s:
                print(f"skip {preset} M={tokens}: past {args.deadline_s} s")
                continue
            try:
                row = run_cell(preset, tokens, weights, dev, mm, smoke, args.variants)
            except Exception as exc:  # noqa: BLE001 (report the cell, go on with the rest)
                print(f"FAIL {preset} M={tokens}: {type(exc).__name__}: {exc}", flush=True)
                failed.append(f"{preset} M={tokens}")
                continue
            ok = row.err_twin < TOLERANCE
            print(f"{'PASS' if ok else 'FAIL'} {preset} M={tokens}: err vs twin {row.err_twin:.2e} "
                  f"(triton {row.err_triton:.2e}); gluon {row.gluon_us:.0f} us, triton {row.triton_us:.0f} us "
                  f"[{elapsed():.0f} s]", flush=True)
            if not ok:
                failed.append(f"{preset} M={tokens}")
            rows.append(row)
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not smoke and args.graph:
        try:
            ok = graph_check(dev)
        except Exception as exc:  # noqa: BLE001 (reported as a failure, the table still prints)
            ok = False
            print(f"graph check raised {type(exc).__name__}: {exc}")
        print(f"{'PASS' if ok else 'FAIL'} CUDA graph: captured Gluon call replayed with new routing == eager")
        if not ok:
            failed.append("cuda graph")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gluon.json").write_text(json.dumps(
            {"mm_tflops": mm, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows], "failed": failed}, indent=1))
    print("\nPer-GEMM tile variants (us):", *VARIANTS, sep="\n")
    print_table(rows, mm)
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} ({elapsed():.0f} s)")
    return 1 if failed else 0


def elapsed() -> float:
    return time.perf_counter() - T0


if __name__ == "__main__":
    sys.exit(main())
