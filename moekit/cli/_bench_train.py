"""``moekit bench --train``: forward + backward of the experts path per implementation (the library is
``moekit.bench.train_measure``)."""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training step (--train)")
    g.add_argument("--train", action="store_true",
                   help="time forward + backward (routing included) of moekit's experts backends against transformers' "
                   "grouped_mm experts at M = 4096 and 16384 (--batches to change; tiny sizes on the CPU), with Triton "
                   "the training entry's rows triton_train (gate-up recomputed) and triton_kept (kept: auto's pick "
                   "from 1024 to 16384 tokens); JSON under --out")


def run(args: argparse.Namespace, device) -> int:
    from rich.console import Console

    from moekit.bench.report import results_path, write_json
    from moekit.bench.train_measure import TRANSFORMERS_IMPL, measure_train

    impls = None if not args.backends else [f"moekit:{b}" for b in args.backends] + [TRANSFORMERS_IMPL]
    console = Console(width=140, highlight=False)
    start = time.perf_counter()

    def log(message: str) -> None:
        console.print(f"[{time.perf_counter() - start:6.1f} s] {message}", markup=False)

    doc = measure_train(device, args.shapes, args.batches, impls, log)
    for s in doc["speedups"]:
        console.print(f"{s['shape']} M={s['tokens']} {s['impl']}: {s['speedup_vs_transformers']:.2f}x "
                      f"transformers:grouped_mm")
    path = write_json(doc, results_path(args.out, {"device": f"{doc['device']}-train", "date": doc["date"]}))
    console.print(f"wrote {path}")
    return 0
