"""Where ``moekit::triton_experts``' host time goes beyond its body, on the CPU (session 35; the lead's question after
op34 on an H100: the op 141.9 µs a call, its body called directly 79.5). The Triton path runs under the interpreter
with every kernel launch stubbed (``BoundLaunch.__call__`` does nothing after the first, real, call), so what is
timed is the Python of a Qwen3-like M = 1 call (tiny widths: the Python does not depend on them): the op's body as
main had it (``body_before``: ``LaunchOptions`` built and validated on every call), the body now
(``triton_op._experts_kernel``: the options cached per set of values), the custom op (``moekit::triton_experts``)
and its inference twin (``moekit::triton_experts_infer``) around the body. Under ``no_grad``; interleaved rounds,
the order reversed every other round; µs a call (medians, each round), ratios per round, the load average;
``--profile``: cProfile of the body and the custom op (own time per function).

    flock /work/wt/cpubench.lock env PYTHONPATH=$PWD python3 benchmarks/opg35_body_cpu.py --rounds 7 --calls 2000
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import time
from typing import Callable

import torch


def body_before(*args):
    """The op's body as main has it: ``LaunchOptions`` built (and validated) on every call, then ``fused_experts``."""
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_op import _spec_of

    names = [f.name for f in dataclasses.fields(LaunchOptions)]
    options = LaunchOptions(**{**dict(zip(names, args[14:])), "reuse_workspace": False})
    return fused_experts(*args[:6], _spec_of(*args[8:14]), options=options, b13=args[6], b2=args[7])


def op_args() -> tuple:
    """The op's 33 arguments: x [1, 64] bf16, E = 8 experts of [64, 32], k = 2, silu, the default options."""
    from moekit.activations import ActivationSpec, spec_fields
    from moekit.experts.triton_op import _DEFAULT_OP_ARGS

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g).bfloat16()  # [M, K]
    w13 = (torch.randn(8, 64, 64, generator=g) / 8).bfloat16()  # [E, 2N, K]
    w2 = (torch.randn(8, 64, 32, generator=g) / 6).bfloat16()  # [E, K, N]
    ids, weights = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]])  # [M, k]
    return (x, w13, w2, ids, weights, None, None, None, *spec_fields(ActivationSpec()), *_DEFAULT_OP_ARGS)


def variants(args: tuple) -> dict[str, Callable]:
    from moekit.experts.triton_op import _experts_kernel

    custom, twin = torch.ops.moekit.triton_experts.default, torch.ops.moekit.triton_experts_infer.default
    return {"body before": lambda: body_before(*args), "body": lambda: _experts_kernel(*args),
            "custom_op": lambda: custom(*args), "twin": lambda: twin(*args)}


def per_call_us(fn: Callable, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def profile(fn: Callable, calls: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, on the first call
    from moekit.triton_bind import BoundLaunch

    torch.set_num_threads(2)
    args = op_args()
    found = variants(args)
    with torch.no_grad():
        want = found["body"]()  # the plan and its bound launches built, the kernels run once (interpreted)
        same = {name: torch.equal(fn(), want) for name, fn in found.items()}
        BoundLaunch.__call__ = lambda self, *pointers: None  # from here on nothing launches
        us = {name: [] for name in found}
        for r in range(a.rounds):
            for name in (list(found) if r % 2 == 0 else list(found)[::-1]):
                per_call_us(found[name], 200)
                us[name].append(per_call_us(found[name], a.calls))
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, {a.rounds} rounds x {a.calls} calls, no_grad, "
          f"launches stubbed; same bits as the body (before stubbing): {same}")
    print("| variant | µs a call (median) | rounds |\n|---|---|---|")
    for name, values in us.items():
        print(f"| {name} | {statistics.median(values):.2f} | {' '.join(f'{v:.1f}' for v in values)} |")
    for new, old in (("body", "body before"), ("twin", "custom_op"), ("body", "twin"), ("body", "custom_op")):
        print(f"{new} / {old} per round:", " ".join(f"{n / o:.2f}" for n, o in zip(us[new], us[old])))
    if a.profile:
        with torch.no_grad():
            for name in ("body", "custom_op"):
                print(f"===== {name}")
                profile(found[name], a.calls)


if __name__ == "__main__":
    main()
