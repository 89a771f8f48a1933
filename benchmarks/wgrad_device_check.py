"""The weight-gradient GEMMs of the Triton experts backward on the H200 (bf16): every variant, one run.

    PYTHONPATH=. python benchmarks/wgrad_device_check.py            # the H200 run (< 3 min), JSON to $OUT/wgrad.json
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/wgrad_device_check.py --smoke   # CPU dry run of this script

Cells: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B expert shapes at M = 4096 and 16384 tokens, uniform
routing, the 128-row layout. Per cell, dW13 = dh^T x (4·A·N·K FLOPs) and dW2 = dout^T (w g) (2·A·N·K) with each
variant of ``VARIANTS`` (``KernelTiles``): the gathering kernel (the ``TUNED`` tile of the cell's class,
and a wider one) and the contiguous kernel (``weight_grad``'s ``contiguous``: both operands permuted
into the layout's rows, the permutation's time included), pointer or TMA loads, grouped tile order.
For each: median ms (``backward_tune.clock``), TFLOP/s, % of a dense ``torch.mm`` of the same FLOPs
timed in the same run, the compiled kernel's registers and spills, and its rel-L2 against the TUNED
tile's output and against a float32 torch twin on three experts (FAIL over 1e-2). The permutation
alone is timed too. Then at M = 16384 forward + backward with the fastest correct variant of each weight
grad (``backward_tune.end_to_end``: against the current defaults and transformers' ``grouped_mm``
autograd), and that step stage by stage (``breakdown``: which GEMM limits it, at what % of the mm).
A table last; exit 1 if a check fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

import backward_tune as bt
import moekit.experts.triton_backward_launch as bl
from backward_device_check import rel_l2
from moekit.bench.cells import PRESETS, Shape, make_weights
from moekit.experts.triton_backward_launch import KernelTiles

SMOKE = bt.SMOKE
WEIGHT_KERNELS = ("dw13", "dw2")


def _t(rows, cols, stages, contiguous=True, desc=True, group=8, warps=8, red=64) -> KernelTiles:
    return KernelTiles(cols, red, warps, stages, rows=rows, split=1, desc=desc, contiguous=contiguous, group=group)


if SMOKE:
    VARIANTS = {"gather": KernelTiles(16, 16, 1, 1, rows=16, split=1),
                "contig-ptr": _t(16, 16, 1, desc=False, group=2, warps=1, red=16),
                "contig-tma": _t(16, 16, 1, warps=1, red=16)}
    SHAPES, BATCHES, BLOCK = bt.SHAPES, (12,), 16
else:
    VARIANTS = {
        "gather 128x128 s4": _t(128, 128, 4, contiguous=False, desc=False),  # the default before 2026-12-01
        "gather 128x256 s3": _t(128, 256, 3, contiguous=False, desc=False),
        "contig-ptr 128x128 s4 g8": _t(128, 128, 4, desc=False),
        "contig-tma 128x128 s3 g1": _t(128, 128, 3, group=1),
        "contig-tma 128x128 s3 g8": _t(128, 128, 3),
        "contig-tma 128x128 s4 g8": _t(128, 128, 4),
        "contig-tma 128x128 s5 g8": _t(128, 128, 5),
        "contig-tma 128x128 s4 g8 w4": _t(128, 128, 4, warps=4),
        "contig-tma 128x256 s3 g8": _t(128, 256, 3),
        "contig-tma 128x256 s4 g8": _t(128, 256, 4),
        "contig-tma 128x256 s4 g1": _t(128, 256, 4, group=1),
        "contig-tma 256x128 s3 g8": _t(256, 128, 3),
    }
    SHAPES, BATCHES, BLOCK = [Shape.from_preset(p) for p in PRESETS], (4096, 16384), 128


def current(cell: bt.Cell, kernel: str) -> KernelTiles:
    """The weight grad's tile today: ``backward_tiles`` of the cell (TUNED on the H200)."""
    return getattr(bl.backward_tiles(cell.a, cell.s.num_experts, cell.s.n, torch.bfloat16, cell.x.device), kernel)


def compiled_stats(cell: bt.Cell, kernel: str, t: KernelTiles) -> dict:
    """Registers and spills of the weight-grad kernel ``t`` compiles to (the launch's return value)."""
    if SMOKE:
        return {}
    seen, real = [], bl.kernels

    class Spy:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            target = getattr(self.module, name)
            if not name.startswith("weight_grad"):
                return target
            return type("K", (),
                        {"__getitem__": lambda _, grid: lambda *a, **kw: seen.append(target[grid](*a, **kw))})()

    bl.kernels = lambda name: Spy(real(name))
    try:
        cell.call(kernel, BLOCK, t)()
    finally:
        bl.kernels = real
    k = seen[-1] if seen else None
    return dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                shared=getattr(getattr(k, "metadata", None), "shared", None))


def twin_error(cell: bt.Cell, kernel: str, got: torch.Tensor) -> float:
    """Largest rel-L2 over three experts of ``got`` against a float32 torch twin of that expert's sum."""
    k, ids, worst = cell.s.top_k, cell.ids.reshape(-1), 0.0
    for e in (0, cell.s.num_experts // 2, cell.s.num_experts - 1):
        a = (ids == e).nonzero().squeeze(1)
        if kernel == "dw13":
            want = cell.dh[a].float().T @ cell.x[a // k].float()
        else:
            want = cell.dout[a // k].float().T @ cell.gw[a].float()
        worst = max(worst, rel_l2(got[e], want))
    return worst


def time_variants(cell: bt.Cell, dev) -> dict:
    """{kernel: {"dense_ms", "rows": [{name, tile, ms, tflops, pct_dense, stats, rel_current, rel_twin}]}}."""
    out = {}
    for kernel in WEIGHT_KERNELS:
        work = bt.FLOPS_PER_ANK[kernel] * cell.a * cell.s.n * cell.s.k
        dense_ms = bt.clock(cell.dense(kernel, dev), dev)
        reference = cell.call(kernel, BLOCK, current(cell, kernel))()
        rows, best = [], float("inf")
        for name, t in {"current (TUNED)": current(cell, kernel), **VARIANTS}.items():
            row = dict(name=name, tile=dataclasses.asdict(t))
            try:
                fn = cell.call(kernel, BLOCK, t)
                ms = bt.clock(fn, dev, best)
                got = fn()
                row.update(ms=ms, tflops=work / ms / 1e9, pct_dense=100 * dense_ms / ms,
                           rel_current=rel_l2(got, reference), rel_twin=twin_error(cell, kernel, got),
                           **compiled_stats(cell, kernel, t))
                del got
                best = min(best, ms)
            except Exception as e:  # noqa: BLE001  (out of resources, a tile this Triton refuses)
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            rows.append(row)
        del reference
        out[kernel] = dict(dense_ms=dense_ms, dense_tflops=work / dense_ms / 1e9, rows=rows)
    return out


def permute_ms(cell: bt.Cell, dev) -> dict:
    """ms of permuting each weight grad's two operands into the layout's rows, and the GB/s it moves."""
    layout, k, out = cell.layouts[BLOCK], cell.s.top_k, {}
    for kernel, pairs in (("dw13", ((cell.dh, 1), (cell.x, k))), ("dw2", ((cell.dout, k), (cell.gw, 1)))):
        ms = bt.clock(lambda: [bl.permute_rows(src, div, layout) for src, div in pairs], dev)
        moved = 2 * sum(layout.sorted_ids.numel() * src.shape[1] * src.element_size() for src, _ in pairs)
        out[kernel] = dict(ms=ms, gb_per_s=moved / ms / 1e6)
    return out


def winner(timed: dict, kernel: str) -> dict:
    """The fastest row whose grads agree with the current tile's and the torch twin's (rel-L2 < 1e-2)."""
    ok = [r for r in timed[kernel]["rows"] if "ms" in r and r["rel_current"] < 1e-2 and r["rel_twin"] < 1e-2]
    return min(ok, key=lambda r: r["ms"])


def breakdown(cell: bt.Cell, tiles, dev) -> dict:
    """{stage: {ms, tflops}} of one forward + backward with ``tiles``, stage by stage as
    ``experts_backward`` runs them (the weight grads with the layout-order dh and w*g when both are
    contiguous, their x / dout permutations included)."""
    from moekit.experts.triton import fused_experts

    s, w, k, ank = cell.s, cell.w, cell.s.top_k, cell.a * cell.s.n * cell.s.k
    weights = cell.weights.reshape(-1).contiguous()
    layout = bl.align(cell.ids, None, s.num_experts, tiles.block_m)
    sorted_out = tiles.dw13.contiguous and tiles.dw2.contiguous
    div = 0 if sorted_out else 1
    dh, gw, _ = bl.grad_gate_up(cell.dout, cell.x, w.w13, w.w2, weights, layout, tiles.grad, "silu", sorted_out)
    per_slot = torch.empty(cell.a, s.k, device=dev, dtype=dh.dtype)
    stages = {
        "forward": (6, lambda: fused_experts(cell.x, w.w13, w.w2, cell.ids, cell.weights)),
        "align": (0, lambda: bl.align(cell.ids, None, s.num_experts, tiles.block_m)),
        "grad_gate_up": (6, lambda: bl.grad_gate_up(cell.dout, cell.x, w.w13, w.w2, weights, layout, tiles.grad,
                                                    "silu", sorted_out)),
        "dx": (4, lambda: bl.gather_gemm(dh, div, w.w13, 2, 1, per_slot, layout, tiles.dx)),
        "dx k-sum": (0, lambda: bl.sum_slots(per_slot, cell.ids, None, s.num_experts, cell.x.dtype)),
        "dw13": (4, lambda: bl.weight_grad(dh, div, cell.x, k, s.num_experts, torch.bfloat16, layout, tiles.dw13)),
        "dw2": (2, lambda: bl.weight_grad(cell.dout, k, gw, div, s.num_experts, torch.bfloat16, layout, tiles.dw2)),
    }
    out = {}
    for name, (flops, fn) in stages.items():
        ms = bt.clock(fn, dev)
        out[name] = dict(ms=ms, tflops=flops * ank / ms / 1e9)
    return out


def check_cell(s: Shape, m: int, w, dev, e2e: bool) -> dict:
    """One (shape, M): the variants, the permutation, and (``e2e``) forward + backward with the winners."""
    cell = bt.Cell(s, m, w, dev)
    bt.precompile([cell], {(kernel, BLOCK): [current(cell, kernel), *VARIANTS.values()] for kernel in WEIGHT_KERNELS})
    timed = time_variants(cell, dev)
    wins = {kernel: winner(timed, kernel) for kernel in WEIGHT_KERNELS}
    base = bl.backward_tiles(cell.a, s.num_experts, s.n, torch.bfloat16, dev)
    tiles = dataclasses.replace(base, **{kernel: KernelTiles(**wins[kernel]["tile"]) for kernel in WEIGHT_KERNELS})
    row = dict(shape=s.name, m=m, shape_class=bl.shape_class(cell.a, s.num_experts, s.n), kernels=timed,
               permute=permute_ms(cell, dev), winners={k: r["name"] for k, r in wins.items()}, tiles=repr(tiles),
               e2e=None)
    if e2e:
        try:
            row["e2e"] = bt.end_to_end(cell, tiles, dev)
            row["stages"] = breakdown(cell, tiles, dev)
        except Exception as exc:  # noqa: BLE001  (recorded as a failure; the other cells still run)
            row["e2e_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"{s.name} M={m}: winners {row['winners']}  e2e {row['e2e']}", flush=True)
    del cell
    return row


def passed(rows: list) -> bool:
    """Every variant that ran agrees with the current tile and the twin; the e2e grads with the defaults'."""
    for row in rows:
        for kernel in WEIGHT_KERNELS:
            for r in row["kernels"][kernel]["rows"]:
                if "ms" in r and max(r["rel_current"], r["rel_twin"]) >= 1e-2:
                    print(f"FAIL  {row['shape']} {kernel} {r['name']}: rel_current {r['rel_current']:.1e} "
                          f"rel_twin {r['rel_twin']:.1e}")
                    return False
        if "e2e_error" in row:
            print(f"FAIL  {row['shape']}: forward + backward with the winners: {row['e2e_error']}")
            return False
        if row["e2e"] and max(row["e2e"]["rel_l2_vs_heuristic"].values()) >= 1e-2:
            print(f"FAIL  {row['shape']}: the winners' grads differ from the defaults'")
            return False
    return True


def table(rows: list, matmul: float) -> None:
    print(f"bf16 mm 8192^3: {matmul:.0f} TFLOP/s")
    print(f"{'shape':14} {'kernel':5} {'variant':30} {'ms':>8} {'TFLOP/s':>8} {'%dense':>6} {'%mm':>5} "
          f"{'regs':>5} {'spill':>5} {'rel_cur':>8} {'rel_twin':>8}")
    for row in rows:
        for kernel in WEIGHT_KERNELS:
            for r in row["kernels"][kernel]["rows"]:
                if "error" in r:
                    print(f"{row['shape']:14} {kernel:5} {r['name']:30} {r['error'][:70]}")
                    continue
                pct_mm = 100 * r["tflops"] / matmul if matmul else 0.0
                print(f"{row['shape']:14} {kernel:5} {r['name']:30} {r['ms']:8.3f} {r['tflops']:8.0f} "
                      f"{r['pct_dense']:6.0f} {pct_mm:5.0f} {str(r.get('n_regs')):>5} {str(r.get('n_spills')):>5} "
                      f"{r['rel_current']:8.1e} {r['rel_twin']:8.1e}")
            p = row["permute"][kernel]
            print(f"{row['shape']:14} {kernel:5} {'(permute both operands)':30} {p['ms']:8.3f} {p['gb_per_s']:8.0f} "
                  f"GB/s")
    print(f"{'shape':14} {'winners dw13 / dw2':58} {'fwd+bwd ms':>10} {'current':>8} {'grouped_mm':>10} {'speedup':>7}")
    for row in filter(lambda r: r["e2e"], rows):
        e = row["e2e"]
        names = " / ".join(row["winners"].values())
        print(f"{row['shape']:14} {names:58} {e['tuned_ms']:10.2f} {e['heuristic_ms']:8.2f} {e['baseline_ms']:10.2f} "
              f"{e['baseline_ms'] / e['tuned_ms']:6.2f}x")
    print(f"{'shape':14} {'stage (winners)':14} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5}")
    for row in filter(lambda r: r.get("stages"), rows):
        for name, st in row["stages"].items():
            pct = 100 * st["tflops"] / matmul if matmul else 0.0
            print(f"{row['shape']:14} {name:14} {st['ms']:8.2f} {st['tflops']:8.0f} {pct:5.0f}")
        print(f"{row['shape']:14} {'sum':14} {sum(st['ms'] for st in row['stages'].values()):8.2f}")
    print("winning tiles per class:\n" + "\n".join(f"  {r['shape_class']!r}: {r['tiles']},  # {r['shape']} M={r['m']}"
                                                 for r in rows))


def main() -> int:
    import triton

    dev = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
    print(torch.__version__, "triton", triton.__version__,
          torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
          flush=True)
    started = time.perf_counter()
    matmul = bt.matmul_rate(dev)
    rows = []
    for s in SHAPES:
        w = make_weights(s, torch.bfloat16, dev)
        for m in BATCHES:
            rows.append(check_cell(s, m, w, dev, e2e=m == BATCHES[-1]))
        del w
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        print(f"{s.name} done at {time.perf_counter() - started:.0f} s", flush=True)
    ok = passed(rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wgrad.json"), "w") as f:
            json.dump(dict(matmul_tflops=matmul, cells=rows, passed=ok, wall_s=time.perf_counter() - started), f,
                      indent=1)
    table(rows, matmul)
    print(f"{'PASS' if ok else 'FAIL'} ({time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
