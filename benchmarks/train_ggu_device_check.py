"""grad_gate_up of the Triton experts backward on the H200 (bf16): the gathering kernel against the sorted
ones (dout and x permuted into the layout's rows, TMA loads; ``triton_backward_sorted``), every variant in
one run, then forward + backward with the fastest correct one.

    PYTHONPATH=$PWD python benchmarks/train_ggu_device_check.py          # the H200 run (< 2 min), $OUT/train_ggu.json
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/train_ggu_device_check.py --smoke   # CPU dry run

Cells: DeepSeek-V3, Mixtral-8x7B, Qwen3-30B-A3B expert shapes at M = 16384 tokens, then at 4096 while
time is left (uniform routing, the 128-row layout). Per variant of ``VARIANTS`` (grad tiles): median ms,
TFLOP/s (6·A·N·K: dY·W2 and the gate-up recompute), % of a bf16 ``torch.mm`` 8192³ timed in the same
run, registers and spills of the kernels it launches, and rel-L2 of dh, w·g and the d-weight sums
against the gathering kernel's (TUNED) and of dh against a float32 torch twin on two experts (FAIL over
1e-2). The sorted variants are timed without the permutation of x and dout (the weight grads need it
anyway; timed alone as ``permute x, dout``). The weight grads (TUNED's tile and ``WEIGHT_VARIANTS``) on
the layout-order operands, against TUNED's output and float32 torch on expert 0. Then, at 16384,
forward + backward with the winners against the current defaults and transformers' ``grouped_mm``
autograd (``backward_tune.end_to_end``; its grads against the defaults'), that step stage by stage
with % of the mm, and the winners' backward twice (bit-identical). A soft time limit skips what is
left; a hard one (HARD_LIMIT_S) prints what it has. A table last; exit 1 if a check fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import backward_tune as bt
import moekit.experts.triton_backward_launch as bl
from backward_device_check import rel_l2
from train_ggu_report import ok_row, passed, table, weight_ok
from moekit.bench.cells import Shape, make_weights
from moekit.experts.triton_backward_launch import KernelTiles
from moekit.experts.triton_backward_sorted import grad_gate_up_sorted

SMOKE = bt.SMOKE
SOFT_LIMIT_S, SMALL_START_S, HARD_LIMIT_S = 85, 60, 110


def _s(cols, stages, dg_cols=0, rows=128, warps=8) -> KernelTiles:
    return KernelTiles(cols, 64 if not SMOKE else 16, warps, stages, rows=rows, desc=True, contiguous=True,
                       group=8 if not SMOKE else 2, dg_cols=dg_cols)


def _w(rows, cols, stages, warps=8, red=64) -> KernelTiles:
    return KernelTiles(cols, red if not SMOKE else 16, warps, stages, rows=rows, split=1, desc=True, contiguous=True,
                       group=8 if not SMOKE else 2)


if SMOKE:
    WEIGHT_VARIANTS = {"contig 16x16": _w(16, 16, 1, warps=1)}
    VARIANTS = {"sorted fused": _s(16, 1, rows=16, warps=1), "sorted split": _s(16, 1, 32, rows=16, warps=1)}
    SHAPES, BATCHES, BLOCK = [Shape("tiny", 4, 24, 48, 2)], (12, 8), 16
else:
    VARIANTS = {
        "sorted fused 128x64 s3": _s(64, 3),
        "sorted fused 128x64 s4": _s(64, 4),
        "sorted fused 64x64 w4 s4": _s(64, 4, rows=64, warps=4),
        "sorted fused 128x128 s2": _s(128, 2),
        "sorted fused 128x128 w16 s2": _s(128, 2, warps=16),
        "sorted split dg256 gu128 s3": _s(128, 3, 256),
        "sorted split dg256 gu128 s4": _s(128, 4, 256),
        "sorted split dg128 gu128 s4": _s(128, 4, 128),
        "sorted split dg256 gu128 w16 s4": _s(128, 4, 256, warps=16),
        "sorted split dg256 gu64 s4": _s(64, 4, 256),
        "sorted split dg128 gu64 s5": _s(64, 5, 128),
    }
    WEIGHT_VARIANTS = {  # the weight grads on the layout-order operands (what the sorted grad leaves them)
        "contig 128x256 red128 s2": _w(128, 256, 2, red=128),
        "contig 256x128 s4": _w(256, 128, 4),
    }
    SHAPES = [Shape.from_preset(p) for p in ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b")]
    BATCHES, BLOCK = (16384, 4096), 128  # 4096: variants only (no end to end), while time is left


class Cell:
    """One shape at m tokens: inputs, the layout, x and dout permuted, the gathering kernel's output."""

    def __init__(self, s: Shape, m: int, w, dev):
        self.base = bt.Cell(s, m, w, dev)  # routing, x, dout (and its layouts, dh, gw for nothing else)
        c, k = self.base, s.top_k
        self.s, self.w, self.a = s, w, c.a
        self.layout = bl.align(c.ids, None, s.num_experts, BLOCK)
        self.weights = c.weights.reshape(-1).contiguous()
        self.x_p, self.dout_p = bl.permute_rows(c.x, k, self.layout), bl.permute_rows(c.dout, k, self.layout)
        self.used = int(self.layout.num_padded)
        self.current = bl.backward_tiles(c.a, s.num_experts, s.n, torch.bfloat16, dev)
        if SMOKE:  # the H200's TUNED weight grads are contiguous (the sorted grad needs them); the CPU's not
            wg = KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True)
            self.current = dataclasses.replace(self.current, dw13=wg, dw2=wg)
        self.ref = self.gather(self.current.grad)()

    def gather(self, t: KernelTiles):
        c = self.base
        return lambda: bl.grad_gate_up(c.dout, c.x, self.w.w13, self.w.w2, None, self.weights, self.layout, t, "silu",
                                       True)

    def sorted_call(self, t: KernelTiles):
        return lambda: grad_gate_up_sorted(self.dout_p, self.x_p, self.w.w13, self.w.w2, self.weights, self.layout, t,
                                           "silu")

    def errors(self, got) -> dict:
        """rel-L2 of (dh, w g, d weights) against the gathering kernel's, and of dh against the twin."""
        u = self.used
        out = dict(dh=rel_l2(got[0][:u], self.ref[0][:u]), gw=rel_l2(got[1][:u], self.ref[1][:u]),
                   dweights=rel_l2(got[2].sum(1, keepdim=True), self.ref[2].sum(1, keepdim=True)))
        out["twin"] = self.twin(got[0])
        return out

    def twin(self, dh: torch.Tensor) -> float:
        """Largest rel-L2 over two experts of dh's rows against float32 torch on those rows."""
        n, worst = self.s.n, 0.0
        counts = self.layout.counts.tolist()
        padded = [-(-c // BLOCK) * BLOCK for c in counts]
        for e in (0, self.s.num_experts - 1):
            start = sum(padded[:e])
            rows = self.layout.sorted_ids[start:start + counts[e]].long()
            tok = rows // self.s.top_k
            dg = (self.base.dout[tok].float() @ self.w.w2[e].float()) * self.weights[rows].float()[:, None]
            h = self.base.x[tok].float() @ self.w.w13[e].float().T
            gate, up = h[:, :n], h[:, n:]
            sig = torch.sigmoid(gate)
            want = torch.cat([dg * up * sig * (1 + gate * (1 - sig)), dg * gate * sig], 1)
            worst = max(worst, rel_l2(dh[start:start + counts[e]], want))
        return worst


def precompile(cell: Cell) -> None:
    """Every variant's kernels compiled at once (``backward_tune``'s warm-up stand-in under
    AsyncCompileMode: nothing runs); without AsyncCompileMode they compile as they come."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    import moekit.experts.triton_backward_sorted as bs

    real = (bl.kernels, bs.kernels)
    bl.kernels = bs.kernels = lambda name: bt._Warm(real[0](name))
    s, layout, (dh, gw) = cell.s, cell.layout, cell.ref[:2]
    calls = [cell.sorted_call(t) for t in VARIANTS.values()]
    for t in (cell.current.dw13, cell.current.dw2, *WEIGHT_VARIANTS.values()):
        calls.append(lambda t=t: bl.weight_grad(dh, 0, cell.x_p, 0, s.num_experts, torch.bfloat16, layout, t))
        calls.append(lambda t=t: bl.weight_grad(cell.dout_p, 0, gw, 0, s.num_experts, torch.bfloat16, layout, t))
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in calls:
                try:
                    call()
                except Exception as e:  # noqa: BLE001  (it fails again, and is reported, when timed)
                    print(f"precompile: {type(e).__name__}: {str(e)[:160]}", flush=True)
    except Exception as e:  # noqa: BLE001  (the rest compile as they come)
        print(f"precompile: {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        bl.kernels, bs.kernels = real


def compiled(fn) -> list:
    """(kernel name, registers, spills) of every Triton launch fn makes (the launch's return value)."""
    if SMOKE:
        return []
    import moekit.experts.triton_backward_sorted as bs

    seen, real = [], (bl.kernels, bs.kernels)

    class Spy:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            target = getattr(self.module, name)
            return type("K", (), {"__getitem__": lambda _, grid: lambda *a, **kw: seen.append(
                (name, target[grid](*a, **kw)))})()

    bl.kernels = bs.kernels = lambda name: Spy(real[0](name))
    try:
        fn()
    finally:
        bl.kernels, bs.kernels = real
    return [(name[:-7], getattr(k, "n_regs", None), getattr(k, "n_spills", None)) for name, k in seen
            if name.endswith("_kernel") and "permute" not in name]


def failure(e: Exception, what: str) -> dict:
    """The row fields of a variant that failed (its last lines for the table, the whole message in the JSON),
    the message printed in full to the log."""
    print(f"{what} failed: {type(e).__name__}:\n{str(e)[-3000:]}", flush=True)
    return dict(error=f"{type(e).__name__}: {' | '.join(str(e).splitlines()[-3:])[:300]}", error_full=str(e)[-3000:])


def time_variants(cell: Cell, dev, started: float) -> dict:
    work = 6 * cell.a * cell.s.n * cell.s.k
    rows, best = [], float("inf")
    plan = {"gather (TUNED)": (cell.current.grad, cell.gather)}
    plan.update({name: (t, cell.sorted_call) for name, t in VARIANTS.items()})
    for name, (t, make) in plan.items():
        row = dict(name=name, tile=dataclasses.asdict(t))
        if time.perf_counter() - started > SOFT_LIMIT_S:
            row["error"] = "skipped: time limit"
            rows.append(row)
            continue
        try:
            fn = make(t)
            ms = bt.clock(fn, dev, best)
            row.update(ms=ms, tflops=work / ms / 1e9, **cell.errors(fn()), kernels=compiled(fn))
            best = min(best, ms)
        except Exception as e:  # noqa: BLE001  (out of resources, a tile this Triton refuses)
            row.update(failure(e, f"{cell.s.name} grad {name}"))
        rows.append(row)
    permute = bt.clock(lambda: (bl.permute_rows(cell.base.x, cell.s.top_k, cell.layout),
                                bl.permute_rows(cell.base.dout, cell.s.top_k, cell.layout)), dev)
    return dict(rows=rows, permute_ms=permute)


def time_weight_grads(cell: Cell, dev, started: float) -> dict:
    """{dw13, dw2: rows}: TUNED's tile and each of WEIGHT_VARIANTS on the layout-order operands (dh, w g
    from the gathering grad; x, dout permuted), ms, TFLOP/s, rel-L2 against TUNED's output and, on expert
    0, against float32 torch."""
    s, layout = cell.s, cell.layout
    dh, gw = cell.ref[0], cell.ref[1]
    operands = {"dw13": (dh, cell.x_p, 4), "dw2": (cell.dout_p, gw, 2)}
    count = int(layout.counts[0])
    out = {}
    for kernel, (left, right, flops) in operands.items():
        work, rows = flops * cell.a * s.n * s.k, []
        call = (lambda t: lambda: bl.weight_grad(left, 0, right, 0, s.num_experts, torch.bfloat16, layout, t))
        reference = call(getattr(cell.current, kernel))()
        twin = left[:count].float().T @ right[:count].float()  # expert 0's rows come first
        for name, t in {"current (TUNED)": getattr(cell.current, kernel), **WEIGHT_VARIANTS}.items():
            row = dict(name=name, tile=dataclasses.asdict(t))
            if time.perf_counter() - started > SOFT_LIMIT_S:
                rows.append(dict(row, error="skipped: time limit"))
                continue
            try:
                fn = call(t)
                ms = bt.clock(fn, dev)
                got = fn()
                row.update(ms=ms, tflops=work / ms / 1e9, rel_current=rel_l2(got, reference), twin=rel_l2(got[0], twin),
                           kernels=compiled(fn))
                del got
            except Exception as e:  # noqa: BLE001  (out of resources, a tile this Triton refuses)
                row.update(failure(e, f"{s.name} {kernel} {name}"))
            rows.append(row)
        del reference
        out[kernel] = rows
    return out


def breakdown(cell: Cell, tiles, dev) -> dict:
    """{stage: {ms, tflops}} of one forward + backward with ``tiles`` (sorted grad: permutation separate)."""
    from moekit.experts.triton import fused_experts

    c, s, w, k, ank = cell.base, cell.s, cell.w, cell.s.top_k, cell.a * cell.s.n * cell.s.k
    sorted_grad = tiles.grad.contiguous
    grad = cell.sorted_call(tiles.grad) if sorted_grad else cell.gather(tiles.grad)
    dh, gw, _ = grad()
    x, dout, x_div = (cell.x_p, cell.dout_p, 0) if sorted_grad else (c.x, c.dout, k)
    per_slot = torch.empty(cell.a, s.k, device=dev, dtype=dh.dtype)
    stages = {
        "forward": (6, lambda: fused_experts(c.x, w.w13, w.w2, c.ids, c.weights)),
        "align": (0, lambda: bl.align(c.ids, None, s.num_experts, tiles.block_m)),
        "permute x, dout": (0, lambda: (bl.permute_rows(c.x, k, cell.layout), bl.permute_rows(c.dout, k, cell.layout))),
        "grad_gate_up": (6, grad),
        "dx": (4, lambda: bl.gather_gemm(dh, 0, w.w13, 2, 1, per_slot, cell.layout, tiles.dx)),
        "dx k-sum": (0, lambda: bl.sum_slots(per_slot, c.ids, None, s.num_experts, c.x.dtype)),
        "dw13": (4, lambda: bl.weight_grad(dh, 0, x, x_div, s.num_experts, torch.bfloat16, cell.layout, tiles.dw13)),
        "dw2": (2, lambda: bl.weight_grad(dout, x_div, gw, 0, s.num_experts, torch.bfloat16, cell.layout, tiles.dw2)),
    }
    if not sorted_grad:
        del stages["permute x, dout"]  # inside the weight grads' own times
    return {name: dict(ms=(ms := bt.clock(fn, dev)), tflops=flops * ank / ms / 1e9) for name, (flops, fn) in stages.items()}


def deterministic(cell: Cell, tiles) -> bool:
    """Two backward calls with ``tiles`` give bit-identical grads (no atomics on the sorted path either)."""
    c, w = cell.base, cell.w
    runs = [bl.experts_backward(c.dout, c.x, w.w13, w.w2, c.ids, c.weights, None, None, "silu", (True,) * 4,
                                tiles=tiles) for _ in range(2)]
    return all(torch.equal(getattr(runs[0], f), getattr(runs[1], f)) for f in ("x", "w13", "w2", "topk_weights"))


def check_cell(s: Shape, m: int, w, dev, started: float, e2e: bool) -> dict:
    cell = Cell(s, m, w, dev)
    precompile(cell)
    timed = time_variants(cell, dev, started)
    ok = [r for r in timed["rows"] if ok_row(r)]
    win = min(ok, key=lambda r: r["ms"]) if ok else None
    weights = time_weight_grads(cell, dev, started)
    wins = {k: min(filter(weight_ok, rows), key=lambda r: r["ms"], default=None) for k, rows in weights.items()}
    row = dict(shape=s.name, m=m, shape_class=bl.shape_class(cell.a, s.num_experts, s.n), **timed,
               weight_grads=weights, winner=win["name"] if win else None,
               weight_winners={k: r["name"] if r else None for k, r in wins.items()}, e2e=None)
    if e2e and win and None not in wins.values() and time.perf_counter() - started < SOFT_LIMIT_S:
        tiles = dataclasses.replace(cell.current, grad=KernelTiles(**win["tile"]),
                                    **{k: KernelTiles(**r["tile"]) for k, r in wins.items()})
        row["tiles"] = repr(tiles)
        try:
            row["e2e"] = bt.end_to_end(cell.base, tiles, dev)
            row["stages"] = breakdown(cell, tiles, dev)
            row["deterministic"] = deterministic(cell, tiles)
        except Exception as exc:  # noqa: BLE001  (recorded as a failure; the other cells still run)
            row["e2e_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"{s.name} M={m}: winners {row['winner']} {row['weight_winners']}  e2e {row['e2e']}  ({time.perf_counter() - started:.0f} s)", flush=True)
    return row


def report(name: str, rows: list, matmul: float, started: float, ok: bool, show, note: str = "") -> int:
    """$OUT/<name>.json, the table (``show(rows, matmul)``) and the verdict line; the exit code."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            json.dump(dict(matmul_tflops=matmul, cells=rows, passed=ok, note=note,
                           wall_s=time.perf_counter() - started), f, indent=1, default=str)
    show(rows, matmul)
    print(f"{'PASS' if ok else 'FAIL'}{note} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0 if ok else 1


def finish(rows: list, matmul: float, started: float, note: str = "") -> int:
    return report("train_ggu", rows, matmul, started, passed(rows), table, note)


def main() -> int:
    import triton

    dev = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
          flush=True)
    started, rows = time.perf_counter(), []
    matmul = bt.matmul_rate(dev)

    def out_of_time(*_):  # past the hard limit: the table of what ran, then exit
        sys.exit(finish(rows, matmul, started, " (hard time limit: later cells not run)"))

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(HARD_LIMIT_S)
    for m in BATCHES:  # every shape at the first batch (end to end), then the others while time is left
        for s in SHAPES:
            if time.perf_counter() - started > (SOFT_LIMIT_S if m == BATCHES[0] else SMALL_START_S):
                print(f"{s.name} M={m}: skipped (time limit)", flush=True)
                continue
            w = make_weights(s, torch.bfloat16, dev)
            rows.append(check_cell(s, m, w, dev, started, e2e=m == BATCHES[0]))
            del w
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    signal.alarm(0)
    return finish(rows, matmul, started)


if __name__ == "__main__":
    sys.exit(main())
