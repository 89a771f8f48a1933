"""The host Python of one eager words-decode call before and after its lean launch (``triton_wo_words_lean``, issue 16,
session 46, brief wl46 item 1) against the route's pick, on the CPU with every kernel launch stubbed: what each call
costs the host in Python before its kernels are enqueued.

    PYTHONPATH=$PWD python3 benchmarks/wl46_host_cpu.py        # ~1 min on one core

Per cell (DeepSeek-V3 / Mixtral experts and top-k on N = K = 512, the host path reads shapes only; int4_w4a16 and
mxfp4; M = 1 and 8): µs a call, the median of ROUNDS rounds of CALLS calls (the variants
interleaved a round), of
  words before  w4u45's route body (``experts_words`` after ``words_layout``: the checks, the layout, x_words, h, y,
                out, four cached launches a call)
  words lean    ``run_experts_wo(decode="gluon_words")`` from its third call: the refusals, the plan's key, the kept
                sequence's lookup, out, the recorded launches
  pick plain    ``run_experts_wo`` (the plan lookup, a fresh workspace, ``wo_launches``)
  pick lean     ``experts_triton`` on the ``moekit.quant`` weights (its argument checks, then ``triton_quant_fast``'s
                kept entry: the recorded launches)
The stub: a launch's first call makes a no-op its compiled launcher, so the lean paths record it as a device run's
first call would; each recorded step is then one Python call of the no-op (on the device the raw C launch, or one C
call for the whole sequence where every launch is raw: ``batch_launch``). Under the interpreter no launch is raw, so
both lean paths pay a Python call a step here.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the plans' device checks pass on the CPU

import torch  # noqa: E402

from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_wo import run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_plan import weight_args  # noqa: E402
from moekit.experts.triton_wo_words import down_split, experts_words, words_layout  # noqa: E402
from moekit.experts.triton_wo_words_lean import run_words  # noqa: E402
from moekit.quant.int4 import Int4Weight  # noqa: E402
from moekit.quant.mxfp4 import Mxfp4Weight  # noqa: E402
from moekit.triton_bind import BoundLaunch  # noqa: E402

CALLS, ROUNDS, WARM = 200, 7, 20
CELLS = (("deepseek-v3", 256, 8), ("mixtral-8x7b", 8, 2))  # (name, E, top_k): the presets' routing on N = K = 512
N = K = 512


def _noop(*args) -> None:
    return None


def stub_launches() -> None:
    """Every ``BoundLaunch``: its first call makes ``_noop`` its compiled launcher (nothing runs)."""

    def first_call(self, *pointers) -> None:
        if self._launcher is None:
            self._launcher = _noop
        self._launcher(*pointers, *self.tail)

    BoundLaunch.__call__ = first_call


def quant(scheme: str, e: int, rows: int, cols: int):
    """(the ``moekit.quant`` weight, its ``WeightArgs``) of zeros: the host path reads shapes and addresses only."""
    q = torch.zeros(e, rows, cols // 2, dtype=torch.uint8)
    if scheme == "mxfp4":
        w = Mxfp4Weight(q=q, scale=torch.full((e, rows, cols // 32), 120, dtype=torch.uint8), cols=cols)
        return w, weight_args(w.q, w.scale, None, 32)
    w = Int4Weight(q=q, scale=torch.ones(e, rows, cols // 128), zero=torch.zeros(e, rows, cols // 128,
                                                                                   dtype=torch.uint8),
                   group_size=128, cols=cols)
    return w, weight_args(w.q, w.scale, w.zero, 128)


def per_call_us(fns: dict) -> dict:
    """name -> µs a call: the median of ROUNDS rounds, each round every variant's CALLS calls in turn (the machine
    is shared: interleaved, a slow spell falls on every variant of its round)."""
    for fn in fns.values():
        for _ in range(WARM):
            fn()
    rounds = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            rounds[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    return {name: statistics.median(r) for name, r in rounds.items()}


def variants(scheme: str, e: int, top_k: int, m: int) -> dict:
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    x, weights = torch.zeros(m, K, dtype=torch.bfloat16), torch.full((m, top_k), 1.0 / top_k)
    (q13, a13), (q2, a2) = quant(scheme, e, 2 * N, K), quant(scheme, e, K, N)

    def before():
        layout = words_layout(ids, e)
        blocks = ids.numel() if layout is None else layout.expert_ids.numel()
        return experts_words(x, a13, a2, ids, weights, layout, down_split(N, K, blocks))

    def lean():
        return run_experts_wo(x, a13, a2, ids, weights, None, scheme, decode="gluon_words")

    fns = {"words before": before, "words lean": lean,
           "pick plain": lambda: run_experts_wo(x, a13, a2, ids, weights, None, scheme),
           "pick lean": lambda: experts_triton(x, q13, q2, ids, weights)}
    for name in ("words before", "pick plain", "pick lean"):
        for _ in range(3):  # compiled (stubbed) and kept first: the pool they share has grown for them
            fns[name]()
    for _ in range(2):  # compiles, then records (the route's first two calls: on the CPU it refuses a miss)
        run_words(x, a13, a2, ids, weights)
    return fns


def main() -> int:
    stub_launches()
    torch.set_num_threads(1)
    print("cell | words before | words lean | pick plain | pick lean  (host µs a call, launches stubbed)")
    with torch.no_grad():
        for scheme in ("int4_w4a16", "mxfp4"):
            for name, e, top_k in CELLS:
                for m in (1, 8):
                    fns = variants(scheme, e, top_k, m)
                    row = [f"{us:.1f}" for us in per_call_us(fns).values()]
                    print(f"{name} {scheme} M={m} | " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
