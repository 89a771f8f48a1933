"""The CPU experts loop's GEMM for experts of < 4 rows, and what the call before it costs (session 30).

Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8), uniform random routing, ``experts_grouped_mm`` four ways
per round: ``auto`` (what the rule ``cpu_packed.blas_plain_rows`` picks on this machine), ``auto_blas`` /
``auto_onednn`` (the split loop with the rule forced on / off), ``grouped_mm`` (the contiguous layout's 2-thread
grouped GEMM, as transformers' ``grouped_mm`` runs). The order is rotated, NOT shuffled, on purpose: each call
always follows the same one (``auto`` follows ``grouped_mm``), so with OpenMP's default active waiting the cost of
the previous call's spinning threads shows as ``auto`` against ``auto_blas`` (the same code); run it again with
``OMP_WAIT_POLICY=PASSIVE`` to see them equal. Prints per M the medians (ms) and the rounds >= 3% faster than
``auto_onednn``.

    OMP_NUM_THREADS=2 python benchmarks/cpu_blas_rows.py --dtype float32 --batches 1,8,64 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moekit.experts import cpu_loop as gm
from moekit.experts.grouped_mm import experts_grouped_mm

E, N, K, TOP_K = 128, 768, 2048, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,8,64", help="token counts M, comma-separated")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dtype)  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dtype)  # [E, K, N]
    rule = gm.blas_plain_rows
    variants = [("auto", {}, rule), ("auto_blas", {}, lambda d: True), ("auto_onednn", {}, lambda d: False),
                ("grouped_mm", {"layout": "contiguous", "cpu_gemm": "grouped_mm"}, rule)]
    print(f"{args.dtype}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"rule says BLAS: {rule(dtype)}, load {os.getloadavg()[0]:.2f}")
    for m in (int(v) for v in args.batches.split(",")):
        x = torch.randn(m, K, generator=g).to(dtype)  # [M, K]
        ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices  # [M, k]
        weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).to(dtype)  # [M, k]
        samples = {name: [] for name, _, _ in variants}
        with torch.no_grad():
            for r in range(args.rounds + 1):  # round 0 warms up
                for name, options, choice in variants[r % 4:] + variants[:r % 4]:
                    gm.blas_plain_rows = choice
                    t0 = time.perf_counter()
                    experts_grouped_mm(x, w13, w2, ids, weights, **options)
                    if r:
                        samples[name].append(time.perf_counter() - t0)
        gm.blas_plain_rows = rule
        base = samples["auto_onednn"]
        medians = {n: f"{statistics.median(v) * 1e3:.2f}" for n, v in samples.items()}
        wins = {n: sum(a < 0.97 * b for a, b in zip(v, base)) for n, v in samples.items() if n != "auto_onednn"}
        print(f"M={m} ms {medians}; rounds >= 3% faster than auto_onednn (of {args.rounds}): {wins}", flush=True)


if __name__ == "__main__":
    main()
