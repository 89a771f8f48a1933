"""GPU checks and timings of the grouped_mm backend on the experts variants (issue #14), at gpt-oss-20b
width (E=32, k=4, K=N=2880), against the reference backend (its float32 oracle on the same GPU).

    PYTHONPATH=. python benchmarks/variants_grouped_mm_device_check.py

Checks (one line each):
  agree    plain SwiGLU, gpt-oss (interleaved, clamp 7, alpha 1.702, +1, biases) on contiguous and on
           transformers' transposed storage, relu2 ungated with biases; bf16 at M in {1, 64, 2048}
           (rel. L2 < 1e-2) and fp32 at M=64 (< 1e-5) against the fp32 reference
  path     whether torch's grouped GEMM runs bf16 here (else the per-expert fallback loop)
  copies   peak memory of one call on the transposed views minus on contiguous weights: a per-call
           copy of w13 would add its 1 GiB; it must stay under 64 MiB
  grads    bf16 autograd through grouped_mm with biases at M=256: x, w13, w2, b13, b2 gradients vs the
           fp32 reference's autograd (rel. L2 < 5e-2: bf16 puts some pre-activations on the other side
           of the clamp; a lost bias gradient or a garbage row is O(1))
Prints the timing table last (bf16 µs per call, ``time_calls``: CUDA events, four token sets in turn;
the 1.6 GB of weights never fit L2); writes $OUT/variants_grouped_mm_device_check.json when OUT is set;
exit 1 on any failure. The lead compares "gpt_oss" with "plain" (the cost of the bias gathers and the
strided glu) and "gpt_oss_transposed" with "gpt_oss" (transposed storage read as views).

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moekit.activations import ActivationSpec
from moekit.bench.timing import time_calls
from moekit.experts import run_experts
from moekit.experts.torch_grouped import grouped_mm_supported

E, TOP_K, K, N = 32, 4, 2880, 2880
M_VALUES = (1, 64, 2048)
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
# name -> (spec, biases, transposed storage)
VARIANTS = {
    "plain": (ActivationSpec("silu"), False, False),
    "gpt_oss": (GPT_OSS, True, False),
    "gpt_oss_transposed": (GPT_OSS, True, True),
    "relu2_ungated": (ActivationSpec("relu2", gated=False), True, False),
}
FAILED: list[str] = []
RESULTS: dict = {"checks": [], "timing": []}


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    RESULTS["checks"].append({"name": name, "ok": ok, "detail": detail})
    if not ok:
        FAILED.append(name)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def weights(name: str, dtype: torch.dtype, dev: str, seed: int = 0) -> dict:
    """The variant's w13, w2 (views of [E, K, R] / [E, N, K] storage when transposed), b13, b2."""
    spec, biases, transposed = VARIANTS[name]
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = 2 * N if spec.gated else N
    if transposed:
        w13 = (torch.randn(E, K, rows, generator=g, device=dev) / K**0.5).to(dtype).transpose(1, 2)
        w2 = (torch.randn(E, N, K, generator=g, device=dev) / N**0.5).to(dtype).transpose(1, 2)
    else:
        w13 = (torch.randn(E, rows, K, generator=g, device=dev) / K**0.5).to(dtype)
        w2 = (torch.randn(E, K, N, generator=g, device=dev) / N**0.5).to(dtype)
    b13 = (torch.randn(E, rows, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    b2 = (torch.randn(E, K, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    return dict(w13=w13, w2=w2, b13=b13, b2=b2, activation=spec)


def tokens(m: int, dtype: torch.dtype, dev: str, seed: int = 1):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(m, K, generator=g, device=dev) * 4).to(dtype)  # x4: gpt-oss's clamp at 7 bites
    ids = torch.rand(m, E, generator=g, device=dev).argsort(dim=1)[:, :TOP_K].int()
    topk_weights = torch.rand(m, TOP_K, generator=g, device=dev)
    return x, ids, topk_weights


def as_fp32(w: dict) -> dict:
    return {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in w.items()}


def agree(dev: str) -> None:
    for name in VARIANTS:
        for dtype, m_values, tol in ((torch.bfloat16, M_VALUES, 1e-2), (torch.float32, (64,), 1e-5)):
            w = weights(name, dtype, dev)
            for m in m_values:
                x, ids, tw = tokens(m, dtype, dev)
                got = run_experts(x, topk_ids=ids, topk_weights=tw, backend="grouped_mm", **w)
                ref = run_experts(x.float(), topk_ids=ids, topk_weights=tw, backend="reference", **as_fp32(w))
                err = rel_l2(got, ref)
                check(f"agree {name} {dtype} M={m}", err < tol, f"rel_l2={err:.2e} (< {tol})")


def copies(dev: str) -> None:
    """A per-call copy of the transposed weights shows as extra peak memory."""
    x, ids, tw = tokens(2048, torch.bfloat16, dev)
    peaks = {}
    for name in ("gpt_oss", "gpt_oss_transposed"):
        w = weights(name, torch.bfloat16, dev)
        run_experts(x, topk_ids=ids, topk_weights=tw, backend="grouped_mm", **w)  # warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_experts(x, topk_ids=ids, topk_weights=tw, backend="grouped_mm", **w)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del w
    extra = (peaks["gpt_oss_transposed"] - peaks["gpt_oss"]) / 2**20
    RESULTS["peak_bytes"] = peaks
    check("copies transposed views", extra < 64, f"extra peak {extra:.1f} MiB over contiguous weights")


def grads(dev: str) -> None:
    x, ids, tw = tokens(256, torch.bfloat16, dev)
    w = weights("gpt_oss_transposed", torch.bfloat16, dev)
    out = {}
    for backend, dtype in (("grouped_mm", torch.bfloat16), ("reference", torch.float32)):
        leaves = {k: w[k].detach().to(dtype).requires_grad_(True) for k in ("w13", "w2", "b13", "b2")}
        xs = x.detach().to(dtype).requires_grad_(True)
        y = run_experts(xs, topk_ids=ids, topk_weights=tw, activation=GPT_OSS, backend=backend, **leaves)
        probe = torch.randn(y.shape, generator=torch.Generator(device=dev).manual_seed(2), device=dev)
        (y.float() * probe).sum().backward()
        out[backend] = {"x": xs.grad, **{k: v.grad for k, v in leaves.items()}}
    for key, ref in out["reference"].items():
        err = rel_l2(out["grouped_mm"][key], ref)
        check(f"grads {key}", err < 5e-2, f"rel_l2={err:.2e} (< 5e-2)")


def timing(dev: str) -> None:
    for m in M_VALUES:
        row = {"M": m}
        for name in VARIANTS:
            w = weights(name, torch.bfloat16, dev)
            calls = [tokens(m, torch.bfloat16, dev, seed=s) for s in range(4)]
            fns = [lambda c=c: run_experts(c[0], topk_ids=c[1], topk_weights=c[2], backend="grouped_mm", **w)
                   for c in calls]
            row[name] = time_calls(fns, torch.device(dev))
            del w, calls, fns
        RESULTS["timing"].append(row)


def print_table() -> None:
    names = list(VARIANTS)
    print("\ngrouped_mm, bf16, gpt-oss-20b width (E=32, k=4, K=N=2880): us per call")
    print("M".rjust(6) + "".join(n.rjust(20) for n in names))
    for row in RESULTS["timing"]:
        print(str(row["M"]).rjust(6) + "".join(f"{row[n]:20.1f}" for n in names))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = "cuda"
    supported = grouped_mm_supported("cuda", torch.bfloat16)
    check("path grouped GEMM runs bf16", supported, f"torch {torch.__version__}")
    agree(dev)
    copies(dev)
    grads(dev)
    timing(dev)
    print_table()
    RESULTS.update(torch=torch.__version__, device=torch.cuda.get_device_name(), failed=FAILED)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "variants_grouped_mm_device_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print(f"\n{len(FAILED)} failed: {FAILED}" if FAILED else "\nall checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
