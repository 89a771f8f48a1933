"""Host time of the eager ``moekit.MoE`` layer on the CPU, Triton launches stubbed (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/layer_host_cpu.py [--calls 2000] [--repeats 15]

Every Triton kernel (experts and fused router) is replaced by a stand-in that keeps the kernel's Python
signature (what ``BoundLaunch`` reads) and launches nothing, so what is timed is the Python and torch
host work around the launches: argument checks, plans, allocations, dispatch. Tiny shapes (Qwen3-30B-A3B's
E=128, k=8 with K=64, N=32; Mixtral's E=8, k=2), M=1, bf16, ``backend="triton"``, ``router="fused"``.
Rows: the fused router alone, the experts call alone (``call_backend``), the gate, the whole layer;
µs per call, median over repeats (the machine is shared: medians, not means).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from moekit import MoEConfig  # noqa: E402
from moekit.experts import call_backend  # noqa: E402
from moekit.layer import MoE  # noqa: E402

KERNEL_MODULES = ("moekit.experts._kernels.align", "moekit.experts._kernels.combine", "moekit.experts._kernels.gemm",
                  "moekit.routing._kernels.route_kernel")


class _StubKernel:
    """A kernel that keeps its signature (``fn``, ``arg_names``) and launches nothing."""

    def __init__(self, kernel):
        self.fn, self.arg_names = kernel.fn, kernel.arg_names

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


def stub_kernels() -> None:
    """Put launch-free stand-ins of every kernel module into ``sys.modules`` (where the lazy imports look)."""
    for name in KERNEL_MODULES:
        real = importlib.import_module(name)
        stub = types.ModuleType(name)
        for attr, value in vars(real).items():
            setattr(stub, attr, _StubKernel(value) if hasattr(value, "fn") and hasattr(value, "arg_names") else value)
        sys.modules[name] = stub


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def rows(name: str, config: MoEConfig, calls: int, repeats: int, capacity_factor=None) -> dict:
    layer = MoE(config, backend="triton", router="fused", dtype=torch.bfloat16, capacity_factor=capacity_factor).eval()
    x = torch.randn(1, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = layer.gate(x)
        routing = layer._fused_router(logits, layer.e_score_correction_bias)
        fns = {
            "router": lambda: layer._fused_router(logits, layer.e_score_correction_bias),
            "gate": lambda: layer.gate(x),
            "experts": lambda: call_backend(layer._experts_fn, x, layer.w13, layer.w2, routing.topk_ids,
                                            routing.topk_weights, activation=config.activation),
            "route_tokens": lambda: layer.route_tokens(x),
            "layer": lambda: layer(x),
        }
        return {"preset": name, **{k: round(per_call_us(f, calls, repeats), 1) for k, f in fns.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    stub_kernels()
    qwen3 = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=128, top_k=8)
    mixtral = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    for name, config, cf in (("qwen3", qwen3, None), ("mixtral", mixtral, None), ("qwen3 cf=1.25", qwen3, 1.25)):
        r = rows(name, config, a.calls, a.repeats, cf)
        r["layer - experts"] = round(r["layer"] - r["experts"], 1)
        print(r, flush=True)


if __name__ == "__main__":
    main()
