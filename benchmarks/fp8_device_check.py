"""GPU check of the fp8 block-scaled Triton experts path (``moekit.experts.triton_fp8``), run on the device.

    PYTHONPATH=. python benchmarks/fp8_device_check.py            # correctness, timings: < 100 s
    PYTHONPATH=. python benchmarks/fp8_device_check.py --configs  # + the config A/B below (~+60 s)
    PYTHONPATH=. python benchmarks/fp8_device_check.py --compile  # + torch.compile(fullgraph=True), inductor

Per preset (Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B routed experts) and M in {1, 8, 64, 512, 4096}:
- correctness on the first input set: the kernels against the torch twin (rel L2 < 2e-2 passes), with
  TMA weight descriptors and with pointer loads (``weight_tma``); against moekit's bf16 Triton path on
  the unquantized weights (the quantization error, ~6% expected);
- timings, CUDA-graph replay over rotated inputs (``moekit.bench.timing``): fp8 with TMA weights and
  with pointer loads (the default is the one ``triton_fp8_plan.TMA_MAX_BLOCK_M`` picks, marked *),
  moekit bf16 Triton; at M = 1 also x quantized inside gate-up;
- the fp8 floor: max(touched experts x (3*N*K fp8 bytes + scales) + x and out bf16 bytes) / copy BW,
  FLOPs / fp8 matmul rate), both ceilings measured here (a 4 GiB device copy; ``torch._scaled_mm`` on
  8192^3 e4m3, skipped if this torch lacks it);
- with ``--configs``, at M in CONFIG_AB_BATCHES, a few alternative configs (tile widths, warps, stages) against the
  heuristic, each with TMA and with pointer weights, and the registers, spills and shared memory of the
  GEMMs it compiled.
Also: a CUDA graph of the fp8 path replayed with new routing equals eager. ``--compile`` checks that
inductor compiles a caller of the op whole (fullgraph) and agrees with eager. Tuned configs come
from ``moekit tune --dtype fp8_block``. Prints one line per check, the tables last; JSON to $OUT/fp8.json if $OUT is
set. Exit 1 on any failure.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moekit.bench.ceilings import measure_fp8_mm
from moekit.bench.cells import PRESETS, Shape, make_sets, make_weights, measured_experts_touched
from moekit.bench.timing import time_calls
from moekit.experts.configs import GemmTile, KernelConfig, device_key
from moekit.experts.triton import experts_triton
from moekit.experts.triton_fp8 import fused_experts_fp8, fused_experts_fp8_launch, fused_experts_fp8_torch
from moekit.experts.triton_fp8_plan import TMA_MAX_BLOCK_M, fp8_entry, heuristic_fp8_config
from moekit.experts.triton_launch import kernels
from bench_run import RunLog

BATCHES = (1, 8, 64, 512, 4096)
BLOCK = (128, 128)
CONFIG_AB_BATCHES = (1, 64, 4096)
BUDGET_S = 0.15  # seconds of timing per backend and cell (the script stays under ~3 min)
ROTATION_BYTES = 256 << 20  # rotate inputs until one pass touches ~4x the H200's L2 (the bench's rule)
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def quantize_blocks(w: torch.Tensor, block=BLOCK, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] -> (q e4m3, scale [E, R/GN, C/G] fp32), scale = block amax / 448; a few experts at a
    time (the float32 copy of DeepSeek-V3's w13 whole would be 30 GB). R, C multiples of the block."""
    (num_experts, rows, cols), (bn, bk) = w.shape, block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(num_experts, rows // bn, cols // bk, dtype=torch.float32, device=w.device)
    for e0 in range(0, num_experts, chunk):
        blocks = w[e0:e0 + chunk].float().view(-1, rows // bn, bn, cols // bk, bk)
        s = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448  # [e, R/GN, C/G]
        scale[e0:e0 + chunk] = s
        q[e0:e0 + chunk] = (blocks / s[:, :, None, :, None]).view(-1, rows, cols).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True)
class Ceilings:
    copy_TBps: float  # read + write, 1e12 bytes/s
    fp8_mm_TFLOPs: float | None  # torch._scaled_mm 8192^3 e4m3 (fast accumulation); None where unavailable
    fp8_mm_precise_TFLOPs: float | None  # the same without fast accumulation


def measure_ceilings(dev) -> Ceilings:
    src = torch.empty(1 << 31, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (time_calls([lambda: dst.copy_(src)], dev, budget_s=0.3) * 1e-6) / 1e12
    del src, dst
    rates = [measure_fp8_mm(dev, 8192, fast_accum=fast) for fast in (True, False)]  # Fp8MmRate(TFLOPs, error)
    for rate in rates:
        if rate.TFLOPs is None:
            print(f"fp8 mm ceiling skipped: {rate.error}", flush=True)
    return Ceilings(copy, *(rate.TFLOPs for rate in rates))


@dataclass
class Row:
    shape: str
    M: int
    touched: float  # mean distinct experts per call over the rotated sets
    fp8_us: float  # the default: heuristic (or tuned) config, TMA or pointer weights by the plan's rule
    tma_us: float  # weight_tma=True
    ptr_us: float  # weight_tma=False
    default_tma: bool  # which of the two the default is
    bf16_us: float
    floor_us: float
    pct_floor: float
    fp8_TFLOPs: float
    pct_fp8_mm: float | None
    err_vs_twin: float
    err_other_vs_twin: float  # the weight loads the default does not use
    err_vs_bf16: float
    speedup_vs_bf16: float
    x_inside_us: float | None  # M=1 A/B: x quantized inside gate-up instead of by its own kernel


@dataclass
class ConfigAB:
    shape: str
    M: int
    config: dict  # KernelConfig.to_dict(); the first of a cell's entries is the heuristic
    tma: bool  # weights through TMA descriptors (else pointer loads)
    us: float | None  # None: it did not compile or run (shared memory)
    kernels: list  # [{name, num_warps, n_regs, n_spills, shared}] of the GEMMs this config compiled


def floor_us(s: Shape, m: int, touched: float, c: Ceilings) -> float:
    (bn, bk), n, k = BLOCK, s.n, s.k
    scale_bytes = 4 * (math.ceil(2 * n / bn) * math.ceil(k / bk) + math.ceil(k / bn) * math.ceil(n / bk))
    nbytes = touched * (3 * n * k + scale_bytes) + 2 * m * k * 2  # fp8 weights + scales; x and out bf16
    flops = 6 * n * k * m * s.top_k
    mm = flops / (c.fp8_mm_TFLOPs * 1e12) if c.fp8_mm_TFLOPs else 0.0
    return max(nbytes / (c.copy_TBps * 1e12), mm) * 1e6


def run_cell(s: Shape, m: int, w, q, c: Ceilings, dev) -> Row:
    touched_once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
    sets = make_sets(s, m, max(2, min(8, math.ceil(ROTATION_BYTES / touched_once))), torch.bfloat16, dev)
    touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
    first = sets[0]
    entry = fp8_entry(m, s.num_experts, s.n, s.k, s.top_k, BLOCK[1], device_key(dev))  # tuned file or heuristic
    default_tma = entry.config.BLOCK_M <= TMA_MAX_BLOCK_M if entry.weight_tma is None else entry.weight_tma
    out = fused_experts_fp8(first.x, *q, first.topk_ids, first.topk_weights)
    other = fused_experts_fp8_launch(first.x, *q, first.topk_ids, first.topk_weights, weight_tma=not default_tma)
    twin = fused_experts_fp8_torch(first.x, *q, first.topk_ids, first.topk_weights)
    bf16 = experts_triton(first.x, w.w13, w.w2, first.topk_ids, first.topk_weights)
    err_twin, err_other, err_bf16 = rel_l2(out, twin), rel_l2(other, twin), rel_l2(out, bf16)
    check(f"fp8 kernels vs twin {s.name} M={m}", err_twin < 2e-2, f"rel_l2={err_twin:.2e} (vs bf16 {err_bf16:.3f})")
    check(f"fp8 kernels, {'pointer' if default_tma else 'TMA'} weights, vs twin {s.name} M={m}", err_other < 2e-2,
          f"rel_l2={err_other:.2e}")

    def timed(fn) -> float:
        return time_calls([lambda t=t: fn(t) for t in sets], dev, graph=True, budget_s=BUDGET_S)

    fp8_us = timed(lambda t: fused_experts_fp8(t.x, *q, t.topk_ids, t.topk_weights))
    other_us = timed(lambda t: fused_experts_fp8_launch(t.x, *q, t.topk_ids, t.topk_weights,
                                                        weight_tma=not default_tma))
    bf16_us = timed(lambda t: experts_triton(t.x, w.w13, w.w2, t.topk_ids, t.topk_weights))
    x_inside_us = None
    if m == 1:
        x_inside_us = timed(lambda t: fused_experts_fp8_launch(t.x, *q, t.topk_ids, t.topk_weights, x_in_gate_up=True))
    fl = floor_us(s, m, touched, c)
    tflops = 6 * s.n * s.k * m * s.top_k / (fp8_us * 1e-6) / 1e12
    tma_us, ptr_us = (fp8_us, other_us) if default_tma else (other_us, fp8_us)
    return Row(s.name, m, touched, fp8_us, tma_us, ptr_us, default_tma, bf16_us, fl, 100 * fl / fp8_us, tflops,
               100 * tflops / c.fp8_mm_TFLOPs if c.fp8_mm_TFLOPs else None, err_twin, err_other, err_bf16,
               bf16_us / fp8_us, x_inside_us)


def forget_compiled_gemms() -> None:
    """Drop the fp8 GEMMs' in-memory kernel caches, so the next config's kernels are compiled (from
    Triton's disk cache where it has them) and show up in ``compiled_gemms`` as new."""
    for name in ("gate_up_fp8_kernel", "down_fp8_kernel"):
        caches = getattr(getattr(kernels("gemm_fp8"), name), "device_caches", None)
        if caches is not None:
            caches.clear()


def compiled_gemms() -> dict[int, dict]:
    """id -> {name, num_warps, n_regs, n_spills, shared} of every compiled fp8 GEMM so far ({} where this
    Triton keeps its cache elsewhere)."""
    found = {}
    for name in ("gate_up_fp8_kernel", "down_fp8_kernel"):
        try:
            for per_device in getattr(kernels("gemm_fp8"), name).device_caches.values():
                for k in per_device[0].values():
                    found[id(k)] = dict(name=name, num_warps=getattr(k.metadata, "num_warps", None),
                                        n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                                        shared=getattr(k.metadata, "shared", None))
        except (AttributeError, IndexError, TypeError, KeyError):
            pass
    return found


def ab_candidates(m: int, s: Shape) -> list[KernelConfig]:
    """The heuristic first, then alternatives around it (the last run's winners and near misses). Decode
    (under 16 rows per expert): 64-wide tiles on 6 stages (Qwen3's best at M=1), 5 stages. Prefill: a
    256-wide down tile, the down GEMM on 4 warps. (A barrier between the gate fold and the up dot, to
    let 128-row tiles run without spills, measured slower in every cell and was removed:
    ``benchmarks/results/raw/NVIDIA_H200-2026-12-01-1b5da85-fp8_device_check.log``.)"""
    heuristic = heuristic_fp8_config(m, s.num_experts, s.n, s.k, s.top_k)
    if heuristic.BLOCK_M == 16:
        tile = lambda n, stages: GemmTile(n, 128, 1, 4, stages)  # noqa: E731
        others = [KernelConfig(16, tile(64, 6), tile(64, 6)), KernelConfig(16, tile(128, 5), tile(128, 5))]
    else:
        tile = lambda n, warps, stages: GemmTile(n, 128, 8, warps, stages)  # noqa: E731
        others = [KernelConfig(64, tile(128, 8, 4), tile(256, 8, 3)),
                  KernelConfig(64, tile(128, 8, 4), tile(128, 4, 4))]
    return [heuristic, *others]


def config_ab(s: Shape, m: int, q, dev) -> list[ConfigAB]:
    """Each of ``ab_candidates`` on the cell's inputs, TMA and pointer weights, with what its GEMMs compiled to."""
    sets = make_sets(s, m, 2, torch.bfloat16, dev, seed=5)
    rows = []
    for config in ab_candidates(m, s):
        for tma in (True, False):
            forget_compiled_gemms()
            calls = [lambda t=t, tma=tma: fused_experts_fp8_launch(t.x, *q, t.topk_ids, t.topk_weights, config=config,
                                                                    weight_tma=tma)
                     for t in sets]
            try:
                us = time_calls(calls, dev, graph=True, budget_s=0.05, max_reps=10)
            except Exception as e:  # noqa: BLE001  (a tile too big for shared memory: reported, not fatal)
                print(f"  config A/B {s.name} M={m} {config} tma={tma}: {type(e).__name__}: {e}"[:300], flush=True)
                us = None
            rows.append(ConfigAB(s.name, m, config.to_dict(), tma, us,
                                 list(compiled_gemms().values())))
    return rows


def graph_replay(s: Shape, q, dev) -> None:
    """Capture once, replay with new tokens and routing: equal to eager (no host sync, no stale sizes)."""
    sets = make_sets(s, 64, 3, torch.bfloat16, dev, seed=7)
    x, ids, weights = (t.clone() for t in (sets[0].x, sets[0].topk_ids, sets[0].topk_weights))
    fused_experts_fp8(x, *q, ids, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_fp8(x, *q, ids, weights)
    worst = 0.0
    for t in sets[1:]:
        x.copy_(t.x), ids.copy_(t.topk_ids), weights.copy_(t.topk_weights)
        graph.replay()
        worst = max(worst, rel_l2(out, fused_experts_fp8(x, *q, ids, weights)))
    check(f"cuda graph replay with new routing {s.name} M=64", worst < 1e-6, f"max rel diff vs eager {worst:.1e}")


def compiled(s: Shape, q, dev) -> None:
    """torch.compile(fullgraph=True) (inductor) around the op: one graph, the same result as eager."""
    t = make_sets(s, 16, 1, torch.bfloat16, dev, seed=11)[0]
    fn = torch.compile(lambda x, ids, w: fused_experts_fp8(x, *q, ids, w) * 2, fullgraph=True)
    e = rel_l2(fn(t.x, t.topk_ids, t.topk_weights), fused_experts_fp8(t.x, *q, t.topk_ids, t.topk_weights) * 2)
    check(f"torch.compile(fullgraph=True) {s.name} M=16", e < 1e-6, f"rel diff vs eager {e:.1e}")


def guarded(name: str, fn, *args):
    """fn(*args); an exception is a failed check (with its traceback), and the run goes on."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        check(name, False, "raised")
        return None


def print_table(rows: list[Row], abs_: list[ConfigAB], c: Ceilings) -> None:
    mm = f"{c.fp8_mm_TFLOPs:.0f}" if c.fp8_mm_TFLOPs else "n/a"
    print("\nconfig A/B (the first two lines of a cell: the heuristic, TMA and pointer weights; kernels: "
          "regs/spills/shared KiB)")
    for r in abs_:
        us = f"{r.us:10.1f}" if r.us is not None else f"{'failed':>10}"
        res = " ".join(f"{k['name'][:4]}:{k['n_regs']}/{k['n_spills']}/{(k['shared'] or 0) >> 10}" for k in r.kernels)
        up, down = r.config["up"], r.config["down"]
        print(f"{r.shape:<14}{r.M:>6}{us} {'tma' if r.tma else 'ptr'}  BM={r.config['BLOCK_M']} up {up['BLOCK_N']}/"
              f"{up['num_warps']}w/{up['num_stages']}s down "
              f"{down['BLOCK_N']}/{down['num_warps']}w/{down['num_stages']}s  {res}")
    for r in rows:
        if r.x_inside_us is not None:
            print(f"{r.shape} M={r.M}: x quantized by its own kernel {r.fp8_us:.1f} us, inside gate-up "
                  f"{r.x_inside_us:.1f} us")
    print(f"\ncopy {c.copy_TBps:.2f} TB/s, fp8 mm {mm} TFLOP/s (precise accumulation: {c.fp8_mm_precise_TFLOPs})")
    print("fp8 us: the default, which is the starred one of tma us / ptr us")
    print(f"{'shape':<14}{'M':>6}{'touched':>8}{'fp8 us':>10}{'tma us':>10}{'ptr us':>10}{'bf16 us':>10}"
          f"{'floor us':>10}{'%floor':>8}{'TFLOP/s':>9}{'%fp8mm':>8}{'fp8/bf16':>9}{'err twin':>10}{'err bf16':>9}")
    for r in rows:
        pct_mm = f"{r.pct_fp8_mm:.0f}" if r.pct_fp8_mm is not None else "-"
        tma, ptr = ((f"{r.tma_us:.1f}*", f"{r.ptr_us:.1f} ") if r.default_tma
                    else (f"{r.tma_us:.1f} ", f"{r.ptr_us:.1f}*"))
        print(f"{r.shape:<14}{r.M:>6}{r.touched:>8.1f}{r.fp8_us:>10.1f}{tma:>10}{ptr:>10}{r.bf16_us:>10.1f}"
              f"{r.floor_us:>10.1f}{r.pct_floor:>8.0f}{r.fp8_TFLOPs:>9.0f}{pct_mm:>8}{r.speedup_vs_bf16:>8.2f}x"
              f"{r.err_vs_twin:>10.1e}{r.err_vs_bf16:>9.3f}")


def main() -> int:
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the twin's float32 GEMMs stay float32
    import triton

    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    ceilings = measure_ceilings(dev)
    rows, abs_ = [], []
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        w = make_weights(s, torch.bfloat16, dev)
        q = (*quantize_blocks(w.w13), *quantize_blocks(w.w2))
        rows += [r for m in BATCHES if (r := guarded(f"cell {preset} M={m}", run_cell, s, m, w, q, ceilings, dev))]
        for m in CONFIG_AB_BATCHES if "--configs" in sys.argv else ():
            abs_ += guarded(f"config A/B {preset} M={m}", config_ab, s, m, q, dev) or []
        if preset == PRESETS[0]:
            guarded("graph replay", graph_replay, s, q, dev)
            if "--compile" in sys.argv:
                guarded("compile", compiled, s, q, dev)
        del w, q
        torch.cuda.empty_cache()
    print_table(rows, abs_, ceilings)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "ceilings": asdict(ceilings), "cells": [asdict(r) for r in rows],
                  "config_ab": [asdict(r) for r in abs_], "failed": FAILED}
        (out_dir / "fp8.json").write_text(json.dumps(result, indent=1) + "\n")
    print("FAILED:", FAILED if FAILED else "none", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
