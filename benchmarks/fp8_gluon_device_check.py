"""The fp8 block-scaled Gluon path (``moekit.experts.triton_gluon_fp8``) against the Triton fp8 kernels, on the device.

    PYTHONPATH=$PWD python benchmarks/fp8_gluon_device_check.py --budget 140   # JSON to $OUT/fp8_gluon.json
    PYTHONPATH=$PWD python benchmarks/fp8_gluon_device_check.py --smoke        # CPU: interpreter + sm_90 compile

Per preset (Qwen3-30B-A3B E=128 N=768 K=2048 k=8, DeepSeek-V3 E=256 N=2048 K=7168 k=8, Mixtral-8x7B E=8
N=14336 K=4096 k=2) and M in 1024, 4096, 16384, bf16 x, uniform routing, e4m3 weights with 128 x 128 block
scales (``fp8_device_check.quantize_blocks`` of random bf16 weights):
  1. correctness of every variant against the torch twin (``experts_gluon_fp8_twin``: ``fused_experts_fp8_torch``
     with y rounded to bf16 like the kernels), rel L2 < 2e-2 (the fp8 checks' tolerance);
  2. whole-call µs (median of CUDA-graph replays, ``moekit.bench.timing``; eager too for the two fp8 paths:
     their host cost shows as the difference) of: the Triton fp8 path (its plan, another config), the Gluon
     fp8 path, the ``triton_gluon`` backend on fp8_block weights (its ``Fp8GluonChoice`` picks one of the two),
     moekit's bf16 Triton and bf16 Gluon paths on the unquantized weights; the fp8 floor (max(bytes / copy BW, FLOPs /
     fp8 mm rate)) and % of the fp8 mm rate (``torch._scaled_mm`` 8192^3 e4m3, measured in this run);
  3. the Gluon fp8 GEMMs alone (gate-up, down: µs, % of fp8 mm) and pipeline variants of each (stages,
     GROUP_M, consumer registers), at M = 4096 only.
Every variant runs in try/except (a failure prints its last lines and the run goes on). Canary subprocesses
(``fp8_gluon_canary``) run the Gluon fp8 path once first and compile the rest, while the weights are built:
if its canary hangs past CANARY_TIMEOUT_S, crashes or fails, the Gluon variants are skipped here. (The Triton
fp8 kernels' K loop under ``tl.range(..., warp_specialize=True)`` was a candidate of the first run: Triton
3.6 fails to compile it, ``PassManager::run failed`` in make_ttgir.)
M is the outer loop (4096, 1024, 16384); cells not started by --budget seconds are skipped; the JSON is
rewritten after each cell. Tables last. Exit 1 when a correctness check of the Gluon or Triton fp8 paths fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

T0 = time.perf_counter()
PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (4096, 1024, 16384)  # in this order (M=4096 matters most)
VARIANT_BATCH = 4096  # the GEMM variants are timed at this M only
TOLERANCE = 2e-2
TRITON_CONFIGS = {  # name: (BLOCK_M, up (BN, warps, stages), down (BN, warps, stages)), BLOCK_K 128, GROUP_M 8
    "triton_fp8 p128 8w/3+8w/4": (128, (128, 8, 3), (128, 8, 4)),
}
_SHARED_VARIANTS = (("stages-1", None), ("group_m=1", {"group_m": 1}), ("group_m=32", {"group_m": 32}),
                    ("regs 168/232", {"max_registers": 168, "consumer_regs": 232}), ("stagger", {"stagger": True}))
GEMM_VARIANTS = {"gate-up": _SHARED_VARIANTS, "down": _SHARED_VARIANTS + (("pingpong", {"pingpong": True}),)}
FAILED: list[str] = []
NOTES: list[str] = []
KERNEL_INFO: dict = {}  # GEMM -> kernel_info of its first compile (printed, in the JSON)


def elapsed() -> float:
    return time.perf_counter() - T0


@dataclass
class Cell:
    shape: str
    M: int
    floor_us: float
    flops: float
    us: dict = field(default_factory=dict)  # variant -> µs (None: failed)
    err: dict = field(default_factory=dict)  # variant -> rel L2 vs the twin
    gemm_us: dict = field(default_factory=dict)  # "gate-up" / "down" (+ variants) -> µs


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(out.isfinite().all()):
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def time_us(fn, dev, budget_s: float = 0.15, graph: bool = True) -> float:
    """Median µs per call: CUDA-graph replays (the GPU's time; eager where capture fails), or eager calls."""
    from moekit.bench.timing import time_calls

    if graph and dev.type == "cuda":
        try:
            return time_calls([fn], dev, graph=True, budget_s=budget_s, max_reps=20)
        except Exception as exc:  # noqa: BLE001 (a path that cannot be captured is timed eagerly, and said so)
            NOTES.append(f"graph capture failed ({type(exc).__name__}: {str(exc)[:80]}): timed eagerly")
    return time_calls([fn], dev, budget_s=budget_s, max_reps=20)


def guarded(name: str, fn, *args):
    """fn(*args), or None with the error's last lines printed (the run goes on)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 (one variant's failure must not end the run)
        lines = traceback.format_exc().strip().splitlines()
        print(f"ERROR {name} [{elapsed():.0f} s]:\n    " + "\n    ".join(lines[-12:]), flush=True)
        NOTES.append(f"{name}: {lines[-1][:200]}")
        return None


def triton_config(spec):
    from moekit.experts.configs import GemmTile, KernelConfig

    block_m, up, down = spec
    return KernelConfig(block_m, GemmTile(up[0], 128, 8, up[1], up[2]), GemmTile(down[0], 128, 8, down[1], down[2]))


def fp8_weights(q):
    """(w13, w2) as ``fp8_block`` QuantizedWeights (what a model hands the ``triton_gluon`` backend)."""
    from moekit.quant.fp8_block import Fp8BlockWeight

    return (Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128)),
            Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128)))


def variants(x, w, q, ids, rw, dev, smoke: bool) -> dict:
    """name -> zero-argument call returning [M, K] (the bf16 ones on the unquantized weights)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch
    from moekit.experts.triton_gluon import experts_gluon, experts_triton_gluon
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    calls = {"triton_fp8": lambda: fused_experts_fp8_launch(x, *q, ids, rw)}
    for name, spec in TRITON_CONFIGS.items():
        calls[name] = lambda spec=spec: fused_experts_fp8_launch(x, *q, ids, rw, config=triton_config(spec))
    if not smoke:
        if CANARY_OK["gluon"]:
            calls["gluon_fp8"] = lambda: experts_gluon_fp8(x, *q, ids, rw)
            calls["triton_gluon backend"] = lambda: experts_triton_gluon(x, *fp8_weights(q), ids, rw)
        calls["bf16 triton"] = lambda: run_experts(x, w.w13, w.w2, ids, rw, backend="triton")
        calls["bf16 gluon"] = lambda: experts_gluon(x, w.w13, w.w2, ids, rw)
    return calls


def gemm_times(cell: Cell, x, q, ids, s, dev, with_variants: bool) -> None:
    """The Gluon fp8 GEMMs alone, the plan's pipelines and (with_variants) GEMM_VARIANTS of each."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import launch_gemm_fp8, plan_gluon_fp8

    w13_q, w13_s, w2_q, w2_s = q
    plan = plan_gluon_fp8(x.shape[0], s.top_k, s.num_experts, s.k)
    lay = gluon_fp8_layout(x, ids, s.num_experts)
    rows = lay.x_q.shape[0]
    h_q = torch.empty(rows, s.n, device=dev, dtype=torch.float8_e4m3fn)
    h_s = torch.empty(rows, s.n // 128, device=dev, dtype=torch.float32)
    y = torch.empty(rows, s.k, device=dev, dtype=x.dtype)
    up = lambda t: launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts,  # noqa: E731
                                   lay.rows_used, t, True, s.n)
    down = lambda t: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, lay.block_experts,  # noqa: E731
                                     lay.rows_used, t, False)
    for gemm, run, base in (("gate-up", up, plan.up), ("down", down, plan.down)):
        if gemm not in KERNEL_INFO:
            KERNEL_INFO[gemm] = guarded(f"{gemm} kernel info", lambda: kernel_info(run(base)))
    cell.gemm_us["layout"] = guarded("layout", time_us, lambda: gluon_fp8_layout(x, ids, s.num_experts), dev)
    for gemm, run, base in (("gate-up", up, plan.up), ("down", down, plan.down)):
        cell.gemm_us[gemm] = guarded(f"{s.name} M={cell.M} {gemm}", time_us, lambda: run(base), dev)
        for name, fields in GEMM_VARIANTS[gemm] if with_variants else ():
            tile = replace(base, stages=base.stages - 1) if fields is None else replace(base, **fields)
            cell.gemm_us[f"{gemm} {name}"] = guarded(f"{s.name} M={cell.M} {gemm} {name}", time_us,
                                                     lambda: run(tile), dev)


def kernel_info(compiled) -> dict:
    """Registers, spills, SMEM and the partitions' setmaxnreg of a compiled Gluon kernel."""
    ptx = compiled.asm.get("ptx", "")
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    return dict(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None),
                shared=compiled.metadata.shared, setmaxnreg=regs, local_ld=ptx.count("ld.local"),
                local_st=ptx.count("st.local"))


def run_cell(s, m: int, w, q, ceil, dev, smoke: bool) -> Cell:
    from fp8_device_check import floor_us
    from moekit.bench.cells import measured_experts_touched, uniform_routing
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    routing = uniform_routing(m, s, dev, seed=m)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    flops = 6.0 * m * s.top_k * s.n * s.k
    floor = floor_us(s, m, measured_experts_touched(ids, s.num_experts), ceil) if ceil is not None else 0.0
    cell = Cell(s.name, m, floor, flops)
    twin = experts_gluon_fp8_twin(x, *q, ids, rw)
    for name, call in variants(x, w, q, ids, rw, dev, smoke).items():
        if elapsed() > BUDGET_S:
            NOTES.append(f"{s.name} M={m} {name}: skipped (past the budget)")
            continue
        out = guarded(f"{s.name} M={m} {name}", call)
        if out is None:
            cell.us[name] = None
            if not name.startswith("bf16"):
                FAILED.append(f"{s.name} M={m} {name} (raised)")
            continue
        err = rel_l2(out, twin)
        cell.err[name] = err
        if not name.startswith("bf16") and not err < TOLERANCE:
            FAILED.append(f"{s.name} M={m} {name} err {err:.2e}")
        if not smoke:
            cell.us[name] = guarded(f"time {name}", time_us, call, dev)
            if name in ("triton_fp8", "gluon_fp8"):
                cell.us[f"{name} eager"] = guarded(f"time {name} eager", time_us, call, dev, 0.15, False)
        print(f"{'PASS' if err < TOLERANCE else ('info' if name.startswith('bf16') else 'FAIL')} {s.name} M={m} "
              f"{name}: err vs twin {err:.2e}, {cell.us.get(name) or 0:.0f} us [{elapsed():.0f} s]", flush=True)
    if not smoke and CANARY_OK["gluon"] and elapsed() < BUDGET_S:
        gemm_times(cell, x, q, ids, s, dev, with_variants=m == VARIANT_BATCH and CANARY_OK["gluon-variants"]
                   and elapsed() < 0.75 * BUDGET_S)
    return cell


def smoke_checks() -> None:
    """CPU: the gather-quantize kernel (interpreted) against torch; the Gluon fp8 GEMM compiled for sm_90."""
    from moekit.layouts.block_aligned import align_block
    from moekit.experts.triton_fp8 import quantize_groups
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout

    x = torch.randn(40, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (40, 2))
    lay = gluon_fp8_layout(x, ids, 4, align=align_block)
    dst = lay.src_to_dst.reshape(-1).long()
    q, scale = quantize_groups(x[torch.arange(80) // 2], 128)
    ok = torch.equal(lay.x_q[dst], q.float()) and torch.equal(lay.x_s[dst], scale)
    print(f"{'PASS' if ok else 'FAIL'} gather-quantize kernel == quantize_groups of the gathered rows")
    if not ok:
        FAILED.append("gather-quantize")
    ok, text = compile_check_subprocess()
    print(("PASS" if ok else "FAIL") + " sm_90 compile of the Gluon fp8 GEMMs:\n    " + text.replace("\n", "\n    "))
    if not ok:
        FAILED.append("sm_90 compile")


def compile_check_subprocess() -> tuple[bool, str]:
    """``gluon_fp8_compile_cpu`` in a process without the interpreter (an interpreted kernel leaves Triton's
    frontend patched for this process: a compile here would fail whenever it is not in the disk cache)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("gluon_fp8_compile_cpu.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith(("OK", "FAIL"))]
    return done.returncode == 0 and bool(lines), "\n".join(lines) or (done.stdout + done.stderr)[-2000:]


def print_table(cells: list[Cell], ceil) -> None:
    mm = ceil.fp8_mm_TFLOPs if ceil is not None else None
    print("\nNotes:", *NOTES, sep="\n  ")
    print(f"\nfp8 mm 8192^3: {mm or 0:.0f} TFLOP/s; copy {ceil.copy_TBps if ceil else 0:.2f} TB/s. "
          "us = median per call; '% mm' = FLOPs/us of the fp8 mm rate; '% floor' = floor/us.")
    order = ("triton_fp8", "gluon_fp8", "bf16")
    names = sorted({n for c in cells for n in (*c.us, *c.err)},
                   key=lambda n: (next((i for i, p in enumerate(order) if n.startswith(p)), 3), n))
    print("| shape | M | floor us | " + " | ".join(names) + " | gluon vs triton_fp8 | gluon gate-up / down us (% mm) |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|")
    for c in cells:
        parts = []
        for n in names:
            us = c.us.get(n)
            if us is None:
                parts.append(f"err {c.err[n]:.1e}" if n in c.err else ("fail" if n in c.us else "-"))
                continue
            pct_mm = 100 * c.flops / us / 1e6 / mm if mm else 0.0
            parts.append(f"{us:.0f} ({pct_mm:.0f}% mm, {100 * c.floor_us / us:.0f}% fl)")
        g = " / ".join(f"{c.gemm_us.get(k) or 0:.0f} ({100 * share * c.flops / c.gemm_us[k] / 1e6 / mm:.0f}%)"
                       if c.gemm_us.get(k) and mm else "-" for k, share in (("gate-up", 2 / 3), ("down", 1 / 3)))
        tri, glu = c.us.get("triton_fp8"), c.us.get("gluon_fp8")
        speed = f"{tri / glu:.2f}x" if tri and glu else "-"
        print(f"| {c.shape} | {c.M} | {c.floor_us:.0f} | " + " | ".join(parts) + f" | {speed} | {g} |")
    print("\nGluon fp8 kernels:", *(f"{k}: {v}" for k, v in KERNEL_INFO.items()), sep="\n  ")
    print("\nGluon fp8 GEMM variants (us):")
    for c in cells:
        if len(c.gemm_us) > 3:
            print(f"  {c.shape} M={c.M}: " + "; ".join(f"{k} {v or 0:.0f}" for k, v in c.gemm_us.items()))


CANARY_TIMEOUT_S = 75.0  # from the start: a canary still running then is killed (its verdicts so far count)


def save(cells: list[Cell], ceil) -> None:
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_gluon.json").write_text(json.dumps(
            {"ceilings": asdict(ceil) if ceil else None, "cells": [asdict(c) for c in cells], "failed": FAILED,
             "notes": NOTES, "kernels": KERNEL_INFO}, indent=1))


def main() -> int:
    global BUDGET_S
    smoke = "--smoke" in sys.argv
    BUDGET_S = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 140.0
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import fp8_gluon_canary

    procs = {kind: fp8_gluon_canary.start(kind) for kind in fp8_gluon_canary.KINDS}  # run meanwhile
    import triton

    from fp8_device_check import measure_ceilings, quantize_blocks
    from moekit.bench.cells import Shape, make_weights

    dev = torch.device("cpu" if smoke else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the twin's float32 GEMMs stay float32
    print(f"torch {torch.__version__}, triton {triton.__version__}, budget {BUDGET_S:.0f} s", flush=True)
    if smoke:
        smoke_checks()
    held = {}  # every preset's weights stay (~40 GB bf16 + e4m3): M is the outer loop, the M=4096 cells first
    for preset in PRESETS:
        real = Shape.from_preset(preset)
        s = Shape(f"{preset}/smoke", min(real.num_experts, 8), 128, 256, real.top_k) if smoke else real
        w = make_weights(s, torch.bfloat16, dev)
        held[preset] = (s, w, (*quantize_blocks(w.w13), *quantize_blocks(w.w2)))
    for kind, proc in procs.items():  # all finished (or killed) before anything is timed
        lines, ended = fp8_gluon_canary.finish(proc, T0 + CANARY_TIMEOUT_S)
        print(f"canary {kind}: {ended} [{elapsed():.0f} s]", flush=True)
        for line in (ln for ln in lines if ln.startswith("CANARY wrong")):  # e.g. a GEMM variant off the twin
            print(f"  {line}", flush=True)
            NOTES.append(line)
        for name in {"gluon": ("gluon", "gluon-variants")}.get(kind, ()):
            CANARY_OK[name], line = fp8_gluon_canary.verdict(name, lines, ended)
            print(f"  {line}", flush=True)
            if not CANARY_OK[name]:
                NOTES.append(line)
                if name == "gluon":  # the variants' own line is a note only
                    FAILED.append("gluon canary")
                    print("    " + "\n    ".join(lines[-12:]), flush=True)
    ceil = None if smoke else measure_ceilings(dev)  # after the canary: nothing else on the GPU while timing
    cells = []
    for m in ((24,) if smoke else BATCHES):
        for preset in PRESETS:
            if elapsed() > BUDGET_S:
                NOTES.append(f"{preset} M={m}: skipped (past the budget)")
                continue
            s, w, q = held[preset]
            cell = guarded(f"cell {preset} M={m}", run_cell, s, m, w, q, ceil, dev, smoke)
            if cell is None:
                FAILED.append(f"{preset} M={m} (cell raised)")
            else:
                cells.append(cell)
            save(cells, ceil)
    print_table(cells, ceil)
    print(f"\n{'FAILED: ' + '; '.join(FAILED) if FAILED else 'all checks passed'} ({elapsed():.0f} s)")
    return 1 if FAILED else 0


BUDGET_S = 140.0
CANARY_OK = {"gluon": False, "gluon-variants": False}  # the canary's verdicts: what runs here

if __name__ == "__main__":
    sys.exit(main())
