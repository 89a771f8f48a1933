"""Tune the Triton experts backward's tiles on the H200 (bf16), one kernel at a time, and time the whole
forward + backward with the winners.

    PYTHONPATH=. python benchmarks/backward_tune.py            # the H200 run (< 4 min), JSON to $OUT/backward_tune.json
    PYTHONPATH=. python benchmarks/backward_tune.py --presets mixtral-8x7b --batches 16384   # a part of it
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/backward_tune.py --smoke   # CPU dry run of this script

Cells: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B expert shapes (``moekit.bench.cells`` presets) at M =
4096 and 16384 tokens, uniform routing. Per cell and layout block (BLOCK_M 64, 128), each backward GEMM
alone over its candidate tiles (``candidates``; a tile whose pipeline buffers exceed the shared memory
is skipped, one that fails to launch is recorded):
- grad_gate_up (dY @ W2 with the gate-up recompute, 6·A·N·K FLOPs), TMA weight descriptors on/off;
- gather_gemm, dX's dh @ W13 (4·A·N·K), descriptors on/off;
- weight_grad dW13 = dh^T x (4·A·N·K) and dW2 = dout^T (w g) (2·A·N·K), tiles 128x128 / 128x256 /
  256x128, split over M as ``choose_split`` says (1 at these shapes: the fp32 partials would pass
  its 1 GiB and every grid has > 10k programs) or forced 2 ways where the partials stay under 4 GiB;
  and the contiguous kernel (operands permuted into the layout's rows, TMA loads; the permutations
  timed with it, though in ``experts_backward`` grad_gate_up writes dh and w*g that way already).
Each against a dense ``torch.mm`` of the same FLOPs timed in the same run. CUDA events, median of
REPEATS after a warm-up (not repeated when 3x the best so far). Candidates compile up front in a thread pool.

The best BackwardTiles per cell (the block whose best kernels sum lowest; its grads checked against
the heuristic's), then forward + backward (``fused_experts`` + ``experts_backward``) with them vs the
heuristic (``backward_tiles``) vs moekit's autograd path vs transformers' ``grouped_mm_experts_forward``
autograd (else moekit's torch._grouped_mm). Last: a table, and the ``TUNED`` entries to paste into
``moekit/experts/triton_backward_launch.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

import moekit.experts.triton_backward_launch as bl
from moekit.bench.cells import PRESETS, Shape, make_weights, uniform_routing
from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles, shape_class
from moekit.experts.triton_launch import max_shared_memory
from backward_device_check import one_call_ms, rel_l2
from backward_tune_report import KERNELS, WEIGHT_KERNELS, heuristic_rows, table

SMOKE = "--smoke" in sys.argv
FLOPS_PER_ANK = {"grad": 6, "dx": 4, "dw13": 4, "dw2": 2}  # a kernel's FLOPs / (A N K)
SPLIT_BYTES = 4 << 30  # a forced split's fp32 partials stay under this
if SMOKE:  # tiny shapes and tiles, one repeat: only checks that this script runs
    SHAPES, BATCHES, BLOCKS, REPEATS = [Shape("tiny", 4, 24, 48, 2)], (12,), (16,), 1
else:
    SHAPES = [Shape.from_preset(p) for p in PRESETS]  # qwen3-30b-a3b, deepseek-v3, mixtral-8x7b
    BATCHES, BLOCKS, REPEATS = (4096, 16384), (64, 128), 3


def candidates(kernel: str) -> list[KernelTiles]:
    """The tiles a kernel is tried with (at each layout block)."""
    if SMOKE:
        if kernel in ("grad", "dx"):
            return [KernelTiles(16, 16, 1, 1, desc=d) for d in (False, True)]
        return [KernelTiles(16, 16, 1, 1, rows=16, split=s) for s in (0, 1)] + [
            KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True, group=2)]
    if kernel == "grad":
        pairs = ((64, 64), (128, 64), (64, 128))
    elif kernel == "dx":
        pairs = ((128, 64), (256, 64), (128, 128))
    else:  # weight_grad: (rows, cols) output tiles; gathering: row steps of 64 or 128, split chosen or 2 ways;
        # contiguous (TMA, 8 row tiles grouped): steps of 64, 3-5 stages
        tiles = ((128, 128), (128, 256), (256, 128))
        return [KernelTiles(c, red, w, st, rows=r, split=sp)
                for r, c in tiles for red in (64, 128)
                for w in ((4, 8) if r * c <= 128 * 128 else (8,)) for st in (3, 4) for sp in (0, 2)] + [
            KernelTiles(c, 64, 8, st, rows=r, split=1, desc=True, contiguous=True, group=8)
            for r, c in tiles for st in ((3, 4, 5) if r * c <= 128 * 128 else (3, 4))]
    return [KernelTiles(c, red, w, st, desc=d) for c,
            red in pairs for w in (4, 8) for st in (3, 4) for d in (False, True)]


def shared_bytes(kernel: str, block_m: int, t: KernelTiles) -> int:
    """The pipeline's bf16 operand buffers: num_stages with TMA descriptors, at most num_stages - 1 with
    pointer loads (compiled for sm_90 by Triton 3.9, 16-divisible strides: grad_gate_up 128x64x64 3
    stages 112 KB, with descriptors 168 KB; gather_gemm 128x128x64 4 stages 80 KB, descriptors 128 KB).
    A candidate over the device's shared memory is not compiled; one this misjudges fails to launch
    and is recorded."""
    if kernel == "grad":  # dout and x [BM, BK], w2, gate and up [BK, BN]
        per_stage = 2 * block_m * t.red + 3 * t.red * t.cols
    elif kernel == "dx":
        per_stage = block_m * t.red + t.red * t.cols
    else:
        per_stage = t.red * (t.rows + t.cols)
    return 2 * per_stage * (t.num_stages if t.desc else max(t.num_stages - 1, 1))


class Cell:
    """One (shape, M): its inputs, and per layout block its layout and the kernels' operands."""

    def __init__(self, s: Shape, m: int, w, dev):
        self.s, self.m, self.w, self.a = s, m, w, m * s.top_k
        r = uniform_routing(m, s, dev, seed=m)
        self.ids, self.weights = r.topk_ids, r.topk_weights
        g = torch.Generator(device=dev).manual_seed(m + 1)
        self.x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16, generator=g)
        self.dout = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16, generator=g)
        self.layouts = {bm: bl.align(self.ids, None, s.num_experts, bm) for bm in BLOCKS}
        heuristic = bl.backward_tiles(self.a, s.num_experts, s.n, torch.bfloat16, dev).grad
        self.dh, self.gw, _ = self.call("grad", BLOCKS[0], heuristic)()  # dX's and the weight grads' operands
        self.per_slot = torch.empty(self.a, s.k, device=dev, dtype=self.dh.dtype)

    def call(self, kernel: str, block_m: int, t: KernelTiles):
        """A zero-argument call of one backward kernel with tile ``t`` over the block_m layout."""
        s, w, layout, k = self.s, self.w, self.layouts[block_m], self.s.top_k
        if kernel == "grad":
            return lambda: bl.grad_gate_up(self.dout, self.x, w.w13, w.w2, self.weights.reshape(-1), layout, t,
                                           "silu")
        if kernel == "dx":
            return lambda: bl.gather_gemm(self.dh, 1, w.w13, 2, 1, self.per_slot, layout, t)
        if kernel in WEIGHT_KERNELS and t.split > 1:  # the split's fp32 partials [split, E, R, C]
            partials = t.split * s.num_experts * s.n * s.k * (2 if kernel == "dw13" else 1) * 4
            if partials > SPLIT_BYTES:
                raise ValueError(f"skipped: split {t.split} partials {partials / 2**30:.1f} GiB")
        if kernel == "dw13":
            return lambda: bl.weight_grad(self.dh, 1, self.x, k, s.num_experts, torch.bfloat16, layout, t)
        return lambda: bl.weight_grad(self.dout, k, self.gw, 1, s.num_experts, torch.bfloat16, layout, t)

    def dense(self, kernel: str, dev):
        """The dense twin: a torch.mm of the kernel's FLOPs, on operands of its shapes."""
        a, n, k = self.a, self.s.n, self.s.k
        dims = {"grad": (a, k, 3 * n), "dx": (a, 2 * n, k), "dw13": (2 * n, a, k), "dw2": (k, a, n)}[kernel]
        lhs = torch.randn(dims[0], dims[1], device=dev, dtype=torch.bfloat16)
        rhs = torch.randn(dims[1], dims[2], device=dev, dtype=torch.bfloat16)
        return lambda: torch.mm(lhs, rhs)


class _Warm:
    """A kernel module, or one kernel, whose ``kernel[grid](...)`` submits the compile and runs nothing."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return _Warm(getattr(self.target, name))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.target.warmup(*args, grid=grid, **kwargs)


def precompile(cells: list[Cell], plan: dict) -> None:
    """Submit every candidate's compile at once (``kernel.warmup`` under AsyncCompileMode, through a
    stand-in for the launch module's ``kernels``: nothing runs); without AsyncCompileMode the
    candidates compile as they come."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    real, failed = bl.kernels, []
    bl.kernels = lambda name: _Warm(real(name))
    try:
        # ignore_errors: a failing compile must not leave the mode active (its __exit__ raises before
        # resetting it, and every later compile then goes to the shut-down pool); it fails again on use
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for cell in cells:
                for (kernel, block_m), tiles in plan.items():
                    for t in tiles:
                        try:
                            cell.call(kernel, block_m, t)()
                        except Exception as e:  # noqa: BLE001  (skipped, or compiles and reports on first use)
                            failed.append(f"{kernel} {t}: {type(e).__name__}: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001  (the rest compile, and report, on first use)
        failed.append(f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        bl.kernels = real
    skipped = sum("skipped" in f for f in failed)
    print(f"precompile: {skipped} skipped, {len(failed) - skipped} failed" + "".join(
        f"\n  {f}" for f in failed if "skipped" not in f)[:2000], flush=True)


def clock(fn, dev, best_ms: float = float("inf")) -> float:
    """Median ms of fn over REPEATS calls after one warm-up; the first call's time alone when it took
    over 3x ``best_ms`` (a loser: not worth the repeats)."""
    fn()
    samples = []
    for i in range(REPEATS):
        ms = one_call_ms(dev, fn)
        if i == 0 and ms > 3 * best_ms:
            return ms
        samples.append(ms)
    return statistics.median(samples)


def time_kernels(cell: Cell, plan: dict, dev) -> dict:
    """{kernel: {"dense_tflops", "rows": [{block_m, tile, ms, tflops, pct_dense} or error]}} of one cell."""
    out = {}
    for kernel in KERNELS:
        work = FLOPS_PER_ANK[kernel] * cell.a * cell.s.n * cell.s.k
        dense_ms = clock(cell.dense(kernel, dev), dev)
        rows, best = [], float("inf")
        for block_m in layout_blocks(kernel):
            for t in plan[(kernel, block_m)]:
                row = dict(block_m=block_m, tile=asdict(t))
                try:
                    ms = clock(cell.call(kernel, block_m, t), dev, best)
                    row.update(ms=ms, tflops=work / ms / 1e9, pct_dense=100 * dense_ms / ms)
                    best = min(best, ms)
                except Exception as e:  # noqa: BLE001  (out of resources, or a tile this Triton refuses)
                    row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                rows.append(row)
        out[kernel] = dict(dense_tflops=work / dense_ms / 1e9, rows=rows)
    return out


def best_tiles(timed: dict) -> tuple[BackwardTiles, dict]:
    """The layout block whose four best kernels sum lowest, and those kernels' tiles; (tiles, best rows)."""
    choice = None
    for block_m in BLOCKS:
        picks = {}
        for kernel in KERNELS:
            rows = [r for r in timed[kernel]["rows"]  # the weight grads' rows serve every block
                    if "ms" in r and (r["block_m"] == block_m or len(layout_blocks(kernel)) == 1)]
            if not rows:
                break
            picks[kernel] = min(rows, key=lambda r: r["ms"])
        else:
            total = sum(r["ms"] for r in picks.values())
            if choice is None or total < choice[0]:
                choice = (total, block_m, picks)
    if choice is None:
        raise RuntimeError("no layout block has a tile that ran for every kernel")
    _, block_m, picks = choice
    tiles = BackwardTiles(block_m, **{k: KernelTiles(**picks[k]["tile"]) for k in KERNELS})
    return tiles, picks


def hf_grouped_mm(s: Shape, w13: torch.nn.Parameter, w2: torch.nn.Parameter):
    """transformers' grouped_mm experts forward over a Qwen3-MoE experts module holding the parameters
    w13, w2 (no copy): fn(x, ids, weights); None where this transformers has none."""
    try:
        from transformers.integrations import moe as hf_moe
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeExperts
    except ImportError:
        return None
    cfg = Qwen3MoeConfig(num_experts=s.num_experts, hidden_size=s.k, moe_intermediate_size=s.n,
                         num_experts_per_tok=s.top_k, hidden_act="silu")
    with torch.device("meta"):  # no [E, 2N, K] allocation: the weights are ours
        module = Qwen3MoeExperts(cfg)
    module.gate_up_proj, module.down_proj = w13, w2
    return lambda x, ids, weights: hf_moe.grouped_mm_experts_forward(module, x, ids.long(), weights)


def end_to_end(cell: Cell, tiles: BackwardTiles, dev) -> dict:
    """Forward + backward ms: the launch layer with ``tiles`` and with the heuristic, moekit's autograd
    path, and the grouped_mm baseline (transformers' where it runs, else moekit's torch._grouped_mm)."""
    from moekit.experts.grouped_mm import experts_grouped_mm
    from moekit.experts.triton import experts_triton, fused_experts

    s, w, ids, weights = cell.s, cell.w, cell.ids, cell.weights

    def launch_step(t):
        def step():
            fused_experts(cell.x, w.w13, w.w2, ids, weights)
            bl.experts_backward(cell.dout, cell.x, w.w13, w.w2, ids, weights, None, None, "silu", (True,) * 4, tiles=t)
        return step

    result = dict(tuned_ms=clock(launch_step(tiles), dev), heuristic_ms=clock(launch_step(None), dev),
                  rel_l2_vs_heuristic=agreement(cell, tiles))
    w13, w2 = torch.nn.Parameter(w.w13), torch.nn.Parameter(w.w2)  # the same storage, trainable
    leaves = [cell.x.detach().clone().requires_grad_(), w13, w2, weights.clone().requires_grad_()]

    def autograd_step(fn):
        def step():
            for leaf in leaves:
                leaf.grad = None
            fn(leaves[0], leaves[3]).backward(cell.dout)
        return step

    result["autograd_ms"] = clock(autograd_step(lambda x, wt: experts_triton(x, w13, w2, ids, wt)), dev)
    hf = hf_grouped_mm(s, w13, w2)
    try:
        result["baseline_ms"] = clock(autograd_step(lambda x, wt: hf(x, ids, wt)), dev)
        result["baseline"] = "transformers grouped_mm_experts_forward"
    except Exception as e:  # noqa: BLE001  (this transformers' module differs: moekit's torch._grouped_mm path)
        print(f"  transformers grouped_mm: {type(e).__name__}: {str(e)[:120]}; torch._grouped_mm instead", flush=True)
        result["baseline_ms"] = clock(autograd_step(lambda x, wt: experts_grouped_mm(x, w13, w2, ids, wt)), dev)
        result["baseline"] = "moekit experts_grouped_mm (torch._grouped_mm)"
    for leaf in leaves:
        leaf.grad = None
    result["fwd_bwd_tflops_tuned"] = 3 * 6 * s.n * s.k * cell.a / result["tuned_ms"] / 1e9
    return result


def agreement(cell: Cell, tiles: BackwardTiles) -> dict:
    """{grad: rel-L2 of the grads with ``tiles`` against the heuristic's}; over 1e-2 is printed as a FAIL."""
    w, grads = cell.w, []
    for t in (tiles, None):
        g = bl.experts_backward(cell.dout, cell.x, w.w13, w.w2, cell.ids, cell.weights, None, None, "silu", (True,) * 4,
                                tiles=t)
        grads.append(dict(x=g.x, w13=g.w13, w2=g.w2, topk_weights=g.topk_weights))
    errors = {name: rel_l2(got, grads[1][name]) for name, got in grads[0].items()}
    if max(errors.values()) > 1e-2:
        print(f"FAIL  {cell.s.name} M={cell.m}: the tuned tiles' grads differ from the heuristic's: {errors}",
              flush=True)
    return errors


def matmul_rate(dev) -> float:
    if dev.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / clock(lambda: a @ b, dev) / 1e9


def plan_of(dev) -> dict:
    """{(kernel, block_m): the candidate tiles that fit the device's shared memory}."""
    limit = max_shared_memory(dev) if dev.type == "cuda" else 1 << 30
    return {(kernel, bm): [t for t in candidates(kernel) if shared_bytes(kernel, bm, t) <= limit]
            for kernel in KERNELS for bm in layout_blocks(kernel)}


def layout_blocks(kernel: str) -> tuple[int, ...]:
    """The layout blocks a kernel is timed at: the weight grads' steps skip each expert's padding (their
    time does not depend on the block), so one."""
    return BLOCKS[:1] if kernel in WEIGHT_KERNELS else BLOCKS


def tune_shape(s: Shape, batches: tuple[int, ...], plan: dict, dev) -> list[dict]:
    w = make_weights(s, torch.bfloat16, dev)
    cells = [Cell(s, m, w, dev) for m in batches]
    started = time.perf_counter()
    precompile(cells, plan)
    print(f"{s.name}: compiled in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for cell in cells:
        timed = time_kernels(cell, plan, dev)
        tiles, picks = best_tiles(timed)
        heuristic = bl.backward_tiles(cell.a, s.num_experts, s.n, torch.bfloat16, dev)
        e2e = end_to_end(cell, tiles, dev)
        rows.append(dict(shape=s.name, m=cell.m, shape_class=shape_class(cell.a, s.num_experts, s.n), kernels=timed,
                         best=asdict(tiles), best_repr=repr(tiles), heuristic=asdict(heuristic), e2e=e2e,
                         best_rows=picks, heuristic_rows=heuristic_rows(timed, heuristic)))
        print(f"{s.name} M={cell.m}: {e2e}", flush=True)
    del cells, w
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return rows


def main(argv=None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=PRESETS, help="a subset of the shapes (default: all three)")
    p.add_argument("--batches", nargs="+", type=int, help="token counts (default: 4096 16384)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter: checks the script runs")
    args = p.parse_args(argv)
    shapes = [Shape.from_preset(name) for name in args.presets] if args.presets and not SMOKE else SHAPES
    batches = tuple(args.batches or BATCHES)
    dev = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    started = time.perf_counter()
    matmul = matmul_rate(dev)
    plan = plan_of(dev)
    print("candidates per block: " + ", ".join(f"{k} {len(plan[(k, BLOCKS[0])])}" for k in KERNELS), flush=True)
    rows = []
    for s in shapes:
        rows += tune_shape(s, batches, plan, dev)
        print(f"{s.name} done at {time.perf_counter() - started:.0f} s", flush=True)
    report = dict(device=name, torch=torch.__version__, triton=triton.__version__, matmul_tflops=matmul, cells=rows,
                  tuned={r["shape_class"]: r["best_repr"] for r in rows}, wall_s=time.perf_counter() - started)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "backward_tune.json"), "w") as f:
            json.dump(report, f, indent=1)
    table(rows, matmul)
    print(f"({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
