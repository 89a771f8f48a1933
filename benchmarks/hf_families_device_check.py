"""GPU check of issue #14: every transformers experts family on the "moekit" implementation (the CUDA
default backend, Triton where it takes the variant), and a gpt-oss-20b-width experts layer timed.

    PYTHONPATH=.:tests python benchmarks/hf_families_device_check.py

  families  each experts class the installed transformers wraps (tests/_hf_families.py's walk), built
            small on the GPU: "moekit" vs "eager" in fp32 (rel. L2 < 1e-5) and bf16 (< 1e-2); fused or
            composed; any exception is recorded per family (a backend refusing a spec shows here)
  timing    GptOssExperts at gpt-oss-20b's widths (K = N = 2880, 32 experts, top-4, bf16), M tokens in
            {1, 8, 64, 1024, 4096}: µs per call of "moekit" (HF_BACKEND auto = triton on CUDA),
            "moekit" on grouped_mm, and transformers' own "grouped_mm"; CUDA-graph-free eager timing
Prints one line per family, then the timing table; writes $OUT/hf_families_device_check.json when OUT
is set; exit 1 on any family failure.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

import moekit.hf as moekit_hf
from moekit.bench.timing import time_calls
from moekit.hf.variants import ComposedPathWarning, experts_plan

from _hf_families import config_class, make_case, walk  # tests/ on PYTHONPATH

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run, no timing
M_VALUES = (1, 8, 64, 1024, 4096)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def check_family(fam) -> dict:
    row = {"family": fam.family, "class": fam.cls.__name__}
    try:
        case = make_case(fam)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            module = case.module.to(DEVICE, dtype)
            x, ids, w = case.x.to(DEVICE, dtype), case.ids.to(DEVICE), case.weights.to(DEVICE)
            with torch.no_grad():
                ids_eager = ids.clone()
                ids_eager[0, -1] = 0  # the sentinel slot has weight 0: eager gets a valid id instead
                module.config._experts_implementation = "eager"
                eager = module(x, ids_eager, w)
                module.config._experts_implementation = "moekit"
                out = module(x, ids, w)
            row[f"err_{str(dtype)[6:]}"] = err = rel_l2(out, eager)
            row["ok"] = row.get("ok", True) and err < tol
        row["path"] = "fused" if experts_plan(case.module).fused else "composed"
    except Exception as exc:  # noqa: BLE001 (recorded per family, the run goes on)
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    return row


def time_gpt_oss() -> list[dict]:
    fam = next(f for f in walk() if f.family == "gpt_oss")
    cfg = config_class(fam)(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    torch.manual_seed(0)
    module = fam.cls(cfg).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() == 3 else 0.1))
    rows = []
    for m in M_VALUES:
        x = torch.randn(m, 2880, device=DEVICE, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(32, device=DEVICE)[:4] for _ in range(m)])
        w = torch.rand(m, 4, device=DEVICE)
        row = {"M": m}
        for label, impl, backend in (("moekit", "moekit", "auto"), ("moekit_grouped_mm", "moekit", "grouped_mm"),
                                     ("hf_grouped_mm", "grouped_mm", "auto")):
            moekit_hf.HF_BACKEND = backend
            module.config._experts_implementation = impl
            try:
                with torch.no_grad():
                    row[label] = time_calls([lambda: module(x, ids, w)], DEVICE)
            except Exception as exc:  # noqa: BLE001
                row[label] = f"{type(exc).__name__}: {exc}"[:120]
        moekit_hf.HF_BACKEND = "auto"
        rows.append(row)
    return rows


def main() -> int:
    warnings.simplefilter("ignore", ComposedPathWarning)
    families = [check_family(fam) for fam in walk()]
    for r in families:
        print(f"{'ok ' if r['ok'] else 'BAD'} {r['family']:24s} {r.get('path', '-'):9s} "
              f"fp32 {r.get('err_float32', float('nan')):.1e} bf16 {r.get('err_bfloat16', float('nan')):.1e} "
              f"{r.get('error', '')}")
    timing = time_gpt_oss() if DEVICE.type == "cuda" else []
    print(f"\n{sum(r['ok'] for r in families)} of {len(families)} experts classes ok")
    print("gpt-oss-20b experts layer, bf16, µs per call")
    print(f"{'M':>6} {'moekit':>12} {'moekit/grouped_mm':>18} {'hf grouped_mm':>14}")
    for r in timing:
        cells = [f"{r[k]:.1f}" if isinstance(r[k], float) else "error" for k in
                 ("moekit", "moekit_grouped_mm", "hf_grouped_mm")]
        print(f"{r['M']:>6} {cells[0]:>12} {cells[1]:>18} {cells[2]:>14}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hf_families_device_check.json"), "w") as f:
            json.dump({"families": families, "timing": timing, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0 if all(r["ok"] for r in families) else 1


if __name__ == "__main__":
    sys.exit(main())
