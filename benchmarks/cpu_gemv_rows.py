"""The CPU decode loops' one-row bf16 experts as a matrix-vector product (``torch.mv``) against ``torch.mm``.

Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8). ``--loop phased``: ``experts_cpu_phased`` (auto's unsplit
decode mode) with BLAS rows; ``--loop split``: ``experts_cpu_fused`` on 2 workers with ``one_row_blas``. "mv" runs
one bf16 row through ``torch.mv`` / ``addmv`` (``cpu_packed.bf16_row_gemv`` held True: session 34's rule, what an
AMX CPU runs), "mm" through ``torch.mm`` (held False: what a CPU without AMX runs since session 42). Each call
follows a 2-thread GEMM of the LM head's size (as in a decode step) and cycles over 3 fixed routings. Per round each
variant runs ``--calls`` calls, the order alternating between rounds; prints the medians (ms), mv / mm per round,
and whether the two gave the same bits on every call.

    flock /work/wt/cpubench.lock python3 benchmarks/cpu_gemv_rows.py --batches 1,8 [--loop split] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moekit.activations import as_spec
from moekit.experts import cpu_packed
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused
from moekit.experts.cpu_phased import experts_cpu_phased

E, N, K, TOP_K, VOCAB = 128, 768, 2048, 8, 32000
SHIPPED = cpu_packed.bf16_row_gemv


def one_call(loop: str, x, ex, ids, weights) -> torch.Tensor:
    """One experts call of ``loop`` ("phased" / "split")."""
    if loop == "split":
        return experts_cpu_fused(x, ex, ids, weights, None, None, workers=2, one_row_blas=True)
    return experts_cpu_phased(x, ex, ids, weights, None, None, blas_plain=True)


def timed_calls(loop, mv: bool, x, ex, routings, weights, head, calls) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of ``calls`` calls of ``loop``, one bf16 row as mv (``mv``) or mm, each after the head's GEMM."""
    cpu_packed.bf16_row_gemv = lambda: mv
    seconds, outs = [], []
    try:
        for i in range(calls):
            torch.mm(x[:1], head.t())  # [1, V]: the op before the experts in a decode step
            start = time.perf_counter()
            outs.append(one_call(loop, x, ex, routings[i % 3], weights))
            seconds.append(time.perf_counter() - start)
    finally:
        cpu_packed.bf16_row_gemv = SHIPPED
    return statistics.median(seconds), outs


def loop_args(description: str, batches: str, calls: int) -> argparse.Namespace:
    """The options of the CPU loops' A/B scripts (this one, ``cpu_transposed_rows.py``), torch's threads set."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batches", default=batches, help="token counts M, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=calls)
    p.add_argument("--loop", default="phased", choices=["phased", "split"])
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = loop_args(__doc__.split("\n")[0], "1,8", 12)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    ex = ExpertParams((torch.randn(E, 2 * N, K, generator=g) * 0.02).to(dtype),  # w13 [E, 2N, K]
                      (torch.randn(E, K, N, generator=g) * 0.02).to(dtype), None, None, as_spec("silu"))  # w2 [E, K, N]
    head = (torch.randn(VOCAB, K, generator=g) * 0.02).to(dtype)  # [V, K]
    print(f"bf16, {args.loop} loop, threads {torch.get_num_threads()}, shipped here: "
          f"{'mv' if SHIPPED() else 'mm'}, load {os.getloadavg()}")
    for m in (int(v) for v in args.batches.split(",")):
        x = torch.randn(m, K, generator=g).to(dtype)  # [M, K]
        routings = [torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices for _ in range(3)]  # each [M, k]
        weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1)  # [M, k]
        times, same = {"mm": [], "mv": []}, True
        with torch.no_grad():
            for r in range(args.rounds):
                order = [("mm", False), ("mv", True)]
                outs = {}
                for name, mv in order if r % 2 == 0 else order[::-1]:
                    seconds, outs[name] = timed_calls(args.loop, mv, x, ex, routings, weights, head, args.calls)
                    times[name].append(seconds * 1e3)
                same &= all(torch.equal(a, b) for a, b in zip(outs["mm"], outs["mv"]))
        ratios = [round(b / a, 3) for a, b in zip(times["mm"], times["mv"])]
        print(f"M={m}: mm {statistics.median(times['mm']):.3f} ms, mv {statistics.median(times['mv']):.3f} ms; "
              f"mv / mm per round {ratios}; same bits on every call: {same}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
