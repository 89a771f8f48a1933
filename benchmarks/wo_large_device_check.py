"""Weight-only experts at large batches on the device (issue #16's M >= 1024 target: no weight-only cell
slower than 0.9x moekit's bf16 cell, i.e. wo µs <= bf16 µs / 0.9 = 1.11x): the fused decode against the
scratch decode (``moekit.experts.triton_wo_scratch``: dequantize to a bf16 scratch, then the bf16 GEMMs)
against moekit's bf16 Triton path, and which one the chooser (``triton_wo_plan.choose_decode``,
``SCRATCH_MIN_TOKENS``) takes.

    PYTHONPATH=$PWD python benchmarks/wo_large_device_check.py        # JSON to $OUT/wo_large.json if OUT is set
    PYTHONPATH=$PWD python benchmarks/wo_large_device_check.py --smoke  # CPU: Triton's interpreter, tiny shapes
    PYTHONPATH=$PWD python benchmarks/wo_large_device_check.py --presets deepseek-v3  # the chooser's scratch
        there is unmeasured (8 chunks of 36 experts at SCRATCH_MAX_BYTES); its own run, not in the 240 s

Cells: Qwen3-30B-A3B (E=128 N=768 K=2048 k=8) and Mixtral-8x7B (E=8 N=14336 K=4096 k=2) x int4_w4a16
(group 128, zero points), int8_w8a16, mxfp4 x M in {1024, 4096, 16384}. The weights are random bf16
quantized by ``moekit.quant.quantize``; x and routing as ``moekit bench`` makes them (uniform top-k).
Correctness: each decode's bf16 output on the device against the ``reference`` backend on the same
quantized weights (exact dequantization, float32 loop), rel L2 < TOL. Timing: ``triton.testing.do_bench``
(median, eager calls); the fused decode is the chooser's below the scratch (``choose_decode(...,
fused=True)``); "overlap" is the scratch decode with its dequants on a side stream, each hidden behind
the GEMM before it (``triton_wo_scratch.SCRATCH_OVERLAP``, off by default until this measures it);
"deq" is the scratch path's two dequant launches alone (w13 and w2 of every expert).
Also: a CUDA graph of the scratch decode replayed on new routing (equal to eager); the dequant kernel
alone under a few tiles (SWEEP_TILES, Mixtral int4: µs and GB/s of packed read + bf16 write), to pick
``DEQUANT_TILE``; the scratch path in chunks of CHUNK_EXPERTS experts on that cell at the largest M,
against the reference and timed. Prints one line per cell, the table last (x bf16 = µs / bf16 µs; the
pick's ratio decides the target); under 240 s on an H200 (no cell starts after DEADLINE_S; the rest
print as skipped).
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before any kernel module is imported: Triton decides at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402

from moekit.bench.cells import Shape, make_sets  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_wo import WoWeight, fused_experts_wo  # noqa: E402
from moekit.experts.triton_wo_plan import SCHEME_IDS, choose_decode, weight_args  # noqa: E402
from moekit.experts.triton_wo_scratch import (  # noqa: E402
    DEQUANT_TILE, SCRATCH_MIN_TOKENS, dequantize_experts, run_experts_wo_scratch, scratch_bytes_per_expert,
)
from moekit.quant import quantize  # noqa: E402
from wo_device_check import (  # noqa: E402  (benchmarks/ on sys.path)
    FAILED, check, rel_err, replay_worst,
)
from wo_bench_common import bf16_baseline, do_bench_us  # noqa: E402

T0 = time.perf_counter()
DEADLINE_S = 200.0  # no new cell is timed after this
SCHEMES = {"int4_w4a16": {"group_size": 128}, "int8_w8a16": {}, "mxfp4": {}}
GROUP = {"int4_w4a16": 128, "int8_w8a16": 0, "mxfp4": 32}
BATCHES = (1024, 4096, 16384)
PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b")
TOL = 1e-2  # rel L2 against the reference
WARMUP_MS, REP_MS = 10, 60
SWEEP_TILES = ((32, 128), (16, 256), (64, 128), (64, 256))  # dequant (BLOCK_R, BLOCK_C), on SWEEP_CELL's weights
SWEEP_CELL = ("mixtral-8x7b", "int4_w4a16")  # also the chunked-scratch check, at the largest M
CHUNK_EXPERTS = 3  # Mixtral's 8 experts in chunks of 3, 3, 2


@dataclass
class Cell:
    shape: str
    scheme: str
    m: int
    fused: str  # the fused decode timed (the chooser's below the scratch)
    pick: str  # the chooser's decode at this M
    bf16_us: float
    fused_us: float
    scratch_us: float
    overlap_us: float  # the scratch decode with its dequants on a side stream (SCRATCH_OVERLAP)
    dequant_us: float  # the scratch path's dequantization of w13 and w2 alone
    err_fused: float
    err_scratch: float
    err_overlap: float

    @property
    def pick_us(self) -> float:
        return self.scratch_us if self.pick == "scratch" else self.fused_us


def elapsed() -> float:
    return time.perf_counter() - T0


def bench_us(fn) -> float:
    return do_bench_us(fn, WARMUP_MS, REP_MS)


def wo_weight(w) -> WoWeight:
    """``moekit.quant``'s weight as the raw tensors the weight-only kernels read."""
    return WoWeight(w.scheme, w.q, w.scale, getattr(w, "zero", None), GROUP[w.scheme])


def dequant_both(w13: WoWeight, w2: WoWeight, s: Shape, scratch: torch.Tensor, tile=DEQUANT_TILE) -> None:
    """What the scratch path dequantizes per call: every expert's w13, then w2, into one scratch."""
    scheme_id = SCHEME_IDS[w13.scheme]
    e = s.num_experts
    dequantize_experts(weight_args(w13.q, w13.scale, w13.zero, w13.group_size), scheme_id, s.k,
                       scratch[:e * 2 * s.n * s.k].view(e, 2 * s.n, s.k), 0, tile)
    dequantize_experts(weight_args(w2.q, w2.scale, w2.zero, w2.group_size), scheme_id, s.n,
                       scratch[:e * s.k * s.n].view(e, s.k, s.n), 0, tile)


def tile_sweep(s: Shape, scheme: str, w13: WoWeight, w2: WoWeight, scratch: torch.Tensor) -> None:
    """The dequant kernel's µs and HBM GB/s (packed read + dense write) under a few (BLOCK_R, BLOCK_C)."""
    dense = 3 * s.num_experts * s.n * s.k * scratch.element_size()
    packed = sum(t.numel() * t.element_size() for w in (w13, w2) for t in (w.q, w.scale, w.zero) if t is not None)
    for tile in SWEEP_TILES:
        if elapsed() > DEADLINE_S:
            print(f"SKIPPED dequant tile {tile}: past {DEADLINE_S:.0f} s", flush=True)
            continue
        us = bench_us(lambda: dequant_both(w13, w2, s, scratch, tile))
        print(f"dequant tile {s.name} {scheme} {tile}{' (default)' if tile == DEQUANT_TILE else ''}: "
              f"{us:.0f} µs, {(dense + packed) / us / 1e3:.0f} GB/s", flush=True)


def scheme_cells(s: Shape, scheme: str, w13f, w2f, sets: dict, bf16: dict, dev) -> list[Cell]:
    q13, q2 = quantize(w13f, scheme, **SCHEMES[scheme]), quantize(w2f, scheme, **SCHEMES[scheme])
    w13, w2 = wo_weight(q13), wo_weight(q2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    work = torch.float32 if os.environ.get("TRITON_INTERPRET") == "1" else torch.bfloat16
    scratch = torch.empty(s.num_experts * 2 * s.n * s.k, dtype=work, device=dev)
    cells = []
    for m, c in sets.items():
        if elapsed() > DEADLINE_S:
            print(f"SKIPPED {s.name} {scheme} M={m}: past {DEADLINE_S:.0f} s", flush=True)
            continue
        fused = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k, fused=True)
        pick = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
        ref = experts_reference(c.x, q13, q2, c.topk_ids, c.topk_weights)
        errs, times = {}, {}
        for decode in (fused, "scratch", "overlap"):
            def call(decode=decode):
                if decode == "overlap":  # the scratch decode, dequants on a side stream (SCRATCH_OVERLAP)
                    return run_experts_wo_scratch(c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME_IDS[scheme],
                                                  "silu", overlap=True)
                return fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights, decode=decode)

            errs[decode] = rel_err(call(), ref)
            check(f"{s.name} {scheme} M={m} {decode} vs reference", errs[decode] < TOL, f"rel_err={errs[decode]:.2e}")
            times[decode] = bench_us(call)
        del ref
        cell = Cell(s.name, scheme, m, fused, pick, bf16[m], times[fused], times["scratch"], times["overlap"],
                    bench_us(lambda: dequant_both(w13, w2, s, scratch)), errs[fused], errs["scratch"], errs["overlap"])
        print(f"{s.name} {scheme} M={m}: bf16 {cell.bf16_us:.0f} µs, {fused} {cell.fused_us:.0f}, scratch "
              f"{cell.scratch_us:.0f} (dequant {cell.dequant_us:.0f}), overlapped {cell.overlap_us:.0f}, pick {pick}  "
              f"[{elapsed():.0f} s]", flush=True)
        cells.append(cell)
    if (s.name, scheme) == SWEEP_CELL or (SMOKE and scheme == SWEEP_CELL[1]):
        tile_sweep(s, scheme, w13, w2, scratch)
        chunked(s, q13, q2, w13, w2, sets[max(sets)], cells[-1] if cells else None)
    return cells


def chunked(s: Shape, q13, q2, w13: WoWeight, w2: WoWeight, c, cell: Cell | None) -> None:
    """The scratch path in chunks of CHUNK_EXPERTS experts (what a scratch above SCRATCH_MAX_BYTES runs):
    against the reference, and timed beside the one-chunk run of the same cell."""
    if elapsed() > DEADLINE_S:
        print(f"SKIPPED chunked scratch: past {DEADLINE_S:.0f} s", flush=True)
        return
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    itemsize = 4 if os.environ.get("TRITON_INTERPRET") == "1" else 2
    cap = CHUNK_EXPERTS * scratch_bytes_per_expert(s.n, s.k, itemsize)

    def call():
        return run_experts_wo_scratch(c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME_IDS[w13.scheme],
                                      "silu", max_scratch_bytes=cap)

    err = rel_err(call(), experts_reference(c.x, q13, q2, c.topk_ids, c.topk_weights))
    us = bench_us(call)
    one = f", one chunk {cell.scratch_us:.0f} µs" if cell is not None else ""
    check(f"{s.name} {w13.scheme} M={c.x.shape[0]} scratch in chunks of {CHUNK_EXPERTS} experts vs reference",
          err < TOL, f"rel_err={err:.2e}  {us:.0f} µs{one}")


def shape_cells(s: Shape, batches: tuple, dev) -> list[Cell]:
    base = bf16_baseline(s, batches, dev, bench_us)
    w13f, w2f, sets, bf16 = base.w13, base.w2, base.sets, base.us
    cells = []
    for scheme in SCHEMES:
        try:
            cells += scheme_cells(s, scheme, w13f, w2f, sets, bf16, dev)
        except Exception as e:  # noqa: BLE001  (reported, the run goes on)
            check(f"{s.name} {scheme}", False, f"raised {type(e).__name__}: {e}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def graph_replay(dev) -> None:
    """The scratch decode captured in a CUDA graph (one call: all experts in one chunk, in chunks of 3, overlapped)
    and replayed on new tokens and routing equals the eager call."""
    s = Shape("graph", 8, 256, 512, 2)
    q13 = quantize(torch.randn(s.num_experts, 2 * s.n, s.k, device=dev) / s.k**0.5, "int4_w4a16", group_size=128)
    q2 = quantize(torch.randn(s.num_experts, s.k, s.n, device=dev) / s.n**0.5, "int4_w4a16", group_size=128)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (wo_weight(q13), wo_weight(q2)))
    first, *others = make_sets(s, 300, 3, torch.bfloat16, dev, seed=7)
    x, ids, w = first.x.clone(), first.topk_ids.clone(), first.topk_weights.clone()
    for cap, overlap in ((1 << 30, False), (3 * scratch_bytes_per_expert(s.n, s.k, 2), False), (1 << 30, True)):
        def call(cap=cap, overlap=overlap):
            return run_experts_wo_scratch(x, a13, a2, ids, w, None, SCHEME_IDS["int4_w4a16"], "silu",
                                          max_scratch_bytes=cap, overlap=overlap)

        worst = replay_worst(call, x, ids, w, others)
        check(f"cuda graph replay of the scratch decode, scratch cap {cap} bytes, overlap {overlap}", worst < 1e-6,
              f"max rel diff vs eager {worst:.1e}")


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>5} {'bf16 µs':>8} {'fused':>8} {'µs':>8} {'scratch':>8} "
             f"{'overlap':>8} {'deq µs':>7} {'pick':>8} {'fused/bf16':>10} {'scr/bf16':>8} {'ovl/bf16':>8} "
             f"{'pick/bf16':>9} {'max err':>7}  target <= 1.11"]
    for c in cells:
        ratio = c.pick_us / c.bf16_us
        lines.append(f"{c.shape:<14} {c.scheme:<10} {c.m:>5} {c.bf16_us:>8.0f} {c.fused:>8} {c.fused_us:>8.0f} "
                     f"{c.scratch_us:>8.0f} {c.overlap_us:>8.0f} {c.dequant_us:>7.0f} {c.pick:>8} "
                     f"{c.fused_us / c.bf16_us:>10.2f} {c.scratch_us / c.bf16_us:>8.2f} "
                     f"{c.overlap_us / c.bf16_us:>8.2f} {ratio:>9.2f} "
                     f"{max(c.err_fused, c.err_scratch, c.err_overlap):>7.1e}  "
                     f"{'met' if ratio <= 1 / 0.9 else 'MISSED'}")
    return "\n".join(lines)


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(torch.__version__, "triton", triton.__version__, name, f"SCRATCH_MIN_TOKENS={SCRATCH_MIN_TOKENS}",
          flush=True)
    if SMOKE:
        shapes, batches = [Shape("tiny", 8, 64, 128, 2)], (16, 32)
    else:
        args = [a for a in sys.argv[1:] if a != "--smoke"]
        presets = args[args.index("--presets") + 1:] if "--presets" in args else PRESETS
        shapes, batches = [Shape.from_preset(p) for p in presets], BATCHES
    if dev.type == "cuda":
        try:
            graph_replay(dev)
        except Exception as e:  # noqa: BLE001  (reported, the run goes on)
            check("cuda graph replay", False, f"raised {type(e).__name__}: {e}")
    cells = []
    for s in shapes:
        cells += shape_cells(s, batches, dev)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_large.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "scratch_min_tokens": SCRATCH_MIN_TOKENS, "cells": [asdict(c) for c in cells],
                       "failed": FAILED, "seconds": elapsed()}, f, indent=1)
    print(f"FAILED: {FAILED or 'none'}   total {elapsed():.0f} s")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
