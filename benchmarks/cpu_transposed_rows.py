"""gpt-oss's float32 experts at decode, stored transposed: the CPU loops' one-row experts on torch's BLAS against
oneDNN's linear (session 42).

gpt-oss-20b's expert shapes (E=32, N=2880, K=2880, k=4, biases, its clamped interleaved activation), the weights as
transformers stores them ([E, K, 2N] / [E, N, K]) and read as [E, 2N, K] / [E, K, N] views. ``--loop phased``:
``experts_cpu_phased`` (auto's unsplit decode mode); ``--loop split``: ``experts_cpu_fused`` on torch's threads.
"blas" runs experts of one row through ``cpu_packed.linear_rows``' BLAS on the stored layout (``one_row_blas``: what
``cpu_loop.one_row_blas_rows`` gives these weights since session 42), "onednn" through oneDNN's linear on the view
(before); experts of more rows run oneDNN's linear in both. Each call follows an
LM-head GEMM (as in a decode step) and cycles over 3 fixed routings. Per round each variant runs ``--calls`` calls,
the order alternating between rounds; prints the medians (ms), blas / onednn per round, whether both modes of each
variant gave the same bits, and the relative error of each against a float64 loop on the first routing.

    flock /work/wt/cpubench.lock python3 benchmarks/cpu_transposed_rows.py --batches 1,4 [--loop split] [--threads 1]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_gemv_rows import loop_args  # noqa: E402
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused  # noqa: E402
from moekit.experts.cpu_phased import experts_cpu_phased  # noqa: E402

E, N, K, TOP_K, VOCAB = 32, 2880, 2880, 4, 32000
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)


def one_call(loop: str, blas: bool, x, ex, ids, weights) -> torch.Tensor:
    if loop == "split":
        return experts_cpu_fused(x, ex, ids, weights, None, None, workers=torch.get_num_threads(), one_row_blas=blas)
    return experts_cpu_phased(x, ex, ids, weights, None, None, one_row_blas=blas)


def timed_calls(loop, blas, x, ex, routings, weights, head, calls) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of ``calls`` calls, each after the head's GEMM; and their outputs."""
    seconds, outs = [], []
    for i in range(calls):
        torch.mm(x[:1], head.t())  # [1, V]: the op before the experts in a decode step
        start = time.perf_counter()
        outs.append(one_call(loop, blas, x, ex, routings[i % 3], weights))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), outs


def float64_loop(x, ex: ExpertParams, ids, weights) -> torch.Tensor:
    """The experts contract one (token, slot) at a time in float64: x [M, K] -> [M, K]."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = ex.w13[e].double() @ x[t].double() + ex.b13[e].double()  # [2N], gate / up interleaved
            gate, up = h[0::2].clamp(max=GPT_OSS.limit), h[1::2].clamp(-GPT_OSS.limit, GPT_OSS.limit)
            a = gate * torch.sigmoid(GPT_OSS.alpha * gate) * (up + GPT_OSS.up_shift)  # [N]
            out[t] += weights[t, s].double() * (ex.w2[e].double() @ a + ex.b2[e].double())
    return out


def main() -> None:
    args = loop_args(__doc__.split("\n")[0], "1,4", 6)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, K, 2 * N, generator=g) * 0.02).transpose(1, 2)  # [E, 2N, K] view of [E, K, 2N]
    w2 = (torch.randn(E, N, K, generator=g) * 0.02).transpose(1, 2)  # [E, K, N] view of [E, N, K]
    ex = ExpertParams(w13, w2, torch.randn(E, 2 * N, generator=g) * 0.1, torch.randn(E, K, generator=g) * 0.1, GPT_OSS)
    head = torch.randn(VOCAB, K, generator=g) * 0.02  # [V, K]
    print(f"fp32, {args.loop} loop, threads {torch.get_num_threads()}, load {os.getloadavg()}")
    for m in (int(v) for v in args.batches.split(",")):
        x = torch.randn(m, K, generator=g)  # [M, K]
        routings = [torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices for _ in range(3)]  # each [M, k]
        weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1)  # [M, k]
        times, firsts = {"onednn": [], "blas": []}, {}
        with torch.no_grad():
            for r in range(args.rounds):
                order = [("onednn", False), ("blas", True)]
                for name, blas in order if r % 2 == 0 else order[::-1]:
                    seconds, outs = timed_calls(args.loop, blas, x, ex, routings, weights, head, args.calls)
                    times[name].append(seconds * 1e3)
                    firsts.setdefault(name, outs[0])
            ref = float64_loop(x, ex, routings[0], weights)
            other = "phased" if args.loop == "split" else "split"
            same = {n: torch.equal(firsts[n], one_call(other, n == "blas", x, ex, routings[0], weights))
                    for n in firsts}
        errs = {n: f"{((o.double() - ref).norm() / ref.norm()).item():.2e}" for n, o in firsts.items()}
        ratios = [round(b / a, 3) for a, b in zip(times["onednn"], times["blas"])]
        med = {n: f"{statistics.median(v):.2f}" for n, v in times.items()}
        print(f"M={m}: onednn {med['onednn']} ms, blas {med['blas']} ms; blas / onednn per round {ratios}; "
              f"same bits as the {other} loop: {same}; rel. err vs float64 {errs}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
