"""Per-call host cost of moekit's other GPU ops, main's registration against session 36's, on the CPU: for each of
``moekit::triton_experts_fp8``, ``triton_experts_wo``, ``route_fused`` and ``align_block_triton``, the op's schema
(its body's signature) with a body that only allocates the outputs (the op's fake), registered as main had it
(``torch.library.custom_op`` with a fake and no backward: custom_op's Autograd kernel and backend wrapper on every
call) and as shipped now (``op_library.define_inference_op``); plus each body's per-call host rebuild as main had it
(``LaunchOptions`` built per call; the alignment's options resolved and its plan built, the router's ``RouterMath``
built and hashed, per call) against the caches now. Under ``no_grad``; tiny CPU tensors at the device check's
shapes' ranks; per round each variant runs ``--calls`` calls after 200 warm-up calls, the order reversed every other
round; prints µs a call (medians, each round), now / before per round, and the load average.

    flock /work/wt/cpubench.lock env PYTHONPATH=$PWD python3 benchmarks/opq36_dispatch_cpu.py --rounds 7 --calls 2000
"""

from __future__ import annotations

import functools
import inspect
import os
import statistics
from typing import Callable, Optional  # noqa: F401  (the bodies' string annotations are evaluated here)

import torch

from moekit.experts import triton_align, triton_fp8, triton_wo
from moekit.experts.op_library import define_inference_op
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.layouts.grouping import max_padded_rows
from moekit.routing import fused
from moekit.routing.router_math import RouterMath
from op_dispatch import per_call_us, timing_args

# op name -> (its body, its fake)
OPS = {"fp8": (triton_fp8._fp8_kernel, triton_fp8._fp8_fake), "wo": (triton_wo._wo_kernel, triton_wo._wo_fake),
       "route_fused": (fused._route_kernel, fused._route_fake),
       "align": (triton_align._align_kernel, triton_align._align_fake)}


def empty_body(body: Callable, fake: Callable) -> Callable:
    """A function with ``body``'s signature (so its inferred schema) that only allocates the outputs."""
    def empty(*args):
        return fake(*args)

    empty.__signature__ = inspect.signature(body)
    empty.__name__ = body.__name__
    return empty


def registrations(name: str) -> dict[str, Callable]:
    """The empty body as main registered the op (custom_op + fake) and as now (define_inference_op)."""
    body, fake = OPS[name]
    empty = empty_body(body, fake)
    before = torch.library.custom_op(f"opq36_bench::{name}", empty, mutates_args=())
    before.register_fake(fake)
    return {"before": getattr(torch.ops.opq36_bench, name).default,
            "now": define_inference_op(f"opq36_bench_{name}", empty, fake)}


def op_args() -> dict[str, tuple]:
    """Each op's arguments: M = 1, k = 2, E = 8 experts of K = 64, N = 32 (fp8 blocks 32 x 32, int4 groups 32)."""
    x, ids, weights = torch.randn(1, 64).bfloat16(), torch.tensor([[1, 5]], dtype=torch.int32), torch.rand(1, 2)
    q13, q2 = torch.zeros(8, 64, 64, dtype=torch.float8_e4m3fn), torch.zeros(8, 64, 32, dtype=torch.float8_e4m3fn)
    s13, s2 = torch.ones(8, 2, 2), torch.ones(8, 2, 1)
    p13, p2 = torch.zeros(8, 64, 32, dtype=torch.uint8), torch.zeros(8, 64, 16, dtype=torch.uint8)
    g13, g2 = torch.ones(8, 64, 2), torch.ones(8, 64, 1)
    z13, z2 = torch.full((8, 64, 2), 8, dtype=torch.uint8), torch.full((8, 64, 1), 8, dtype=torch.uint8)
    logits, bias = torch.randn(1, 256), torch.zeros(256)
    return {"fp8": (x, q13, s13, q2, s2, ids, weights, None, 32, 32, True, True, False),
            "wo": (x, p13, g13, z13, 32, p2, g2, z2, 32, ids, weights, None, "int4_w4a16", "silu", True, ""),
            "route_fused": (logits, bias, None, 8, 8, 4, True, True, 2.5, True, 0, 128, 0.0, False, "auto", False,
                            1.0),
            "align": (ids, 8, 16, None, True, True, 128, 64, 2048, 4096)}


def rebuilds() -> dict[str, tuple[Callable, Callable]]:
    """Each body's per-call host rebuild as main had it (before) and its cache now (now), same arguments (the
    alignment: 16 assignments, aligned, not the shortcut)."""
    device = torch.device("cpu")

    def align_before():
        options = resolve_launch_options(LaunchOptions(dependent_launch=True, align_small_max=128,
                                                       align_small_max_bins=64, cached_launcher=False), device)
        return triton_align.plan_align(16, 8, 16, None, max_padded_rows(16, 8, 16), options, False)

    return {
        "fp8": (lambda: LaunchOptions(weight_descriptors=True, dependent_launch=True, poison_workspace=False),
                functools.partial(triton_fp8._fp8_options, True, True, False)),
        "wo": (lambda: LaunchOptions(dependent_launch=True, reuse_workspace=False),
               functools.partial(triton_wo._wo_options, True)),
        "route_fused": (lambda: fused._plan(256, 8, 8, 4, True, True, 2.5, True, 0, 128, RouterMath(0.0, False, "auto",
                                                                                                     False, 1.0)),
                        functools.partial(fused._op_plan, 256, 8, 8, 4, True, True, 2.5, True, 0, 128, 0.0, False,
                                          "auto", False, 1.0)),
        "align": (align_before, functools.partial(triton_align._op_plan, 16, 8, 16, None, False, True, 128, 64, 2048,
                                                  4096, device)),
    }


def timed(variants: dict[str, tuple[Callable, tuple]], rounds: int, calls: int) -> dict[str, list[float]]:
    us = {name: [] for name in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            fn, args = variants[name]
            us[name].append(per_call_us(fn, args, calls))
    return us


def report(title: str, us: dict[str, list[float]]) -> None:
    print(f"\n{title}\n| op | before µs (median) | now µs (median) | now / before per round |\n|---|---|---|---|")
    for name in OPS:
        before, now = us[f"{name} before"], us[f"{name} now"]
        ratios = " ".join(f"{n / b:.2f}" for n, b in zip(now, before))
        print(f"| {name} | {statistics.median(before):.2f} | {statistics.median(now):.2f} | {ratios} |")


def main() -> None:
    a = timing_args(__doc__)
    args = op_args()
    dispatch, host = {}, {}
    for name in OPS:
        for form, op in registrations(name).items():
            dispatch[f"{name} {form}"] = (op, args[name])
        before, now = rebuilds()[name]
        host[f"{name} before"], host[f"{name} now"] = (before, ()), (now, ())
    with torch.no_grad():
        dispatch_us, host_us = timed(dispatch, a.rounds, a.calls), timed(host, a.rounds, a.calls)
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, {a.rounds} rounds x {a.calls} calls, no_grad")
    report("empty body, main's registration (custom_op) / now (define_inference_op), µs a call:", dispatch_us)
    report("the body's host rebuild, main's (per call) / now (cached), µs a call:", host_us)


if __name__ == "__main__":
    main()
