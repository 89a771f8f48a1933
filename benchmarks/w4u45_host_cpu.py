"""The host Python of one eager words-decode call (``triton_wo_words``, decode "gluon_words") against the route's
plain weight-only call (``run_experts_wo``), on the CPU with every ``BoundLaunch`` stubbed (issue 16, session 45,
brief w4u45 item 2): what each call costs the host in Python before a kernel is enqueued.

    PYTHONPATH=$PWD python3 benchmarks/w4u45_host_cpu.py        # ~20 s on one core

Per cell (DeepSeek-V3 / Mixtral int4: their experts and top-k on a small N and K, M = 1 and 8; the host path
reads the weights' shapes only): µs a call, the median of ROUNDS rounds of CALLS calls, of
  words        ``experts_words`` with the layout made before (its checks, x_words' allocation and launch, h, y,
               out, the cached launches' lookups, four launches stubbed)
  words+layout ``run_experts_words``' body: the above plus ``words_layout`` (none at the tiny-batch shortcut, else
               the Triton alignment's 1-3 launches, stubbed)
  words+align_block  the same with ``align_block`` (torch) for the layout, the form merged in session 45: on the
               GPU its ~12-15 ops are launches too, here they run on the CPU, so an upper bound of their Python
  pick         ``run_experts_wo`` (the plan lookup, the workspace, ``wo_launches``; launches stubbed), the plain
               path; the lean path (``triton_quant_fast``: one recorded C call) is cheaper still and is not a
               Python function here (session 14's H200 figures: 29-58 µs a call for int4 at M <= 64)
Stubbing leaves the Python of ``BoundLaunch`` itself out (its C launch is ~5-10 µs a launch on the device).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")  # run_experts_wo's device check passes on the CPU

import torch  # noqa: E402

from moekit.experts.triton_wo import run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_plan import weight_args  # noqa: E402
from moekit.experts.triton_wo_words import experts_words, words_layout  # noqa: E402
from moekit.layouts.block_aligned import align_block  # noqa: E402
from moekit.triton_bind import BoundLaunch  # noqa: E402

CALLS, ROUNDS, WARM = 200, 7, 20
# (name, experts, top_k): the presets' E and k (they choose the tiny-batch shortcut or the aligned layout) on
# N = K = 512 (the host path reads the weights' shapes only)
CELLS = (("deepseek-v3", 256, 8), ("mixtral-8x7b", 8, 2))
N = K = 512


@dataclass
class Cell:
    name: str
    m: int
    x: torch.Tensor
    w13: object
    w2: object
    ids: torch.Tensor
    weights: torch.Tensor


def _int4(e: int, rows: int, cols: int):
    q = torch.zeros(e, rows, cols // 2, dtype=torch.uint8)
    scale = torch.ones(e, rows, cols // 128)
    zero = torch.zeros(e, rows, cols // 128, dtype=torch.uint8)
    return weight_args(q, scale, zero, 128)


def make_cell(name: str, e: int, top_k: int, m: int, n: int = N, k: int = K) -> Cell:
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    return Cell(name, m, torch.zeros(m, k, dtype=torch.bfloat16), _int4(e, 2 * n, k), _int4(e, k, n), ids,
                torch.full((m, top_k), 1.0 / top_k))


def per_call_us(fn) -> float:
    for _ in range(WARM):
        fn()
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(rounds)


def main() -> int:
    BoundLaunch.__call__ = lambda self, *pointers: None  # every kernel launch stubbed: the host's Python alone
    torch.set_num_threads(1)
    print("cell | words | words+layout | words+align_block | pick (plain)")
    for name, e, top_k in CELLS:
        for m in (1, 8):
            c = make_cell(name, e, top_k, m)
            layout = align_block(c.ids, e, 8)

            def words(c=c, layout=layout):
                return experts_words(c.x, c.w13, c.w2, c.ids, c.weights, layout, 1)

            def words_align(c=c):  # run_experts_words' body (it refuses the CPU by name), down split 1
                return experts_words(c.x, c.w13, c.w2, c.ids, c.weights, words_layout(c.ids, c.w13.q.shape[0]), 1)

            def words_align_before(c=c):  # the same with align_block at the shortcut too (the merged form)
                return experts_words(c.x, c.w13, c.w2, c.ids, c.weights, align_block(c.ids, c.w13.q.shape[0], 8), 1)

            def pick(c=c):
                return run_experts_wo(c.x, c.w13, c.w2, c.ids, c.weights, None, "int4_w4a16")

            row = [f"{per_call_us(fn):.1f}" for fn in (words, words_align, words_align_before, pick)]
            print(f"{name} int4 M={m} ({'naive' if layout.naive else 'aligned'}) | " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
