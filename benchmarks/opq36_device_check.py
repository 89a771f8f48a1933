"""opq36: moekit's other GPU ops without custom_op's autograd layer (``triton_experts_fp8``, ``triton_experts_wo``,
``route_fused``, ``align_block_triton`` through ``op_library.define_inference_op``, their bodies' options and plans
cached) on the GPU, against main's registrations (``opq36_before``: custom_op around main's bodies): correct, the
host / wall cost of a call, and an fp8 MoE stack compiled without CUDA graphs.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/opq36_device_check.py --out $OUT/opq36 --deadline 72   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/opq36_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/opq36.json rewritten after each):
  correct  per op at a real shape: DeepSeek-V3 fp8_block experts (E = 256, K = 7168, N = 2048, k = 8, blocks 128)
           at M = 1 and 64, Qwen3-30B-A3B int4_w4a16 experts (E = 128, K = 2048, N = 768, k = 8, groups of 128) at
           M = 1, the fused router at DeepSeek-V3's config (E = 256, 8 groups, 4 kept, sigmoid, bias) at M = 1, the
           alignment at Qwen3's M = 64 (A = 512, E = 128, blocks of 16): the op bit-equal to main's form and to its
           body called directly; each op's public entry compiled fullgraph under no_grad holds the op (its name in
           the traced graph), never main's or an ``*_autograd`` form.
  op       host µs a call (``calls`` calls queued behind ~1 ms of GPU work) and wall µs, after (the op) / before
           (main's form), 5 interleaved rounds, under no_grad (``bench_run.host_and_wall_us``).
  stack    8 MoE layers at Qwen3-30B-A3B's widths, fp8_block experts (``MoE.quantize_``), bf16, the fused router,
           ``x + layer(x)`` each, compiled with inductor, mode "default" (no CUDA graphs: the ops' dispatch runs every
           step), after (the shipped ops) and before (main's forms: ``opq36_before.use_before`` while tracing and
           running), one decode step (M = 1) a call: the traced graphs' ops, outputs bit-equal, ms a step, 5
           interleaved rounds.
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Callable

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opq36_before as before  # noqa: E402
from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, host_and_wall_us, raise_recompile_limit, run_info, run_phases  # noqa: E402
from moekit import MoE, MoEConfig  # noqa: E402
from moekit.experts import triton_align, triton_fp8, triton_wo  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.routing.fused import FusedRouter  # noqa: E402

ROUNDS = 2 if SMOKE else 5
CALLS, STEPS = (2, 2) if SMOKE else (100, 20)  # op calls / stack steps a timed run
FP8 = (8, 256, 128, 2) if SMOKE else (256, 7168, 2048, 8)  # E, K, N, k: DeepSeek-V3
QWEN3 = (8, 128, 64, 2) if SMOKE else (128, 2048, 768, 8)  # E, K, N, k: Qwen3-30B-A3B
GROUP = 32 if SMOKE else 128  # int4 group size
ROUTER = MoEConfig(hidden_size=64, moe_intermediate_size=64, num_experts=16 if SMOKE else 256, top_k=4 if SMOKE else 8,
                   scoring="sigmoid", n_group=4 if SMOKE else 8, topk_group=2 if SMOKE else 4,
                   routed_scaling_factor=2.5, use_correction_bias=True)
RUN = RunLog("opq36: the other GPU ops without custom_op's autograd layer (µs a call / ms a step, interleaved rounds)",
             stall_s=90)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"op": 10, "stack": 35}  # a phase starts only this long before the deadline (s)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def routing(m: int, num_experts: int, top_k: int, dev, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [M, k] int32 (k distinct experts a token), weights [M, k] float32 (softmax)."""
    g = _generator(seed)
    ids = torch.rand(m, num_experts, generator=g).argsort(dim=1)[:, :top_k].int()
    return ids.to(dev), torch.softmax(torch.rand(m, top_k, generator=g), dim=1).to(dev)


def fp8_weight(e: int, rows: int, cols: int, dev, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [E, R, C] e4m3 of random finite codes, scale [E, R/128, C/128] float32 keeping outputs near unit size)."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 254, (e, rows, cols), dtype=torch.uint8, device=dev)
    codes.masked_fill_(codes == 127, 126)  # 0x7f and 0xff are e4m3fn's NaN
    scale = (torch.rand(e, -(-rows // 128), -(-cols // 128), device=dev) + 0.5) / (100 * cols**0.5)
    return codes.view(torch.float8_e4m3fn), scale


def fp8_args(m: int, dev, weights: tuple) -> tuple:
    """The fp8 op's 13 arguments at DeepSeek-V3's widths, default options, blocks of 128."""
    num_experts, hidden, _, top_k = FP8
    x = torch.randn(m, hidden, generator=_generator(m)).to(dev, torch.bfloat16)
    opts = LaunchOptions()
    return (x, *weights, *routing(m, num_experts, top_k, dev, m), None, 128, 128, opts.weight_descriptors,
            opts.dependent_launch, opts.poison_workspace)


def wo_args(m: int, dev) -> tuple:
    """The weight-only op's 16 arguments: Qwen3's widths, int4_w4a16 (groups of GROUP, zero points), bf16."""
    num_experts, hidden, inter, top_k = QWEN3
    g = _generator(5)

    def weight(rows: int, cols: int) -> tuple:
        q = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=g, dtype=torch.uint8)
        scale = (torch.rand(num_experts, rows, cols // GROUP, generator=g) + 0.5) / (4 * cols**0.5)
        zero = torch.randint(0, 16, (num_experts, rows, cols // GROUP), generator=g, dtype=torch.uint8)
        return q.to(dev), scale.to(dev), zero.to(dev), GROUP

    x = torch.randn(m, hidden, generator=g).to(dev, torch.bfloat16)
    return (x, *weight(2 * inter, hidden), *weight(hidden, inter), *routing(m, num_experts, top_k, dev, 6), None,
            "int4_w4a16", "silu", LaunchOptions().dependent_launch, "")


def route_args(m: int, dev) -> tuple:
    """The router op's 17 arguments as ``FusedRouter`` passes them for ROUTER (DeepSeek-V3's config)."""
    router, g = FusedRouter(ROUTER), _generator(7)
    logits, bias = torch.randn(m, ROUTER.num_experts, generator=g), torch.randn(ROUTER.num_experts, generator=g) * 0.1
    return (logits.to(dev), bias.to(dev), None, *router._op_args, 0, router._elements_per_program, *router._math_args)


def align_args(m: int, dev) -> tuple:
    """The alignment op's 10 arguments: Qwen3's E and k, blocks of 16, default options."""
    opts = LaunchOptions()
    return (routing(m, QWEN3[0], QWEN3[3], dev, 8)[0], QWEN3[0], 16, None, True, opts.dependent_launch,
            opts.align_small_max, opts.align_small_max_bins, opts.align_one_launch_max, opts.align_two_launch_max)


@dataclass(frozen=True)
class Case:
    """One op at one shape."""

    name: str  # the op: torch.ops.moekit.<name>, opq36_before.OPS[name]
    args: tuple  # the op's arguments, positional
    body: Callable  # the op's body, called directly
    entry: Callable  # the op's public entry (what a compiled caller traces), on ``entry_args``
    entry_args: tuple


def cases(dev) -> dict[str, Case]:
    """label -> Case: the fp8 op at DeepSeek-V3's widths (M = 1 and 64), wo at Qwen3's (M = 1), the router at
    DeepSeek-V3's config (M = 1), the alignment at Qwen3's (M = 64)."""
    num_experts, hidden, inter, _ = FP8
    w13, w2 = fp8_weight(num_experts, 2 * inter, hidden, dev, 1), fp8_weight(num_experts, hidden, inter, dev, 2)
    weights = (*w13, *w2)
    fp8_entry = lambda x, i, w: triton_fp8.fused_experts_fp8(x, *weights, i, w)  # noqa: E731
    found = {}
    for m in (1, 5 if SMOKE else 64):
        a = fp8_args(m, dev, weights)
        found[f"fp8 DeepSeek-V3 M={m}"] = Case("triton_experts_fp8", a, triton_fp8._fp8_kernel, fp8_entry,
                                              (a[0], *a[5:7]))
    a = wo_args(1, dev)
    w13_wo, w2_wo = (triton_wo.WoWeight("int4_w4a16", *a[i:i + 4]) for i in (1, 5))
    wo_entry = lambda x, i, w: triton_wo.fused_experts_wo(x, w13_wo, w2_wo, i, w)  # noqa: E731
    found["wo int4 Qwen3 M=1"] = Case("triton_experts_wo", a, triton_wo._wo_kernel, wo_entry, (a[0], a[9], a[10]))
    a, router = route_args(1, dev), FusedRouter(ROUTER)
    found["route_fused DeepSeek-V3 M=1"] = Case("route_fused", a, before.fused._route_kernel,
                                                lambda logits, bias: router(logits, bias).topk_weights, a[:2])
    a = align_args(5 if SMOKE else 64, dev)
    found[f"align Qwen3 M={5 if SMOKE else 64}"] = Case(
        "align_block_triton", a, triton_align._align_kernel,
        lambda ids: triton_align.align_block_triton(ids, QWEN3[0], 16).sorted_ids, a[:1])
    return found


def same(a, b) -> bool:
    """Bit-equal outputs (a tensor or a tuple of them)."""
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def recording(seen: list, backend=None):
    """A torch.compile backend that appends the graph's moekit ops to ``seen``, then compiles it with ``backend``
    (None: runs it as traced)."""
    def recorder(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if "moekit" in str(n.target))
        return gm.forward if backend is None else backend(gm, example_inputs)

    return recorder


def traced_ops(fn, args: tuple) -> list:
    """The moekit ops of ``fn`` compiled fullgraph (run as traced) and called on ``args``."""
    seen = []
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=recording(seen))(*args)
    return seen


def correct_phase(found: dict[str, Case]) -> None:
    res = RESULT["correct"] = {}
    with torch.no_grad():
        for label, case in found.items():
            RUN.log(f"correct: {label}")  # the first calls compile the case's kernels
            name, args = case.name, case.args
            after, main = getattr(torch.ops.moekit, name).default(*args), before.OPS[name](*args)
            res[label] = {"vs_main": same(after, main), "vs_body": same(after, case.body(*args)),
                          "traced": traced_ops(case.entry, case.entry_args)}
            RUN.check(f"{label}: the op bit-equal to main's form", res[label]["vs_main"])
            RUN.check(f"{label}: the op bit-equal to its body", res[label]["vs_body"])
            RUN.check(f"{label}: compiled no_grad holds the op only", res[label]["traced"] == [f"moekit.{name}"],
                      str(res[label]["traced"]))


def op_phase(found: dict[str, Case], dev) -> None:
    fns = {}
    for label, case in found.items():
        after, main = getattr(torch.ops.moekit, case.name).default, before.OPS[case.name]
        fns[f"{label} after"] = lambda op=after, a=case.args: op(*a)
        fns[f"{label} before"] = lambda op=main, a=case.args: op(*a)
    with torch.no_grad():
        for fn in fns.values():
            fn()
        RUN.log("op: warm")
        got = RESULT["op_us"] = host_and_wall_us(fns, dev, CALLS, ROUNDS)
    for label in found:
        summarize("op", label, got[f"{label} after"], got[f"{label} before"], "µs")


def summarize(phase: str, label: str, after: tuple, main: tuple, unit: str, scale: float = 1.0) -> None:
    """A table row: host and wall medians after / before, host after / before per round, host rounds >= 3% faster
    / slower (and wall's where ``phase`` is the stack)."""
    (host_a, wall_a), (host_b, wall_b) = ([v * scale for v in s] for s in after), ([v * scale for v in s] for s in main)
    med = statistics.median
    key = (wall_a, wall_b) if phase == "stack" else (host_a, host_b)
    RUN.summary.append(f"| {phase} | {label} | {med(host_a):.3f} / {med(host_b):.3f} {unit} | {med(wall_a):.3f} / "
                       f"{med(wall_b):.3f} {unit} | " + " ".join(f"{a / b:.3f}" for a, b in zip(*key))
                       + f" | {wins(*key)} / {wins(key[1], key[0])} |")


def stack_layers(dev) -> list:
    """ARGS.layers MoE layers at Qwen3's widths, fp8_block experts, bf16, the fused router."""
    num_experts, hidden, inter, top_k = QWEN3
    config = MoEConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts, top_k=top_k)
    torch.manual_seed(0)
    return [MoE(config, backend="triton", router="fused", dtype=torch.bfloat16, device=dev).eval()
            .quantize_("fp8_block") for _ in range(ARGS.layers)]


def stack_phase(dev) -> None:
    from torch._inductor.compile_fx import compile_fx

    layers = stack_layers(dev)

    def step_after(x):  # [1, K]: one decode step; two functions, so each compiled frame keeps its own cache entry
        for layer in layers:
            x = x + layer(x)
        return x

    def step_before(x):
        for layer in layers:
            x = x + layer(x)
        return x

    backend = None if SMOKE else compile_fx  # inductor, mode "default": no CUDA graphs; the smoke runs the graph
    x = torch.randn(1, QWEN3[1], generator=_generator(9)).to(dev, torch.bfloat16)
    compiled, seen = {}, {"after": [], "before": []}
    with torch.no_grad():
        for name, fn in (("after", step_after), ("before", step_before)):
            before.use_before(name == "before")
            compiled[name] = torch.compile(fn, fullgraph=True, backend=recording(seen[name], backend))
            compiled[name](x)
            RUN.log(f"stack: {name} compiled")
        before.use_before(False)
        RESULT["stack_ops"] = seen = {name: sorted(set(ops)) for name, ops in seen.items()}
        RUN.check("stack: after's graph holds the shipped ops",
                  seen["after"] == ["moekit.route_fused", "moekit.triton_experts_fp8"], str(seen["after"]))
        RUN.check("stack: before's graph holds main's forms",
                  seen["before"] == ["moekit_before.route_fused", "moekit_before.triton_experts_fp8"],
                  str(seen["before"]))
        outs = {}
        for name in compiled:
            before.use_before(name == "before")
            outs[name] = compiled[name](x)
        RUN.check("stack: outputs after / before bit-equal", torch.equal(outs["after"], outs["before"]))
        fns = {name: (lambda name=name: (before.use_before(name == "before"), compiled[name](x))) for name in compiled}
        got = RESULT["stack_us"] = host_and_wall_us(fns, dev, STEPS, ARGS.rounds)
        before.use_before(False)
    summarize("stack", f"{ARGS.layers} fp8 layers, decode step", got["after"], got["before"], "ms", 1e-3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=72.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="stack rounds (the op phase keeps ROUNDS)")
    p.add_argument("--layers", type=int, default=2 if SMOKE else 8)
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("correct", "op", "stack"))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "fp8": FP8, "qwen3": QWEN3, "phases": ARGS.phases,
                     "layers": ARGS.layers}
    RUN.summary.append("| phase | case | host after / before | wall after / before | after / before per round "
                       "(host; stack: wall) | rounds >= 3% faster / slower |\n|---|---|---|---|---|---|")
    raise_recompile_limit()  # two implementations (and modes): never fall back to eager
    found = cases(dev) if {"correct", "op"} & set(ARGS.phases) else {}
    RUN.log("cases built")
    phases = {"correct": lambda: correct_phase(found), "op": lambda: op_phase(found, dev),
              # DeepSeek-V3's fp8 experts (11 GB) go before the stack's layers come
              "stack": lambda: (found.clear(), stack_phase(dev))}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, NEEDS_S,
                      ARGS.out and os.path.join(ARGS.out, "opq36.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
