"""GPU check of the Triton experts kernels on the experts variants of issue 14 (run on the device).

    PYTHONPATH=. python benchmarks/variants_device_check.py        # JSON to $OUT/variants.json when OUT is set

Two shapes in bf16, M in {1, 8, 64, 512, 4096}, uniform random routing:
- gpt_oss_20b: E=32, K=2880, N=2880, top-4; interleaved clamped SwiGLU (alpha 1.702, limit 7, up_shift 1)
  with b13/b2 biases. w13 is drawn at 3x the usual scale, so gate/up pre-activations (std ~3) cross the
  limit of 7 on ~2% of the entries: the clamp is exercised, not only compiled.
- nemotron_h: E=128, K=2688, N=1856, top-6; ungated relu2 (w13 [E, N, K]), no biases (as the model).

Per cell:
- err: rel. L2 of triton (and of grouped_mm) against moekit's reference backend computed in fp32 (the
  bf16 weights upcast; < 1e-2 passes);
- err_T: triton on transposed storage (weights stored [E, K, 2N] / [E, N, K], passed as
  ``.transpose(1, 2)`` views: the pointer path with real strides, no copy), M=64 only;
- µs (CUDA-graph replay over 4 rotated input sets, ``moekit.bench.timing``): triton on the variant,
  grouped_mm on the variant, triton on the base at the same shape with the variant's fields off
  (gpt_oss: plain "silu" on the same w13 read gate-rows-first, no biases; nemotron: ungated "silu"), so
  variant/base is the variant's own cost; triton_T on the transposed views (M=64).
Prints one line per failed check, then the table; exit 1 on any failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec
from moekit.bench.timing import time_stats
from moekit.experts import run_experts
from moekit.experts.reference import experts_reference
from moekit.experts.triton import experts_triton

MS = (1, 8, 64, 512, 4096)
TRANSPOSED_M = 64
SETS = 4  # rotated input sets per timing
TOL = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int  # E
    hidden: int  # K
    inter: int  # N
    top_k: int
    spec: ActivationSpec
    base: str | ActivationSpec  # the same shape with the variant's fields off
    biases: bool
    w13_scale: float  # multiplies the K^-1/2 init of w13


CASES = (
    Case("gpt_oss_20b", 32, 2880, 2880, 4,
         ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0), "silu", True, 3.0),
    Case("nemotron_h", 128, 2688, 1856, 6, ActivationSpec("relu2", gated=False),
         ActivationSpec("silu", gated=False), False, 1.0),
)


@dataclass
class Weights:
    w13: torch.Tensor  # [E, 2N or N, K] bf16, contiguous
    w2: torch.Tensor  # [E, K, N]
    b13: torch.Tensor | None  # [E, 2N or N]
    b2: torch.Tensor | None  # [E, K]
    w13_t: torch.Tensor  # w13 stored [E, K, rows], as a [E, rows, K] view
    w2_t: torch.Tensor  # w2 stored [E, N, K], as a [E, K, N] view


def make_weights(case: Case, device: torch.device) -> Weights:
    g = torch.Generator(device=device).manual_seed(0)
    e, k, n = case.num_experts, case.hidden, case.inter
    rows = 2 * n if case.spec.gated else n

    def randn(*shape, scale):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(torch.bfloat16)

    w13, w2 = randn(e, rows, k, scale=case.w13_scale * k**-0.5), randn(e, k, n, scale=n**-0.5)
    b13 = randn(e, rows, scale=0.5) if case.biases else None
    b2 = randn(e, k, scale=0.1) if case.biases else None
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    return Weights(w13, w2, b13, b2, w13_t, w2_t)


def make_sets(case: Case, m: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x [M, K] bf16, ids [M, k] int32 distinct experts, weights [M, k] fp32 summing to 1) per set."""
    sets = []
    for i in range(SETS):
        g = torch.Generator(device=device).manual_seed(1000 * m + i)
        x = torch.randn(m, case.hidden, device=device, generator=g).to(torch.bfloat16)
        ids = torch.rand(m, case.num_experts, device=device, generator=g).topk(case.top_k, dim=1).indices.int()
        weights = torch.softmax(torch.rand(m, case.top_k, device=device, generator=g), dim=1)
        sets.append((x, ids, weights))
    return sets


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not out.isfinite().all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def time_us(calls, device) -> float:
    """Median µs per call, CUDA-graph replay (events around plain calls if capture fails)."""
    try:
        return time_stats(calls, device, graph=True, budget_s=0.2).us
    except RuntimeError:
        torch.cuda.synchronize()
        return time_stats(calls, device, graph=False, budget_s=0.2).us


def triton_call(w: Weights, spec, x, ids, weights, transposed=False, biases=True):
    w13, w2 = (w.w13_t, w.w2_t) if transposed else (w.w13, w.w2)
    return experts_triton(x, w13, w2, ids, weights, activation=spec,
                          b13=w.b13 if biases else None, b2=w.b2 if biases else None)


def errors(case: Case, w: Weights, m: int, first, ref32) -> dict:
    x, ids, weights = first
    row = {"err_triton": rel_l2(triton_call(w, case.spec, x, ids, weights), ref32),
           "err_grouped_mm": rel_l2(run_experts(x, w.w13, w.w2, ids, weights, activation=case.spec, b13=w.b13,
                                                b2=w.b2, backend="grouped_mm"), ref32)}
    if m == TRANSPOSED_M:
        row["err_triton_T"] = rel_l2(triton_call(w, case.spec, x, ids, weights, transposed=True), ref32)
    return row


def timings(case: Case, w: Weights, m: int, sets, device) -> dict:
    row = {
        "triton_us": time_us([lambda s=s: triton_call(w, case.spec, *s) for s in sets], device),
        "grouped_mm_us": time_us([lambda s=s: run_experts(s[0], w.w13, w.w2, s[1], s[2], activation=case.spec,
                                                          b13=w.b13, b2=w.b2, backend="grouped_mm") for s in sets],
                                 device),
        "base_us": time_us([lambda s=s: triton_call(w, case.base, *s, biases=False) for s in sets], device),
    }
    if m == TRANSPOSED_M:
        row["triton_T_us"] = time_us([lambda s=s: triton_call(w, case.spec, *s, transposed=True) for s in sets],
                                     device)
    return row


def run_case(case: Case, device: torch.device) -> list[dict]:
    w = make_weights(case, device)
    w13_32, w2_32 = w.w13.float(), w.w2.float()
    b13_32 = w.b13.float() if w.b13 is not None else None
    b2_32 = w.b2.float() if w.b2 is not None else None
    rows = []
    for m in MS:
        sets = make_sets(case, m, device)
        x, ids, weights = sets[0]
        ref32 = experts_reference(x.float(), w13_32, w2_32, ids, weights, activation=case.spec, b13=b13_32, b2=b2_32)
        row = {"case": case.name, "M": m, **errors(case, w, m, sets[0], ref32), **timings(case, w, m, sets, device)}
        row["variant_over_base"] = row["triton_us"] / row["base_us"]
        row["triton_over_grouped_mm"] = row["triton_us"] / row["grouped_mm_us"]
        row["ok"] = all(v < TOL for key, v in row.items() if key.startswith("err_"))
        if not row["ok"]:
            print(f"FAIL  {case.name} M={m}: "
                  + ", ".join(f"{k}={v:.2e}" for k, v in row.items() if k.startswith("err_")))
        rows.append(row)
        print(f"done  {case.name} M={m}", flush=True)
    del w, w13_32, w2_32
    torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'case':<12} {'M':>5} {'err_tri':>8} {'err_gmm':>8} {'err_T':>8} {'triton':>9} {'gmm':>9} {'base':>9} "
            f"{'tri_T':>9} {'var/base':>8} {'tri/gmm':>8}")
    print(head)
    for r in rows:
        err_t = f"{r['err_triton_T']:.1e}" if "err_triton_T" in r else "-"
        tri_t = f"{r['triton_T_us']:.1f}" if "triton_T_us" in r else "-"
        print(f"{r['case']:<12} {r['M']:>5} {r['err_triton']:>8.1e} {r['err_grouped_mm']:>8.1e} {err_t:>8} "
              f"{r['triton_us']:>9.1f} {r['grouped_mm_us']:>9.1f} {r['base_us']:>9.1f} {tri_t:>9} "
              f"{r['variant_over_base']:>8.2f} {r['triton_over_grouped_mm']:>8.2f}")
    print("µs: CUDA-graph replay per call; base = triton, same shape, variant fields off; tri/gmm < 1: triton faster")


def environment(device: torch.device) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit or None}


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda")
    rows = []
    with torch.no_grad():
        for case in CASES:
            rows += run_case(case, device)
    print_table(rows)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "variants.json"), "w") as f:
            json.dump({**environment(device), "tolerance": TOL, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
