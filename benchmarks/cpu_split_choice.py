"""``cpu_gemm="auto"`` at decode sizes on a quiet machine and with a neighbour: the online split / unsplit choice
(``moekit.experts.cpu_split_choice``) against each mode forced, and transformers' way (session 31).

Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8), uniform random routing, M tokens. Every call follows a
2-thread GEMM ([M, K] @ [K, 4096], as the router / attention before the experts in a model, so libgomp's idle thread
spins into it). Per round, in a shuffled order: ``auto`` (``experts_grouped_mm``, the chooser), ``split`` (the split
loop forced), ``phased`` (the unsplit loop in phases forced), ``grouped_mm`` (the contiguous layout's 2-thread
grouped GEMM, as transformers' ``grouped_mm`` runs). Three phases: quiet, with neighbours (``--neighbours`` busy
Python processes, each one core's worth of someone else's work), quiet again. Prints per phase the medians (ms),
the modes ``auto`` ran and the rounds in which ``auto`` was >= 3% faster than ``split``; the JSON has every sample.

    flock /work/wt/cpubench.lock python3 benchmarks/cpu_split_choice.py --dtype bfloat16 --batches 1 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from moekit.activations import ActivationSpec
from moekit.experts import cpu_split_choice
from moekit.experts.cpu_packed import ExpertParams, blas_plain_rows, experts_cpu_fused, packed_weight_cache
from moekit.experts.cpu_phased import experts_cpu_phased
from moekit.experts.grouped_mm import experts_grouped_mm

E, N, K, TOP_K = 128, 768, 2048, 8
PHASES = ("quiet", "neighbour", "quiet again")


def variants(x, w13, w2, ids, weights):
    """name -> a call of [M, K] -> [M, K] (each preceded by the 2-thread GEMM in ``rounds``)."""
    ex = ExpertParams(w13, w2, None, None, ActivationSpec("silu"))
    blas, cache, threads = blas_plain_rows(x.dtype), packed_weight_cache(), torch.get_num_threads()
    return {
        "auto": lambda: experts_grouped_mm(x, w13, w2, ids, weights),
        "split": lambda: experts_cpu_fused(x, ex, ids, weights, None, cache, workers=threads, blas_plain=blas),
        "phased": lambda: experts_cpu_phased(x, ex, ids, weights, None, cache, blas_plain=blas),
        "grouped_mm": lambda: experts_grouped_mm(x, w13, w2, ids, weights, layout="contiguous", cpu_gemm="grouped_mm"),
    }


def rounds(calls, before, count: int) -> dict[str, list[float]]:
    """``count`` rounds of every call in a shuffled order, each after ``before()``: seconds per call."""
    samples = {name: [] for name in calls}
    for _ in range(count):
        order = list(calls)
        random.shuffle(order)
        for name in order:
            before()
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t0)
    return samples


def count_modes(chooser: cpu_split_choice.SplitChooser) -> list[str]:
    """The modes ``chooser`` picks from now on, appended to the returned list as it picks them."""
    ran, choose = [], chooser.choose
    chooser.choose = lambda key: ran.append(choose(key)) or ran[-1]
    return ran


def neighbours(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1", help="token counts M, comma-separated")
    p.add_argument("--rounds", type=int, default=40, help="rounds per phase")
    p.add_argument("--neighbours", type=int, default=1, help="busy processes in the neighbour phase")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dtype)  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dtype)  # [E, K, N]
    wr = torch.randn(K, 4096, generator=g).to(dtype)  # [K, 4096]
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(), "neighbours": args.neighbours, "cells": []}
    print(f"{args.dtype}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for m in (int(v) for v in args.batches.split(",")):
        x = torch.randn(m, K, generator=g).to(dtype)  # [M, K]
        ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices  # [M, k]
        weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).to(dtype)  # [M, k]
        calls = variants(x, w13, w2, ids, weights)
        with torch.no_grad():
            rounds(calls, lambda: (x @ wr).sum(), 3)  # warm-up (the chooser's first calls among them)
            for phase in PHASES:
                busy = neighbours(args.neighbours if phase == "neighbour" else 0)
                ran = count_modes(cpu_split_choice.split_chooser())
                try:
                    samples = rounds(calls, lambda: (x @ wr).sum(), args.rounds)
                finally:
                    del cpu_split_choice.split_chooser().choose  # the class's again
                    for proc in busy:
                        proc.kill()
                        proc.wait()
                report(result, m, phase, samples, ran)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def report(result: dict, m: int, phase: str, samples: dict[str, list[float]], ran: list[str]) -> None:
    medians = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
    wins = sum(a <= 0.97 * s for a, s in zip(samples["auto"], samples["split"]))
    modes = {mode: ran.count(mode) for mode in cpu_split_choice.MODES}
    print(f"M={m} {phase:11s} load {os.getloadavg()[0]:.2f} " + "  ".join(f"{n} {v:7.2f}" for n, v in medians.items())
          + f" ms | auto ran {modes}, >= 3% faster than split in {wins}/{len(samples['auto'])} rounds")
    result["cells"].append({"M": m, "phase": phase, "medians_ms": medians, "auto_modes": modes,
                            "auto_wins_vs_split": wins, "samples_s": samples, "load1": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
