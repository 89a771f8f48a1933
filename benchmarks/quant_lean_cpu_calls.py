"""Where the host time of a quantized eager experts call goes, counted on the CPU (no GPU needed): per call
of ``experts_triton`` on fp8_block / int4_w4a16 / int8_w8a16 / mxfp4 weights, plain
(``LaunchOptions(lean_launch=False)``) against lean (the defaults: ``triton_quant_fast``), the Python
function calls, C calls, kernel launches and tensor allocations made by moekit and torch (what runs inside
Triton's launch is left out: it is the same in both), and the host µs per call with the kernels stubbed.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/quant_lean_cpu_calls.py

Under the interpreter a "launch" is an entry into Triton's code from moekit's; for the timing the
interpreter's ``InterpretedFunction.run`` is a no-op (so the µs are moekit's and torch's host work, on this CPU, not the
H200's).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.quant import quantize  # noqa: E402

E, K, N, TOP_K = 8, 256, 128, 2
SCHEMES = {"fp8_block": dict(block_shape=(128, 128)), "int4_w4a16": dict(group_size=128), "int8_w8a16": {},
           "mxfp4": {}}
VARIANTS = {"plain": LaunchOptions(lean_launch=False), "lean": LaunchOptions()}
ALLOCATIONS = {"empty", "empty_like", "zeros", "new_empty", "new_zeros", "zeros_like", "full"}


def counted(fn) -> dict:
    """Events of one call of ``fn``, outside Triton's own frames."""
    seen = {"py_calls": 0, "c_calls": 0, "launches": 0, "allocations": 0}
    inside = [0]  # depth inside triton frames

    def profile(frame, event, arg):
        in_triton = "/triton/" in frame.f_code.co_filename
        if event == "call":
            if in_triton:
                seen["launches"] += inside[0] == 0  # an entry into Triton from moekit: one kernel launch
                inside[0] += 1
            elif inside[0] == 0:
                seen["py_calls"] += 1
        elif event == "return" and in_triton:
            inside[0] -= 1
        elif event == "c_call" and inside[0] == 0:
            seen["c_calls"] += 1
            seen["allocations"] += getattr(arg, "__name__", "") in ALLOCATIONS

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def host_us(fn, calls: int = 40, samples: int = 7) -> float:
    """µs per call with every kernel launch a no-op: the fastest of ``samples`` runs of ``calls`` calls (this
    CPU is shared; the minimum is the least disturbed)."""
    real = interp.InterpretedFunction.run
    interp.InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        fn()
        best = float("inf")
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        return best
    finally:
        interp.InterpretedFunction.run = real


def main() -> None:
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * N, K) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N) * N**-0.5).bfloat16()
    print(f"{'scheme':12}{'M':>5}{'variant':>8}{'py calls':>10}{'C calls':>9}{'launches':>9}{'allocs':>7}"
          f"{'host µs':>9}")
    with torch.no_grad():
        for scheme, options in SCHEMES.items():
            q13, q2 = quantize(w13, scheme, **options), quantize(w2, scheme, **options)
            for m in (1, 64):
                x = torch.randn(m, K).bfloat16()
                ids = torch.rand(m, E).argsort(dim=1)[:, :TOP_K].int()
                weights = torch.softmax(torch.rand(m, TOP_K), dim=1)
                for name, launch_options in VARIANTS.items():
                    def call(o=launch_options):
                        return experts_triton(x, q13, q2, ids, weights, options=o)
                    for _ in range(3):  # compiled, recorded, kept
                        call()
                    c = counted(call)
                    print(f"{scheme:12}{m:>5}{name:>8}{c['py_calls']:>10}{c['c_calls']:>9}{c['launches']:>9}"
                          f"{c['allocations']:>7}{host_us(call):>9.1f}", flush=True)


if __name__ == "__main__":
    main()
