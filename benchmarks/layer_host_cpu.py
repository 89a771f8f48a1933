"""Host time of the eager ``moekit.MoE`` layer on the CPU, Triton launches stubbed (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/layer_host_cpu.py [--calls 2000] [--repeats 15]

Every Triton kernel (experts and fused router) is replaced by a stand-in that keeps the kernel's Python
signature (what ``BoundLaunch`` reads) and launches nothing, so what is timed is the Python and torch
host work around the launches: argument checks, plans, allocations, dispatch. Tiny shapes (Qwen3-30B-A3B's
E=128, k=8 with K=64, N=32; Mixtral's E=8, k=2), M=1, bf16, ``backend="triton"``, ``router="fused"``.
Stages, each timed alone: ``gate`` (``MoE._router_logits``, what the layer runs: the Triton gate, stubbed),
``gate_torch`` (``F.linear``, the gate before: real work on the CPU, ~15 µs of Qwen3's bf16 [1, 64] x [64, 128]),
``router`` (the fused router on those logits), ``check`` (``check_experts_args``), ``experts``
(``call_backend``: the check and the backend), ``route_tokens`` (gate + router + glue, into the kept buffers as forward
runs it), the whole
``layer`` (a repeated call: its decode fast path, ``moekit.layer_fast``), ``layer_nofast`` (that path off: the
forward as before), and ``glue`` = layer_nofast - route_tokens - experts. Then the experts call alone at M = 1, 8, 512,
4096 (Qwen3's E and k; ids int32 and weights fp32 as the fused router makes them): ``experts_triton`` (the public
call: the check, then the lean launch), ``layer_call`` (what forward runs: ``MoE._experts_call``, the check
once per weight set), ``two_layers`` (``experts_triton`` on two weight sets of one shape in turn, per call:
a model's layers) and ``plans`` (how many plans were built: 1 per M, nothing rebuilt per call); at M = 4096
the workspace pool's ``max_bytes`` is set below the plan's workspace, as at real shapes (Qwen3-30B-A3B's h and
y are ~180 MiB there), so h and y are one fresh buffer per call. µs per call, median over repeats (the
machine is shared: medians, not means); ``uptime`` before and after says how loaded it was. ``--profile M``
prints a cProfile of the layer call at that M (own time) instead; ``--parts`` the decode fast path's pieces per
M (``parts_rows``) for Qwen3, DeepSeek-V3 (sigmoid, groups, correction bias, a fused shared slot) and Mixtral.
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

from moekit import MoEConfig, layer_fast  # noqa: E402
from moekit.experts import call_backend, check_experts_args  # noqa: E402
from moekit.experts import triton as experts_triton_module  # noqa: E402
from moekit.experts.triton_plan import _PLANS  # noqa: E402
from moekit.layer import MoE  # noqa: E402

KERNEL_MODULES = ("moekit.experts._kernels.align", "moekit.experts._kernels.combine", "moekit.experts._kernels.gemm",
                  "moekit.routing._kernels.route_kernel", "moekit.routing._kernels.gate_kernel",
                  "moekit.routing._kernels.gate_route_kernel")


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
    reals = [importlib.import_module(name) for name in KERNEL_MODULES]  # all before any stub: they import each other
    for name, real in zip(KERNEL_MODULES, reals):
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
            "layer_nofast": lambda: _without_fast(layer, x),
        }
        row = {"preset": name, **{k: round(per_call_us(f, calls, repeats), 1) for k, f in fns.items()}}
    row["glue"] = round(row["layer_nofast"] - row["route_tokens"] - row["experts"], 1)
    return row


def _without_fast(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The forward with its decode fast path off (``moekit.layer_fast``)."""
    layer_fast.ENABLED = False
    try:
        return layer(x)
    finally:
        layer_fast.ENABLED = True


EXPERTS_BATCHES = (1, 8, 512, 4096)
LARGE_FROM = 4096  # from this M the pool keeps only the alignment's regions (as at real shapes)


def experts_rows(config: MoEConfig, calls: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    """The experts call alone per M: the public ``experts_triton`` and the layer's cached call."""
    layer = MoE(config, backend="triton", router="fused", dtype=dtype).eval()
    other = MoE(config, backend="triton", router="fused", dtype=dtype).eval()  # a second layer of the same shape
    w13, w2, act, pool = layer.w13, layer.w2, config.activation, experts_triton_module._WORKSPACES
    run = experts_triton_module.experts_triton
    out = []
    for m in EXPERTS_BATCHES:
        x = torch.randn(m, config.hidden_size, dtype=dtype)
        scores = torch.rand(m, config.num_experts)
        weights, ids = scores.topk(config.top_k, dim=-1)  # [M, k] fp32, int64
        ids = ids.to(torch.int32)
        kept = pool.max_bytes
        pool.max_bytes = 1 << 20 if m >= LARGE_FROM else kept
        plans = len(_PLANS)
        with torch.no_grad():
            fns = {
                "experts_triton": lambda: run(x, w13, w2, ids, weights, activation=act),
                "layer_call": lambda: layer._experts_call(layer._experts_fn, x, w13, w2, ids, weights, activation=act),
                "two_layers": lambda: (run(x, w13, w2, ids, weights, activation=act),
                                       run(x, other.w13, other.w2, ids, weights, activation=act)),
            }
            row = {"M": m, **{k: round(per_call_us(f, max(50, calls // (1 + m // 64)), repeats), 1)
                              for k, f in fns.items()}}
            row["two_layers"] = round(row["two_layers"] / 2, 1)  # per call
        row["plans"] = len(_PLANS) - plans
        pool.max_bytes = kept
        out.append(row)
    return out


def profile(config: MoEConfig, m: int, calls: int, dtype: torch.dtype) -> None:
    """cProfile of the layer's experts call at M = ``m``, by own time."""
    import cProfile
    import pstats

    layer = MoE(config, backend="triton", router="fused", dtype=dtype).eval()
    x = torch.randn(m, config.hidden_size, dtype=dtype)
    weights, ids = torch.rand(m, config.num_experts).topk(config.top_k, dim=-1)
    ids, act = ids.to(torch.int32), config.activation
    with torch.no_grad():
        fn = lambda: layer._experts_call(layer._experts_fn, x, layer.w13, layer.w2, ids, weights,  # noqa: E731
                                         activation=act)
        for _ in range(50):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


PARTS_BATCHES = (1, 8, 64, 256)


def parts_rows(name: str, config: MoEConfig, calls: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    """The layer's decode fast path per M, piece by piece (µs per call): ``layer`` (the whole call), ``forward``
    (no ``nn.Module.__call__``), ``decode`` (``DecodeFast``: its checks, the gate + router, the experts), ``route``
    (the gate + router alone: the one bound launch; above its rows ``torch.mm``, real CPU work here, and the
    router's bound launch), ``experts`` (the kept call), ``experts_fast`` (the backend's fast path: its own
    checks), ``nofast`` (the full forward, the fast path off), ``nokept`` (the fast path with the backend's fast
    path in place of the kept call)."""
    layer = MoE(config, backend="triton", router="fused", dtype=dtype).eval()
    out = []
    for m in PARTS_BATCHES:
        x = torch.randn(m, config.hidden_size, dtype=dtype)
        with torch.no_grad():
            for _ in range(3):
                layer(x)
            entry = layer._decode._entries[m]
            w, bias, b, w13, w2 = layer.gate.weight, layer.e_score_correction_bias, entry.buffers, layer.w13, layer.w2
            if entry.bound is not None:
                route = lambda: entry.bound(x, w, None, bias, None, b)  # noqa: E731
            else:
                route = lambda: (layer._gate(x, w, None, b.logits),  # noqa: E731
                                 entry.route(b.logits, bias, None, (b.ids, b.weights)))
            fns = {"layer": lambda: layer(x), "forward": lambda: layer.forward(x),
                   "decode": lambda: layer._decode(layer, x), "route": route,
                   "experts": lambda: entry.kept(x, w13, w2, b.ids, b.weights),
                   "experts_fast": lambda: entry.fast(x, w13, w2, b.ids, b.weights, entry.activation),
                   "nofast": lambda: _without_fast(layer, x)}
            row = {"preset": name, "M": m, **{k: round(per_call_us(f, calls, repeats), 1) for k, f in fns.items()}}
            kept, entry.kept = entry.kept, None
            row["nokept"] = round(per_call_us(lambda: layer(x), calls, repeats), 1)
            entry.kept = kept
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--profile", type=int, metavar="M", help="only a cProfile of the layer's experts call at M")
    p.add_argument("--parts", action="store_true", help="only the fast path's pieces per M (parts_rows)")
    a = p.parse_args()
    torch.set_num_threads(1)
    stub_kernels()
    qwen3 = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=128, top_k=8)
    mixtral = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    dtype = getattr(torch, a.dtype)
    if a.profile is not None:
        profile(qwen3, a.profile, a.calls, dtype)
        return
    if a.parts:
        deepseek = MoEConfig.preset("deepseek-v3").replace(hidden_size=64, moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=32)
        print(f"uptime: {os.getloadavg()}", flush=True)
        for name, config in (("qwen3", qwen3), ("deepseek-v3", deepseek), ("mixtral", mixtral)):
            for row in parts_rows(name, config, a.calls, a.repeats, dtype):
                print(row, flush=True)
        print(f"uptime: {os.getloadavg()}", flush=True)
        return
    print(f"uptime: {os.getloadavg()}", flush=True)
    for name, config, cf in (("qwen3", qwen3, None), ("mixtral", mixtral, None), ("qwen3 cf=1.25", qwen3, 1.25)):
        print(rows(name, config, a.calls, a.repeats, dtype, cf), flush=True)
    for row in experts_rows(qwen3, a.calls, a.repeats, dtype):
        print(row, flush=True)
    print(f"uptime: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
