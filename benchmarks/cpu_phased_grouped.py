"""The phased CPU loop's grouped GEMM (session 32, branch ``cpu32``): each phase as one torch grouped GEMM against the
same loop's per-expert GEMMs and transformers' ``grouped_mm`` experts function, at decode sizes.

Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8), M tokens each routed to k distinct experts among the first
``--spread`` (128: uniform; 35: the concentrated routing of the real client's 8-token prompt, some experts of 4-6
rows). Every call follows a 2-thread GEMM ([M, K] @ [K, 4096], as the router / attention before the experts). Per
round, in a shuffled order: ``grouped`` (``experts_cpu_phased`` as ``auto`` runs it), ``loop`` (the same with
``grouped_gemm=False``), ``hf_grouped_mm`` (``transformers.integrations.moe.grouped_mm_experts_forward`` on a stand-in
module). Prints the medians (ms), each row's rounds >= 3% faster than ``loop``, and whether ``grouped`` has ``loop``'s
bits; JSON with every round's sample (the median of ``--per-round`` calls) under ``--out``.

    flock /work/wt/cpubench.lock python3 benchmarks/cpu_phased_grouped.py --dtype bfloat16 --batches 1,2,4,8,16 \
        --spread 128 --rounds 7 --per-round 5 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from types import SimpleNamespace

import torch

from moekit.activations import ActivationSpec
from moekit.bench.cpu_measure import cpu_name
from moekit.bench.run import commit_id
from moekit.experts.cpu_packed import ExpertParams, packed_weight_cache
from moekit.experts.cpu_phased import experts_cpu_phased, phased_blas_rows

E, N, K, TOP_K = 128, 768, 2048, 8


def hf_module(w13: torch.Tensor, w2: torch.Tensor) -> SimpleNamespace:
    """What ``grouped_mm_experts_forward`` reads of a transformers experts module (Qwen3's: gated silu, no bias)."""
    def gate(h):
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    return SimpleNamespace(num_experts=E, gate_up_proj=w13, down_proj=w2, has_gate=True, has_bias=False,
                           is_transposed=False, _is_expert_parallel=False, has_post_expert_norm=False,
                           _apply_gate=gate)


def calls_of(m: int, spread: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    from transformers.integrations.moe import grouped_mm_experts_forward

    w13 = (torch.randn(E, 2 * N, K, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(E, K, N, generator=gen) * 0.02).to(dtype)
    x = torch.randn(m, K, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(spread, generator=gen)[:TOP_K] for _ in range(m)])  # [M, k]
    weights = torch.softmax(torch.randn(m, TOP_K, generator=gen), dim=1).to(dtype)
    ex, cache, blas, module = ExpertParams(w13, w2, None, None, ActivationSpec("silu")), packed_weight_cache(), \
        phased_blas_rows(dtype), hf_module(w13, w2)
    return {
        "grouped": lambda: experts_cpu_phased(x, ex, ids, weights, None, cache, blas_plain=blas),
        "loop": lambda: experts_cpu_phased(x, ex, ids, weights, None, cache, blas_plain=blas, grouped_gemm=False),
        "hf_grouped_mm": lambda: grouped_mm_experts_forward(module, x, ids, weights),
    }, len(set(ids.flatten().tolist()))


def rounds(calls: dict, m: int, dtype: torch.dtype, count: int, per_round: int) -> dict[str, list[float]]:
    """``count`` shuffled rounds (a warm-up call each first), every call after a 2-thread GEMM: seconds, each round's
    the median of ``per_round`` calls of a row in a row."""
    before_x, before_w = torch.randn(m, K).to(dtype), torch.randn(K, 4096).to(dtype)
    for fn in calls.values():
        fn()
    samples = {name: [] for name in calls}
    for _ in range(count):
        order = list(calls)
        random.shuffle(order)
        for name in order:
            seconds = []
            for _ in range(per_round):
                torch.mm(before_x, before_w)
                start = time.perf_counter()
                calls[name]()
                seconds.append(time.perf_counter() - start)
            samples[name].append(statistics.median(seconds))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", default="1,2,4,8,16", help="token counts M, comma-separated")
    ap.add_argument("--spread", type=int, default=E, help="experts the tokens are routed among (<= 128)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=5, help="calls of a row in a round (its sample: their median)")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    random.seed(0)
    doc = {"cpu": cpu_name(), "commit": commit_id(), "torch": torch.__version__, "dtype": args.dtype,
           "spread": args.spread, "rounds": args.rounds, "per_round": args.per_round,
           "loadavg_before": os.getloadavg(), "batches": []}
    print(f"{doc['cpu']}, {args.dtype}, spread {args.spread}, commit {doc['commit']}, load {os.getloadavg()[0]:.2f}")
    for m in (int(v) for v in args.batches.split(",")):
        calls, experts = calls_of(m, args.spread, dtype, gen)
        with torch.no_grad():
            same_bits = torch.equal(calls["grouped"](), calls["loop"]())
            samples = rounds(calls, m, dtype, args.rounds, args.per_round)
        doc["batches"].append({"M": m, "experts": experts, "same_bits": same_bits, "samples_s": samples})
        print(f"M={m} ({experts} experts) grouped has loop's bits: {same_bits}; load {os.getloadavg()[0]:.2f}")
        for name, s in samples.items():
            wins = sum(a < 0.97 * b for a, b in zip(s, samples["loop"]))
            ratio = statistics.median(s) / statistics.median(samples["loop"])
            print(f"  {name:14s} {statistics.median(s) * 1e3:8.3f} ms  / loop {ratio:.3f}  "
                  f"rounds >= 3% faster than loop {wins}/{args.rounds}", flush=True)
    doc["loadavg_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
