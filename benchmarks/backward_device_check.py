"""The Triton experts backward on the GPU (H200, bf16): correctness at real shapes and training-step speed.

    PYTHONPATH=. python benchmarks/backward_device_check.py            # the H200 run (< 3 min)
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/backward_device_check.py --smoke   # CPU dry run of this script

1. correctness, M = 4096, Qwen3-30B-A3B (E=128, K=2048, N=768, top-8) and Mixtral-8x7B (E=8, K=4096,
   N=14336, top-2): grads of x, w13, w2, topk_weights of sum(out * dout), bf16, against moekit's
   grouped_mm backend autograd in float32 (rel-L2 < 2e-2 per grad, for the default backward
   (recompute) and the saved-h_pre one; the default run twice must agree bit for bit); grouped_mm's own bf16
   error printed beside, for scale; and
   torch.compile(fullgraph=True) (inductor) of forward + backward at Qwen3 M=256 against eager.
2. timing, M = 4096 and 16384, Qwen3, Mixtral, DeepSeek-V3 (E=256, K=7168, N=2048, top-8): forward +
   backward (out.backward(dout); grads for x, w13, w2, topk_weights), CUDA events around each step,
   median of 10 after 3 warm-up steps; forward alone (no grad) the same way. TFLOP/s = 3 x 6·N·K·M·k
   / time. Peak memory above what the step starts with (weights and inputs), and that minus the grads
   themselves (the activation memory). Backends: triton (recompute), triton_saved, grouped_mm (torch
   _grouped_mm autograd, what transformers trains with). The bf16 matmul rate (8192^3) measured first.
A table last; JSON to $OUT/backward.json when OUT is set. Exit 1 if a correctness check fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.experts.triton import experts_triton
from moekit.experts.triton_backward import BackwardOptions, experts_triton_train

SMOKE = "--smoke" in sys.argv
GRADS = ("x", "w13", "w2", "topk_weights")
BACKENDS = {
    "triton": experts_triton,
    "triton_saved": lambda *a: experts_triton_train(*a, backward=BackwardOptions(recompute=False)),
    "grouped_mm": experts_grouped_mm,
}
if SMOKE:  # tiny shapes, one repeat: only checks that this script runs
    SHAPES = {"tiny": Shape("tiny", 8, 17, 33, 2)}
    CHECK_M, TIME_M, WARMUP, REPEATS = 12, (12,), 0, 1
else:
    SHAPES = {name: Shape.from_preset(name) for name in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")}
    CHECK_M, TIME_M, WARMUP, REPEATS = 4096, (4096, 16384), 3, 10
CHECK_SHAPES = tuple(SHAPES)[:2]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float32, summed over at most 64 slices of dim 0 (DeepSeek-V3's dW13 is
    15 GB in bf16: never a whole float32 copy); inf when got has a non-finite value."""
    diff = norm = 0.0
    step = max(1, -(-got.shape[0] // 64))
    for a, b in zip(got.split(step), ref.split(step)):
        if not torch.isfinite(a).all():
            return float("inf")
        diff += float((a.float() - b.float()).square().sum())
        norm += float(b.float().square().sum())
    return (diff / max(norm, 1e-60)) ** 0.5


def leaves(w13, w2, x, weights, dtype) -> dict:
    """Fresh leaf tensors needing grads, cast to dtype (the routed weights stay float32)."""
    out = {"x": x.to(dtype, copy=True), "w13": w13.to(dtype, copy=True), "w2": w2.to(dtype, copy=True),
           "topk_weights": weights.clone()}
    for t in out.values():
        t.requires_grad_()
    return out


def grads(fn, t: dict, ids, dout) -> dict:
    out = fn(t["x"], t["w13"], t["w2"], ids, t["topk_weights"])
    out.backward(dout.to(out.dtype))
    result = {name: t[name].grad for name in GRADS}
    for name in GRADS:
        t[name].grad = None
    return result


def correctness(dev, results: list) -> bool:
    ok = True
    for name in CHECK_SHAPES:
        s = SHAPES[name]
        w = make_weights(s, torch.bfloat16, dev)
        x = torch.randn(CHECK_M, s.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(CHECK_M, s, dev, seed=1)
        dout = torch.randn(CHECK_M, s.k, device=dev)
        ref = grads(experts_grouped_mm, leaves(w.w13, w.w2, x, routing.topk_weights, torch.float32), routing.topk_ids,
                    dout)
        for backend, fn in BACKENDS.items():
            got = grads(fn, leaves(w.w13, w.w2, x, routing.topk_weights, torch.bfloat16), routing.topk_ids, dout)
            errors = {g: rel_l2(got[g], ref[g]) for g in GRADS}
            passed = backend == "grouped_mm" or all(e < 2e-2 for e in errors.values())
            if backend == "triton":  # no atomics anywhere: a second run is bit for bit the first
                again = grads(fn, leaves(w.w13, w.w2, x, routing.topk_weights, torch.bfloat16), routing.topk_ids, dout)
                same = all(torch.equal(again[g], got[g]) for g in GRADS)
                print(f"{'PASS' if same else 'FAIL'}  deterministic: a second backward equals the first bit for bit",
                      flush=True)
                passed &= same
            ok &= passed
            results.append(dict(shape=name, m=CHECK_M, backend=backend, rel_l2=errors, passed=passed))
            print(f"{'PASS' if passed else 'FAIL'}  grads {name} M={CHECK_M} {backend} (bf16 vs grouped_mm fp32): "
                  + "  ".join(f"{g} {e:.1e}" for g, e in errors.items()), flush=True)
            del got
        del w, ref
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    return ok


def compiled(dev, results: list) -> bool:
    """torch.compile(fullgraph=True) (inductor) of the experts call, forward + backward, against eager."""
    s = SHAPES[CHECK_SHAPES[0]]
    m = 256 if not SMOKE else CHECK_M
    w = make_weights(s, torch.bfloat16, dev)
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    routing = uniform_routing(m, s, dev, seed=3)
    dout = torch.randn(m, s.k, device=dev)
    fn = torch.compile(experts_triton, fullgraph=True, backend="aot_eager" if SMOKE else "inductor")
    want = grads(experts_triton, leaves(w.w13, w.w2, x, routing.topk_weights, torch.bfloat16), routing.topk_ids, dout)
    got = grads(fn, leaves(w.w13, w.w2, x, routing.topk_weights, torch.bfloat16), routing.topk_ids, dout)
    errors = {g: rel_l2(got[g], want[g]) for g in GRADS}
    passed = all(e < 1e-2 for e in errors.values())
    results.append(dict(shape=s.name, m=m, backend="triton compiled", rel_l2=errors, passed=passed))
    print(f"{'PASS' if passed else 'FAIL'}  torch.compile(fullgraph=True) fwd+bwd {s.name} M={m} vs eager: "
          + "  ".join(f"{g} {e:.1e}" for g, e in errors.items()), flush=True)
    return passed


def one_call_ms(dev, fn) -> float:
    """ms of one call of fn: CUDA events on the GPU, the wall clock elsewhere."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def clock(dev, fn) -> float:
    """Median ms of fn over REPEATS calls after WARMUP."""
    for _ in range(WARMUP):
        fn()
    return statistics.median(one_call_ms(dev, fn) for _ in range(REPEATS))


def time_cell(dev, name: str, s: Shape, m: int, backend: str, w) -> dict:
    fn = BACKENDS[backend]
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    routing = uniform_routing(m, s, dev, seed=2)
    dout = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    t = leaves(w.w13, w.w2, x, routing.topk_weights, torch.bfloat16)

    def step():
        for leaf in t.values():
            leaf.grad = None
        fn(t["x"], t["w13"], t["w2"], routing.topk_ids, t["topk_weights"]).backward(dout)

    def forward():
        with torch.no_grad():
            fn(t["x"], t["w13"], t["w2"], routing.topk_ids, t["topk_weights"])

    fwd_ms, step_ms = clock(dev, forward), clock(dev, step)
    peak = peak_grads = 0.0
    if dev.type == "cuda":
        for leaf in t.values():
            leaf.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        peak_grads = sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in t.values()) / 2**30
    flops = 3 * 6 * s.n * s.k * m * s.top_k
    return dict(shape=name, m=m, backend=backend, fwd_ms=fwd_ms, step_ms=step_ms, tflops=flops / step_ms / 1e9,
                peak_gib=peak, activation_gib=peak - peak_grads)


def matmul_rate(dev) -> float:
    if dev.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / clock(dev, lambda: a @ b) / 1e9


def timing(dev, results: list) -> None:
    for name, s in SHAPES.items():
        w = make_weights(s, torch.bfloat16, dev)
        for m in TIME_M:
            for backend in BACKENDS:
                try:
                    row = time_cell(dev, name, s, m, backend, w)
                except torch.OutOfMemoryError as exc:  # recorded, the run goes on
                    row = dict(shape=name, m=m, backend=backend, error=str(exc).splitlines()[0])
                results.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache() if dev.type == "cuda" else None
        del w


def table(rows: list, matmul: float) -> None:
    print(f"\nbf16 matmul 8192^3: {matmul:.0f} TFLOP/s")
    print(f"{'shape':<15}{'M':>6}  {'backend':<13}{'fwd ms':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}{'% mm':>6}"
          f"{'peak GiB':>10}{'act GiB':>9}{'vs gmm':>8}")
    base = {(r["shape"], r["m"]): r["step_ms"] for r in rows if r["backend"] == "grouped_mm" and "step_ms" in r}
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<15}{r['m']:>6}  {r['backend']:<13}{r['error']}")
            continue
        speedup = base.get((r["shape"], r["m"]), float("nan")) / r["step_ms"]
        pct = 100 * r["tflops"] / matmul if matmul else 0.0
        print(f"{r['shape']:<15}{r['m']:>6}  {r['backend']:<13}{r['fwd_ms']:>9.2f}{r['step_ms']:>12.2f}"
              f"{r['tflops']:>9.0f}{pct:>6.0f}{r['peak_gib']:>10.2f}{r['activation_gib']:>9.2f}{speedup:>7.2f}x")


def main() -> int:
    dev = torch.device("cpu" if SMOKE and not torch.cuda.is_available() else "cuda")
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    started = time.perf_counter()
    checks, rows = [], []
    ok = correctness(dev, checks)
    try:
        ok &= compiled(dev, checks)
    except Exception as exc:  # noqa: BLE001  (reported; the timing still runs)
        print(f"FAIL  torch.compile fwd+bwd raised {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        checks.append(dict(backend="triton compiled", passed=False, error=repr(exc)[:500]))
        ok = False
    matmul = matmul_rate(dev)
    timing(dev, rows)
    report = dict(device=name, torch=torch.__version__, triton=triton.__version__, matmul_tflops=matmul,
                  correctness=checks, timing=rows, wall_s=time.perf_counter() - started)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "backward.json"), "w") as f:
            json.dump(report, f, indent=1)
    table(rows, matmul)
    print("correctness:", "PASS" if ok else "FAIL", f"({report['wall_s']:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
