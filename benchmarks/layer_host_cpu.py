"""Host time of the eager ``moekit.MoE`` layer on the CPU, Triton launches stubbed (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/layer_host_cpu.py [--calls 2000] [--repeats 15]

Every Triton kernel (experts and fused router) is replaced by a stand-in that keeps the kernel's Python
signature (what ``BoundLaunch`` reads) and launches nothing, so what is timed is the Python and torch
host work around the launches: argument checks, plans, allocations, dispatch. Tiny shapes (Qwen3-30B-A3B's
E=128, k=8 with K=64, N=32; Mixtral's E=8, k=2), M=1, bf16, ``backend="triton"``, ``router="fused"``.
Stages, each timed alone: ``gate`` (``MoE._router_logits``, what the layer runs: the Triton gate, stubbed),
``gate_torch`` (``F.linear``, the gate before: real work on the CPU, ~15 µs of Qwen3's bf16 [1, 64] x [64, 128]),
``router`` (the fused router on those logits), ``check`` (``check_experts_args``), ``experts``
(``call_backend``: the check and the backend), ``route_tokens`` (gate + router + glue, into the kept buffers as forward runs it), the whole
``layer``, and ``glue`` = layer - route_tokens - experts. µs per call, median over repeats (the machine is
shared: medians, not means); ``uptime`` before and after says how loaded it was.
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
from moekit.experts import call_backend, check_experts_args  # noqa: E402
from moekit.layer import MoE  # noqa: E402

KERNEL_MODULES = ("moekit.experts._kernels.align", "moekit.experts._kernels.combine", "moekit.experts._kernels.gemm",
                  "moekit.routing._kernels.route_kernel", "moekit.routing._kernels.gate_kernel")


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


def rows(name: str, config: MoEConfig, calls: int, repeats: int, dtype: torch.dtype, capacity_factor=None) -> dict:
    layer = MoE(config, backend="triton", router="fused", dtype=dtype, capacity_factor=capacity_factor).eval()
    x = torch.randn(1, config.hidden_size, dtype=dtype)
    with torch.no_grad():
        logits = layer._router_logits(x)
        bias, w13, w2 = layer.e_score_correction_bias, layer.w13, layer.w2
        routing = layer._fused_router(logits, bias)
        ids, weights, act = routing.topk_ids, routing.topk_weights, config.activation
        fns = {
            "gate": lambda: layer._router_logits(x),
            "gate_torch": lambda: torch.nn.functional.linear(x, layer.gate.weight),
            "router": lambda: layer._fused_router(logits, bias),
            "check": lambda: check_experts_args(x, w13, w2, ids, weights, activation=act),
            "experts": lambda: call_backend(layer._experts_fn, x, w13, w2, ids, weights, activation=act),
            "route_tokens": lambda: layer.route_tokens(x, layer._route_ws),  # as forward calls it
            "layer": lambda: layer(x),
        }
        row = {"preset": name, **{k: round(per_call_us(f, calls, repeats), 1) for k, f in fns.items()}}
    row["glue"] = round(row["layer"] - row["route_tokens"] - row["experts"], 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = p.parse_args()
    torch.set_num_threads(1)
    stub_kernels()
    qwen3 = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=128, top_k=8)
    mixtral = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    print(f"uptime: {os.getloadavg()}", flush=True)
    for name, config, cf in (("qwen3", qwen3, None), ("mixtral", mixtral, None), ("qwen3 cf=1.25", qwen3, 1.25)):
        print(rows(name, config, a.calls, a.repeats, getattr(torch, a.dtype), cf), flush=True)
    print(f"uptime: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
