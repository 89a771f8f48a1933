"""What the weight-only device checks (``wo_mid_device_check.py``, ``wo_large_device_check.py``) share: a
GPU timer and the bf16 baseline their quantized cells are made from and compared with."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moekit.bench.cells import Shape, make_sets
from moekit.experts.triton import experts_triton


def do_bench_us(fn, warmup_ms: float, rep_ms: float) -> float:
    """Median µs per call (do_bench on the GPU; one timed call under the interpreter)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


@dataclass
class Bf16Baseline:
    w13: torch.Tensor  # [E, 2N, K] bf16 experts the quantized cells are made from
    w2: torch.Tensor  # [E, K, N]
    sets: dict  # M -> one routed input set (``make_sets``)
    us: dict  # M -> moekit's bf16 experts µs (``bench``)


def bf16_baseline(s: Shape, batches, dev, bench) -> Bf16Baseline:
    """Random bf16 experts of shape ``s`` (seed 0), an input set per M and the bf16 call timed by ``bench``."""
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(s.num_experts, 2 * s.n, s.k, device=dev, generator=g, dtype=torch.bfloat16) / s.k**0.5
    w2 = torch.randn(s.num_experts, s.k, s.n, device=dev, generator=g, dtype=torch.bfloat16) / s.n**0.5
    sets = {m: make_sets(s, m, 1, torch.bfloat16, dev, seed=m)[0] for m in batches}
    us = {m: bench(lambda c=c: experts_triton(c.x, w13, w2, c.topk_ids, c.topk_weights)) for m, c in sets.items()}
    return Bf16Baseline(w13, w2, sets, us)
