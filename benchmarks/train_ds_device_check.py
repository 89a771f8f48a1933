"""The training path at DeepSeek-V3 (then Mixtral) shapes, 16384 tokens, on the H200 (bf16): the persistent
weight-grad GEMM (``triton_wgrad``) and the forward on permuted rows (``triton_train_forward``) against the
current kernels, every variant in one run, then forward + backward with the winners against the current
default and transformers' ``grouped_mm`` autograd.

    PYTHONPATH=$PWD python benchmarks/train_ds_device_check.py          # the H200 run (< 100 s), $OUT/train_ds.json
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/train_ds_device_check.py --smoke   # CPU dry run

Per cell (uniform routing, TUNED's layout and grad tile; x and dout permuted, dh and w*g from the current
sorted grad_gate_up):
- dW13 (dh^T x_p, 4·A·N·K FLOPs) and dW2 (dout_p^T gw, 2·A·N·K): TUNED's tile and each of WEIGHT_VARIANTS,
  median ms, % of a bf16 ``torch.mm`` 8192³ timed in the same run, rel-L2 against TUNED's output and, on
  expert 0, against float32 torch (FAIL over 1e-2);
- dX before its k-sum (4·A·N·K): TUNED's gathering tile against DX_VARIANTS (dh in the layout's rows
  through TMA, ``triton_backward_sorted.dx_sorted``), rel-L2 against TUNED's;
- the forward: ``fused_experts`` (the inference forward, today's training forward) against the permuted
  one, gate-up (4·A·N·K) and down (2·A·N·K) GEMMs each alone over FWD13 / FWD2, and the whole of it with
  the best pair (its output against ``fused_experts``'s);
- forward + backward (autograd, loss = sum(out * dout)): ``experts_triton`` (the default now),
  ``experts_triton_train`` with the winners put into TUNED (the backward's, then with the forward too, then
  with ``BackwardOptions(recompute=False)``: the gate-up product kept from the forward, no recompute),
  transformers' grouped_mm; their grads against the default's (x, the routing weights, the first 8
  experts' weight grads), the peak memory of a step above the memory before it (the last step's grads
  included: it frees them first), two train steps bit-identical; then the winners' step stage by stage
  with % of mm.
Every variant in try/except (a tile Triton 3.6 refuses is recorded and skipped). A soft time limit skips
what is left; a hard one (HARD_LIMIT_S) prints what it has. A table last; exit 1 if a check fails.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import backward_tune as bt
import moekit.experts.triton_backward_launch as bl
import moekit.experts.triton_train_forward as tf
from backward_device_check import rel_l2
from train_ggu_device_check import failure, report
from train_ds_report import FLOPS, forward_pair, snapshot, stage_rows, table, verdict, winners_of
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts.triton_backward_launch import KernelTiles
from moekit.experts.triton_backward_sorted import dx_sorted, grad_gate_up_sorted

SMOKE = bt.SMOKE
SOFT_LIMIT_S, MIXTRAL_START_S, HARD_LIMIT_S = 80, 45, 97


def _p(rows, cols, red, stages, warps=8, group=8, flat=True) -> KernelTiles:
    """A persistent weight-grad tile: one program per SM, TMA loads and stores; ``flat`` one loop over tiles x steps."""
    if SMOKE:
        rows, cols, red, stages, warps, group = 16, 16, 16, 1, 1, 2
    return KernelTiles(cols, red, warps, stages, rows=rows, split=1, desc=True, contiguous=True, group=group,
                       persistent=1, store_desc=True, flat=flat)


def _f(cols, stages, warps=8) -> KernelTiles:
    """A forward tile on the permuted rows: 128 rows x ``cols``, 64-wide steps, TMA, 8 M-blocks per sweep."""
    if SMOKE:
        return KernelTiles(16, 16, 1, 1, rows=16, desc=True, contiguous=True, group=2)
    return KernelTiles(cols, 64, warps, stages, rows=128, desc=True, contiguous=True, group=8)


WEIGHT_VARIANTS = {
    "persist flat 128x256 k64 s3": _p(128, 256, 64, 3),
    "persist flat 256x128 k64 s3": _p(256, 128, 64, 3),
    "persist flat 128x256 k32 s6": _p(128, 256, 32, 6),
    "persist flat 128x256 k64 s3 g16": _p(128, 256, 64, 3, group=16),
    "persist flat 128x128 k64 s4": _p(128, 128, 64, 4),
    "persist nested 128x256 k64 s3": _p(128, 256, 64, 3, flat=False),
    "persist nested 256x128 k64 s3": _p(256, 128, 64, 3, flat=False),
}
DX_VARIANTS = {"dx sorted 128x128 s4": _f(128, 4), "dx sorted 128x256 w16 s3": _f(256, 3, warps=16),
               "dx sorted 128x256 w16 s4": _f(256, 4, warps=16), "dx sorted 128x256 s3": _f(256, 3)}
FWD13 = {"gu 128x128 s3": _f(128, 3), "gu 128x128 s4": _f(128, 4), "gu 128x64 s4": _f(64, 4),
         "gu 128x128 w16 s3": _f(128, 3, warps=16)}
FWD2 = {"down 128x128 s4": _f(128, 4), "down 128x256 w16 s3": _f(256, 3, warps=16),
        "down 128x256 w16 s4": _f(256, 4, warps=16), "down 128x128 s3": _f(128, 3)}
if SMOKE:  # the interpreter on a shared CPU: only the limits that stop a hung run
    SHAPES, M = [Shape("tiny", 4, 24, 48, 2)], 12
    SOFT_LIMIT_S, MIXTRAL_START_S, HARD_LIMIT_S = 1500, 1500, 1700
else:
    SHAPES, M = [Shape.from_preset("deepseek-v3"), Shape.from_preset("mixtral-8x7b")], 16384


class Cell:
    """One shape at M tokens: routing, x, dout, TUNED's tiles and layout, the permuted operands, dh and w*g."""

    def __init__(self, s: Shape, m: int, dev):
        self.s, self.a, self.dev = s, m * s.top_k, dev
        self.w = make_weights(s, torch.bfloat16, dev)
        r = uniform_routing(m, s, dev, seed=m)
        self.ids, self.weights = r.topk_ids, r.topk_weights
        g = torch.Generator(device=dev).manual_seed(m + 1)
        self.x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16, generator=g)
        self.dout = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16, generator=g)
        self.tiles = bl.backward_tiles(self.a, s.num_experts, s.n, torch.bfloat16, dev)
        if SMOKE:  # the H200's TUNED tiles are permuted ones; the CPU's heuristic is not
            wg = KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True)
            grad = KernelTiles(16, 16, 1, 1, rows=16, desc=True, contiguous=True)
            self.tiles = dataclasses.replace(self.tiles, grad=grad, dw13=wg, dw2=wg)
        self.layout = bl.align(self.ids, None, s.num_experts, self.tiles.block_m)
        self.x_p = bl.permute_rows(self.x, s.top_k, self.layout)
        self.dout_p = bl.permute_rows(self.dout, s.top_k, self.layout)
        self.flat_w = self.weights.reshape(-1).contiguous()
        self.dh, self.gw, _ = grad_gate_up_sorted(self.dout_p, self.x_p, self.w.w13, self.w.w2, self.flat_w,
                                                  self.layout, self.tiles.grad, "silu")

    def ms(self, fn, best: float = float("inf")) -> float:
        return bt.clock(fn, self.dev, best)


def _calls(cell: Cell) -> list:
    """A zero-argument call of every variant's kernels (the weight grads on both operand pairs, the forward GEMMs)."""
    s, w, layout = cell.s, cell.w, cell.layout
    g_p = torch.empty(cell.x_p.shape[0], s.n, dtype=cell.x.dtype, device=cell.dev)
    per_slot = torch.empty(cell.a, s.k, dtype=cell.x.dtype, device=cell.dev)
    calls = [lambda t=t, lr=lr: bl.weight_grad(*lr, s.num_experts, torch.bfloat16, layout, t)
             for t in WEIGHT_VARIANTS.values() for lr in ((cell.dh, 0, cell.x_p, 0), (cell.dout_p, 0, cell.gw, 0))]
    dx_out = torch.empty(cell.a, s.k, dtype=cell.dh.dtype, device=cell.dev)
    calls += [lambda t=t: dx_sorted(cell.dh, w.w13, dx_out, layout, t) for t in DX_VARIANTS.values()]
    calls += [lambda t=t: tf._gate_up(cell.x_p, w.w13, g_p, layout, t, "silu") for t in FWD13.values()]
    return calls + [lambda t=t: tf._down(g_p, w.w2, cell.flat_w, per_slot, layout, t) for t in FWD2.values()]


def precompile(cell: Cell) -> None:
    """Every variant's kernels compiled at once in a thread pool (``backward_tune._Warm``: nothing runs);
    without AsyncCompileMode they compile as they come."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    import moekit.experts.triton_backward_sorted as bs
    import moekit.experts.triton_wgrad as tw

    modules = (bl, bs, tw, tf)
    real = [m.kernels for m in modules]
    for m in modules:
        m.kernels = lambda name: bt._Warm(real[0](name))
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in _calls(cell):
                try:
                    call()
                except Exception as e:  # noqa: BLE001  (it fails again, and is reported, when timed)
                    print(f"precompile: {type(e).__name__}: {str(e)[:160]}", flush=True)
    except Exception as e:  # noqa: BLE001  (the rest compile as they come)
        print(f"precompile: {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        for m, k in zip(modules, real):
            m.kernels = k
    print(f"precompile: {time.perf_counter() - t0:.1f} s", flush=True)


def time_weight_grads(cell: Cell, mm: float, started: float) -> dict:
    """{dw13, dw2: rows}: TUNED's tile and WEIGHT_VARIANTS; ms, % of mm, rel-L2 to TUNED's and to torch on expert 0."""
    s, layout, out = cell.s, cell.layout, {}
    count = int(layout.counts[0])
    for kernel, (left, right) in {"dw13": (cell.dh, cell.x_p), "dw2": (cell.dout_p, cell.gw)}.items():
        work, rows = FLOPS[kernel] * cell.a * s.n * s.k, []
        call = (lambda t: lambda: bl.weight_grad(left, 0, right, 0, s.num_experts, torch.bfloat16, layout, t))
        reference = call(getattr(cell.tiles, kernel))()
        twin = left[:count].float().T @ right[:count].float()  # expert 0's rows come first
        for name, t in {"current (TUNED)": getattr(cell.tiles, kernel), **WEIGHT_VARIANTS}.items():
            row = dict(name=name, tile=dataclasses.asdict(t))
            if time.perf_counter() - started > SOFT_LIMIT_S:
                rows.append(dict(row, error="skipped: time limit"))
                continue
            try:
                fn = call(t)
                ms = cell.ms(fn, min([r["ms"] for r in rows if "ms" in r], default=float("inf")))
                got = fn()
                row.update(ms=ms, pct_mm=100 * work / ms / 1e9 / mm if mm else 0.0,
                           rel_current=rel_l2(got, reference), twin=rel_l2(got[0], twin))
                del got
            except Exception as e:  # noqa: BLE001  (out of resources, a tile this Triton refuses)
                row.update(failure(e, f"{s.name} {kernel} {name}"))
            rows.append(row)
        del reference
        out[kernel] = rows
    return out


def time_dx(cell: Cell, mm: float, started: float) -> list:
    """dX before its k-sum (dh_p @ W13, 4·A·N·K): TUNED's gathering tile against DX_VARIANTS (dh through TMA)."""
    s, w, layout = cell.s, cell.w, cell.layout
    per_slot = torch.empty(cell.a, s.k, device=cell.dev, dtype=cell.dh.dtype)
    bl.gather_gemm(cell.dh, 0, w.w13, 2, 1, per_slot, layout, cell.tiles.dx)
    reference, rows, work = per_slot.clone(), [], FLOPS["dx"] * cell.a * s.n * s.k
    plan = {"current (TUNED)": (cell.tiles.dx, lambda t: bl.gather_gemm(cell.dh, 0, w.w13, 2, 1, per_slot, layout, t))}
    plan.update({name: (t, lambda t: dx_sorted(cell.dh, w.w13, per_slot, layout, t)) for name, t in DX_VARIANTS.items()})
    for name, (t, call) in plan.items():
        row = dict(name=name, tile=dataclasses.asdict(t))
        if time.perf_counter() - started > SOFT_LIMIT_S:
            rows.append(dict(row, error="skipped: time limit"))
            continue
        try:
            per_slot.zero_()
            ms = cell.ms(lambda: call(t), min([r["ms"] for r in rows if "ms" in r], default=float("inf")))
            row.update(ms=ms, pct_mm=100 * work / ms / 1e9 / mm if mm else 0.0, rel_current=rel_l2(per_slot, reference))
        except Exception as e:  # noqa: BLE001
            row.update(failure(e, f"{s.name} dx {name}"))
        rows.append(row)
    return rows


def time_forward(cell: Cell, mm: float, started: float) -> dict:
    """The inference forward against the permuted one: each GEMM alone per tile, then the best pair whole."""
    from moekit.experts.triton import fused_experts

    s, w, layout = cell.s, cell.w, cell.layout
    ref = fused_experts(cell.x, w.w13, w.w2, cell.ids, cell.weights)
    result = dict(fused_ms=cell.ms(lambda: fused_experts(cell.x, w.w13, w.w2, cell.ids, cell.weights)))
    g_p = torch.empty(cell.x_p.shape[0], s.n, dtype=cell.x.dtype, device=cell.dev)
    per_slot = torch.empty(cell.a, s.k, dtype=cell.x.dtype, device=cell.dev)
    calls = {"fwd13": lambda t: lambda: tf._gate_up(cell.x_p, w.w13, g_p, layout, t, "silu"),
             "fwd2": lambda t: lambda: tf._down(g_p, w.w2, cell.flat_w, per_slot, layout, t)}
    for kernel, variants in (("fwd13", FWD13), ("fwd2", FWD2)):
        rows, work = [], FLOPS[kernel] * cell.a * s.n * s.k
        for name, t in variants.items():
            row = dict(name=name, tile=dataclasses.asdict(t))
            if time.perf_counter() - started > SOFT_LIMIT_S:
                rows.append(dict(row, error="skipped: time limit"))
                continue
            try:
                ms = cell.ms(calls[kernel](t), min([r["ms"] for r in rows if "ms" in r], default=float("inf")))
                row.update(ms=ms, pct_mm=100 * work / ms / 1e9 / mm if mm else 0.0)
            except Exception as e:  # noqa: BLE001
                row.update(failure(e, f"{s.name} {kernel} {name}"))
            rows.append(row)
        result[kernel] = rows
    best = {k: min((r for r in result[k] if "ms" in r), key=lambda r: r["ms"], default=None) for k in ("fwd13", "fwd2")}
    if None not in best.values():
        tiles = dataclasses.replace(cell.tiles, **{k: KernelTiles(**r["tile"]) for k, r in best.items()})
        run = (lambda: tf.sorted_forward(cell.x, w.w13, w.w2, cell.ids, cell.weights, None, "silu", tiles))
        result.update(sorted_ms=cell.ms(run), sorted_rel=rel_l2(run()[0], ref),
                      winners={k: r["name"] for k, r in best.items()})
    return result


def _step(fn, leaves, dout):
    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(leaves[0], leaves[3]).backward(dout)
    return step


def _peak_gib(step, dev) -> float:
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    if dev.type != "cuda":
        step()
        return 0.0
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    return (torch.cuda.max_memory_allocated(dev) - before) / 2**30


def end_to_end(cell: Cell, winners: dict, forward: dict) -> dict:
    """fwd + bwd ms, peak GiB and grads vs the default of: the default, the train op with the weight-grad
    winners, with the permuted forward's best pair too (``forward``, when it ran), and transformers' grouped_mm."""
    from moekit.experts.triton import experts_triton
    from moekit.experts.triton_backward import BackwardOptions, experts_triton_train

    s, w = cell.s, cell.w
    w13, w2 = torch.nn.Parameter(w.w13), torch.nn.Parameter(w.w2)
    leaves = [cell.x.detach().clone().requires_grad_(), w13, w2, cell.weights.clone().requires_grad_()]
    key = bl.shape_class(cell.a, s.num_experts, s.n)
    train = (lambda x, wt: experts_triton_train(x, w13, w2, cell.ids, wt))
    impls = {"default (experts_triton)": (None, lambda x, wt: experts_triton(x, w13, w2, cell.ids, wt)),
             "train: backward winners": (dataclasses.replace(cell.tiles, **winners), train)}
    if forward:
        impls["train: + permuted forward"] = (dataclasses.replace(cell.tiles, **winners, **forward), train)
    impls["train: h kept, no recompute"] = (dataclasses.replace(cell.tiles, **winners), lambda x, wt: experts_triton_train(
        x, w13, w2, cell.ids, wt, backward=BackwardOptions(recompute=False)))
    hf = bt.hf_grouped_mm(s, w13, w2)
    if hf is not None:
        impls["transformers grouped_mm"] = (None, lambda x, wt: hf(x, cell.ids, wt))
    out, ref, saved = {}, None, dict(bl.TUNED)
    for name, (tiles, fn) in impls.items():
        try:
            bl.TUNED[key] = tiles if tiles is not None else cell.tiles
            step = _step(fn, leaves, cell.dout)
            row = dict(ms=cell.ms(step), peak_gib=_peak_gib(step, cell.dev))
            grads = [snapshot(leaf.grad) for leaf in leaves]
            if ref is None:
                ref = grads
            row["rel_vs_default"] = max(rel_l2(g, r) for g, r in zip(grads, ref) if g is not None)
            if name.startswith("train"):
                step()
                row["deterministic"] = all(torch.equal(g, snapshot(leaf.grad)) for g, leaf in zip(grads, leaves)
                                           if g is not None)
            del grads
        except Exception as e:  # noqa: BLE001
            row = failure(e, f"{s.name} e2e {name}")
        out[name] = row
    bl.TUNED.clear()
    bl.TUNED.update(saved)
    for leaf in leaves:
        leaf.grad = None
    return out


def stages(cell: Cell, winners: dict) -> dict:
    """ms of each stage of one step with the winners (the forward permuted when it won)."""
    from moekit.experts.triton import fused_experts

    s, w, layout, t = cell.s, cell.w, cell.layout, dataclasses.replace(cell.tiles, **winners)
    per_slot = torch.empty(cell.a, s.k, device=cell.dev, dtype=cell.dh.dtype)
    plan = {
        "forward": (lambda: tf.sorted_forward(cell.x, w.w13, w.w2, cell.ids, cell.weights, None, "silu", t))
        if t.fwd13 else (lambda: fused_experts(cell.x, w.w13, w.w2, cell.ids, cell.weights)),
        "align": lambda: bl.align(cell.ids, None, s.num_experts, t.block_m),
        "permute dout (+x)": lambda: [bl.permute_rows(v, s.top_k, layout) for v in ((cell.dout,) if t.fwd13 else (
            cell.dout, cell.x))],
        "grad_gate_up": lambda: grad_gate_up_sorted(cell.dout_p, cell.x_p, w.w13, w.w2, cell.flat_w, layout, t.grad,
                                                    "silu"),
        "dx": (lambda: dx_sorted(cell.dh, w.w13, per_slot, layout, t.dx)) if t.dx.contiguous else (
            lambda: bl.gather_gemm(cell.dh, 0, w.w13, 2, 1, per_slot, layout, t.dx)),
        "dx k-sum": lambda: bl.sum_slots(per_slot, cell.ids, None, s.num_experts, cell.x.dtype),
        "dw13": lambda: bl.weight_grad(cell.dh, 0, cell.x_p, 0, s.num_experts, torch.bfloat16, layout, t.dw13),
        "dw2": lambda: bl.weight_grad(cell.dout_p, 0, cell.gw, 0, s.num_experts, torch.bfloat16, layout, t.dw2),
    }
    return {name: cell.ms(fn) for name, fn in plan.items()}


def check_cell(s: Shape, dev, mm: float, started: float) -> dict:
    cell = Cell(s, M, dev)
    row = dict(shape=s.name, m=M, shape_class=bl.shape_class(cell.a, s.num_experts, s.n), ank=cell.a * s.n * s.k)
    precompile(cell)
    row["weight_grads"] = time_weight_grads(cell, mm, started)
    row["dx"] = time_dx(cell, mm, started)
    row["forward"] = time_forward(cell, mm, started)
    winners, pair = winners_of(row["weight_grads"], row["dx"]), forward_pair(row["forward"])
    row["winners"] = {k: repr(v) for k, v in {**winners, **pair}.items()}
    if time.perf_counter() - started < SOFT_LIMIT_S:
        row["e2e"] = e2e = end_to_end(cell, winners, pair)
        ms = {name: r.get("ms", float("inf")) for name, r in e2e.items()}
        use = pair if ms.get("train: + permuted forward", float("inf")) < ms.get("train: backward winners") else {}
        row["stages"] = stage_rows(stages(cell, {**winners, **use}), cell.a * s.n * s.k, mm)
    print(f"{s.name}: winners {row['winners']} ({time.perf_counter() - started:.0f} s)", flush=True)
    return row


def finish(rows: list, mm: float, started: float, note: str = "") -> int:
    return report("train_ds", rows, mm, started, verdict(rows), table, note)


def main() -> int:
    import triton

    dev = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
          flush=True)
    started, rows = time.perf_counter(), []
    mm = bt.matmul_rate(dev)
    print(f"bf16 mm {mm:.0f} TFLOP/s", flush=True)

    def out_of_time(*_):
        sys.exit(finish(rows, mm, started, " (hard time limit: the rest not run)"))

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(HARD_LIMIT_S)
    for i, s in enumerate(SHAPES):
        if i and time.perf_counter() - started > MIXTRAL_START_S:
            print(f"{s.name}: skipped (time limit)", flush=True)
            continue
        try:
            rows.append(check_cell(s, dev, mm, started))
        except Exception as e:  # noqa: BLE001  (out of memory, ...): the table of what ran still prints
            rows.append(dict(shape=s.name, m=M, **failure(e, s.name)))
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    signal.alarm(0)
    return finish(rows, mm, started)


if __name__ == "__main__":
    sys.exit(main())
