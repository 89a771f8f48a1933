"""float32 / bf16 activations on weight-only int8 / mxfp4 / int4 experts through ``torch._int_mm`` (session 31, branch
``cpuq31``; bf16: session 32, ``cpu32``) or, for bf16, the bf16 GEMM on the converted int8 form (session 33, ``cpu33``).

Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8), uniform random routing, x in ``--dtype``, weights quantized
once from the same fp32 weights. Per round, in an order shuffled each round (seeded; a warm-up round first), one call
each of:
- ``unquantized``: ``experts_grouped_mm`` on the fp32 weights (bf16: the same rounded to bf16; what ``auto`` runs:
  the split loop, packed weights from 4 rows an expert, BLAS below);
- ``B[s]`` / ``int8mm[s]``: the quantized CPU loop (``cpu_packed.experts_cpu_fused``, experts split over
  single-threaded workers, one a thread) with that ``QuantKernels`` kernel forced (``moekit.experts.cpu_quant``,
  ``moekit.experts.cpu_int8mm``; B, the base: "dequant" for float32 x, torch's weight-only kernel for bf16, what
  ``auto`` ran there before session 32); ``int8mm_w1[s]`` (``--unsplit``): the same loop unsplit, each
  ``torch._int_mm`` on every thread;
- ``bf16mm[s]`` (``--kernels int8mm,bf16mm``): any other kernel forced the same way (``--kernels``, default int8mm);
- ``auto[s]`` (``--auto``): ``experts_grouped_mm`` on the QuantizedWeights (what the library runs by default).
Prints per M the medians (ms), each row's rel-L2 error against a float64 reference (the float64 weights exactly
dequantized, float64 throughout: the ``reference`` backend on float64 x), and per-round ratios: ``int8mm[s]``'s
rounds >= 3% faster than ``B[s]`` and than ``unquantized`` (each ratio within one round). JSON with every
sample under ``--out``.

    flock /work/wt/cpubench.lock python3 benchmarks/cpu_int8mm.py --batches 1,8,64,512 --rounds 5 [--auto] [--unsplit] \
        [--dtype bfloat16] [--kernels int8mm,bf16mm] [--vs int8mm] [--no-errors] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from moekit.activations import as_spec
from moekit.bench.cpu_measure import ExpertsShape, cpu_name, expert_weights, problem, shuffled_seconds
from moekit.experts import backend_fn
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused
from moekit.experts.cpu_quant import SCHEME_KERNELS, QuantKernels
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.quant import quantize
from moekit.bench.run import commit_id

QWEN3 = "128,768,2048,8"


def base_kernel(scheme: str, dtype: torch.dtype) -> str:
    """The kernel int8mm is held against: "dequant" for float32 x, torch's weight-only kernel for bf16."""
    return "dequant" if dtype == torch.float32 else SCHEME_KERNELS[scheme][-1]


def calls_of(p, quantized: dict, args) -> dict:
    """Row name -> a zero-argument call (module docstring)."""
    threads = torch.get_num_threads()
    calls = {"unquantized": lambda: experts_grouped_mm(p.x, p.w13, p.w2, p.ids, p.weights)}
    for scheme, (q13, q2) in quantized.items():
        ex = ExpertParams(q13, q2, None, None, as_spec("silu"))
        base = base_kernel(scheme, p.x.dtype)
        rows = [(base, base, threads)] + [(k, k, threads) for k in args.kernels.split(",") if k != base]
        rows += [("int8mm_w1", "int8mm", 1)] * args.unsplit
        for name, kernel, workers in rows:
            kernels = QuantKernels(**{scheme: kernel})
            calls[f"{name}[{scheme}]"] = lambda e=ex, k=kernels, w=workers: experts_cpu_fused(
                p.x, e, p.ids, p.weights, None, None, workers=w, quant=k).to(p.x.dtype)
        if args.auto:
            calls[f"auto[{scheme}]"] = lambda a=q13, b=q2: experts_grouped_mm(p.x, a, b, p.ids, p.weights)
    return calls


def errors(calls: dict, p, quantized: dict) -> dict:
    """Row -> rel-L2 error against the float64 reference on its weights (the unquantized row: on the fp32 ones)."""
    reference = backend_fn("reference", p.x.device)
    x64, w64 = p.x.double(), p.weights.double()
    refs = {s: reference(x64, a, b, p.ids, w64) for s, (a, b) in quantized.items()}
    refs["unquantized"] = reference(x64, p.w13.double(), p.w2.double(), p.ids, w64)
    out = {}
    for name, fn in calls.items():
        ref = refs[name.split("[")[1][:-1] if "[" in name else name]
        out[name] = float((fn().double() - ref).norm() / ref.norm())
    return out


def wins(samples: dict, row: str, base: str) -> int:
    return sum(a < 0.97 * b for a, b in zip(samples[row], samples[base]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,512", help="token counts M, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schemes", default="int8_w8a16,mxfp4", help="weight-only schemes, comma-separated")
    ap.add_argument("--shape", default=QWEN3, help="E,N,K,k")
    ap.add_argument("--auto", action="store_true", help="also time auto[s], the library's default")
    ap.add_argument("--unsplit", action="store_true", help="also time int8mm_w1[s], the loop unsplit")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="x's dtype")
    ap.add_argument("--kernels", default="int8mm", help="kernels forced beside the base, comma-separated")
    ap.add_argument("--no-errors", action="store_true", help="skip the float64 reference (large M: minutes)")
    ap.add_argument("--vs", default=None, help="also print every row's per-round ratio to this row (e.g. int8mm)")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    shape = ExpertsShape.parse(args.shape)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = expert_weights(shape, gen)
    quantized = {s: (quantize(w13, s), quantize(w2, s)) for s in args.schemes.split(",")}
    dtype = getattr(torch, args.dtype)
    w13, w2 = w13.to(dtype), w2.to(dtype)  # the unquantized row's weights, and x's dtype
    doc = {"cpu": cpu_name(), "commit": commit_id(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "shape": args.shape, "rounds": args.rounds, "dtype": args.dtype, "loadavg_before": os.getloadavg(),
           "batches": []}
    print(f"{doc['cpu']}, threads {doc['threads']}, commit {doc['commit']}, load {os.getloadavg()[0]:.2f}")
    for m in (int(v) for v in args.batches.split(",")):
        p = problem(m, w13, w2, shape.top_k, gen)
        with torch.no_grad():
            calls = calls_of(p, quantized, args)
            errs = {} if args.no_errors else errors(calls, p, quantized)
            samples = shuffled_seconds(calls, args.rounds)
        doc["batches"].append({"M": m, "samples_s": samples, "rel_err_vs_float64": errs})
        print(f"M={m} load {os.getloadavg()[0]:.2f}")
        for name, s in samples.items():
            line = f"  {name:22s} {statistics.median(s) * 1e3:9.2f} ms  err {errs.get(name, float('nan')):.1e}"
            if "[" in name and name.split("[")[0] != base_kernel(name[name.index("[") + 1:-1], dtype):
                scheme = name[name.index("["):]
                base = base_kernel(scheme[1:-1], dtype) + scheme
                line += (f"  x {base} {statistics.median(samples[base]) / statistics.median(s):.2f}"
                         f" ({wins(samples, name, base)}/{args.rounds} rounds >= 3%),"
                         f" / unquantized {statistics.median(s) / statistics.median(samples['unquantized']):.2f}"
                         f" ({wins(samples, name, 'unquantized')}/{args.rounds} rounds >= 3% faster)")
            peer = None if args.vs is None or "[" not in name else args.vs + name[name.index("["):]
            if peer in samples and peer != name:
                line += f"  / {peer} per round " + " ".join(f"{a / b:.3f}" for a, b in zip(s, samples[peer]))
            print(line, flush=True)
    doc["loadavg_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
