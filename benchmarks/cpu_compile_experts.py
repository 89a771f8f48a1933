"""Compiled CPU experts alone: one transformers ``Qwen3MoeExperts`` module at Qwen3-30B-A3B widths (fp32,
random weights), each variant ``torch.compile``d (inductor, fullgraph, static shapes), interleaved in one process.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/cpu_compile_experts.py --batches 1,8,64 --rounds 9

Variants: ``moekit`` (``moekit.hf``'s experts forward: the compiled call runs ``moekit::cpu_experts``, the
eager packed/split loop), ``moekit_traced`` (``experts_grouped_mm(cpu_gemm="grouped_mm")``: the traced grouped
GEMM path every compiled CPU call took before the op), ``grouped_mm`` (transformers' grouped_mm experts forward:
fp32 under compile runs its ``grouped_mm_fallback`` op, a torch.mm loop) and ``moekit_eager`` (no compile).
Every round calls each once, the order rotated; prints the median ms per call, each variant's speed relative
to ``grouped_mm`` and the max abs difference from transformers' eager experts; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers.integrations.moe import grouped_mm_experts_forward

from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.hf import moekit_experts_forward


def experts_module(num_experts: int, hidden: int, inter: int, seed: int) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts)
    module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, hidden**-0.5, generator=gen)
        module.down_proj.normal_(0, inter**-0.5, generator=gen)
    return module


def variants(module: torch.nn.Module) -> dict:
    def traced(x, ids, weights):
        return experts_grouped_mm(x, module.gate_up_proj, module.down_proj, ids, weights, cpu_gemm="grouped_mm")

    def compiled(fn):
        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)

    return {
        "moekit": compiled(lambda x, ids, weights: moekit_experts_forward(module, x, ids, weights)),
        "moekit_traced": compiled(traced),
        "grouped_mm": compiled(lambda x, ids, weights: grouped_mm_experts_forward(module, x, ids, weights)),
        "moekit_eager": lambda x, ids, weights: moekit_experts_forward(module, x, ids, weights),
    }


def measure(fns: dict, inputs: tuple, want: torch.Tensor, rounds: int) -> dict:
    times = {name: [] for name in fns}
    diffs = {name: float((fn(*inputs) - want).abs().max()) for name, fn in fns.items()}  # compiles
    for fn in fns.values():  # the first call after compiling still pays for more than the call
        fn(*inputs)
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name](*inputs)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {name: {"ms": ms[name], "vs_grouped_mm": ms["grouped_mm"] / ms[name], "max_abs_diff": diffs[name]}
            for name in names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", default="128,768,2048,8", help="E,N,K,k")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    num_experts, inter, hidden, top_k = (int(v) for v in args.shape.split(","))
    module = experts_module(num_experts, hidden, inter, seed=0)
    fns = variants(module)
    rows = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, hidden, generator=gen)
            ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(m)])
            weights = torch.rand(m, top_k, generator=gen).softmax(-1)
            want = grouped_mm_experts_forward(module, x, ids, weights)
            result = measure(fns, (x, ids, weights), want, args.rounds)
            rows.append({"tokens": m, **result})
            print(f"M={m:4d} " + "  ".join(f"{n} {r['ms']:.2f} ms ({r['vs_grouped_mm']:.2f}x, diff "
                                           f"{r['max_abs_diff']:.1e})"
                                          for n, r in result.items()), flush=True)
    doc = {"shape": args.shape, "threads": torch.get_num_threads(), "rounds": args.rounds, "torch": torch.__version__,
           "transformers": transformers.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
