"""Per-call host cost of moekit's inference-only CPU op ``moekit::cpu_experts`` by registration (session 34).

The same kernel (``cpu_op._cpu_experts``, moekit's implementation) reached four ways: called directly ("kernel"),
as the op registered by ``op_library.define_inference_op`` ("library", shipped), as the same kernel registered by
``torch.library.custom_op`` in a scratch namespace with the same fake ("custom_op", what moekit shipped before),
and each op from a ``torch.compile``d (inductor) function, inductor's generated call in front ("compiled ...").
``--empty`` adds the same two registrations of a kernel that only allocates the output (the dispatch alone).
Tiny experts (E = 8, K = 64, N = 32, k = 2, M = 1, bf16) so the kernel is mostly moekit's Python entry; under
``no_grad`` (as ``generate`` runs). Per round each variant runs ``--calls`` calls after 200 warm-up calls, the
order reversed every other round; prints µs a call (medians), library / custom_op per round, the load average,
and whether every variant gave the kernel's bits.

    flock /work/wt/cpubench.lock python3 benchmarks/op_dispatch.py --rounds 7 --calls 2000 --empty
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from moekit.activations import ActivationSpec, spec_fields
from moekit.experts import cpu_op
from moekit.experts.op_library import define_inference_op

E, N, K, TOP_K = 8, 32, 64, 2


def empty_kernel(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None, b13: torch.Tensor | None, b2: torch.Tensor | None,
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: float | None, up_shift: float,
    memory_budget_bytes: int | None, layout: str, cpu_gemm: str, w13_transposed: bool, w2_transposed: bool,
) -> torch.Tensor:
    """cpu_experts' schema, no work: x [M, K] -> a fresh [M, K]."""
    return x.new_empty(x.shape)


def as_custom_op(name: str, kernel: Callable) -> torch._ops.OpOverload:
    """``kernel`` registered the way moekit's CPU ops were before: ``torch.library.custom_op`` with a fake."""
    op = torch.library.custom_op(f"moekit_bench::{name}", kernel, mutates_args=())
    op.register_fake(cpu_op._cpu_experts_fake)
    return getattr(torch.ops.moekit_bench, name).default


def variants(with_empty: bool) -> dict[str, Callable]:
    library, before = torch.ops.moekit.cpu_experts.default, as_custom_op("cpu_experts", cpu_op._cpu_experts)
    found = {"kernel": cpu_op._cpu_experts, "library": library, "custom_op": before,
             "compiled library": torch.compile(lambda *a: library(*a), fullgraph=True),
             "compiled custom_op": torch.compile(lambda *a: before(*a), fullgraph=True)}
    if with_empty:
        found["empty library"] = define_inference_op("bench_empty", empty_kernel, cpu_op._cpu_experts_fake)
        found["empty custom_op"] = as_custom_op("empty", empty_kernel)
    return found


def op_args() -> tuple:
    """cpu_experts' 19 arguments at the tiny shape, bf16, default options."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=g).bfloat16()  # [M, K]
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()  # [E, K, N]
    ids = torch.randperm(E, generator=g)[:TOP_K].view(1, TOP_K)  # [M, k]
    weights = torch.softmax(torch.randn(1, TOP_K, generator=g), dim=1)  # [M, k]
    return (x, w13, w2, ids, weights, None, None, None, *spec_fields(ActivationSpec()), None, "auto", "auto",
            False, False)


def per_call_us(fn: Callable, args: tuple, calls: int) -> float:
    for _ in range(200):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def timing_args(doc: str) -> argparse.Namespace:
    """``--rounds`` and ``--calls`` of the CPU dispatch scripts (``doc``'s first line describes them); torch on two
    threads."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    torch.set_num_threads(2)
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--empty", action="store_true", help="also the empty kernel's two registrations")
    a = p.parse_args()
    torch.set_num_threads(2)
    args = op_args()
    with torch.no_grad():
        found = variants(a.empty)
        want = cpu_op._cpu_experts(*args)
        same = {name: torch.equal(fn(*args), want) for name, fn in found.items() if "empty" not in name}
        us = {name: [] for name in found}
        for r in range(a.rounds):
            for name in (list(found) if r % 2 == 0 else list(found)[::-1]):
                us[name].append(per_call_us(found[name], args, a.calls))
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, {a.rounds} rounds x {a.calls} calls")
    print("| variant | us a call (median) | rounds |\n|---|---|---|")
    for name, values in us.items():
        print(f"| {name} | {statistics.median(values):.2f} | {' '.join(f'{v:.1f}' for v in values)} |")
    for new, old in (("library", "custom_op"), ("compiled library", "compiled custom_op"),
                     ("empty library", "empty custom_op")):
        if new in us:
            print(f"{new} / {old} per round:", " ".join(f"{n / o:.2f}" for n, o in zip(us[new], us[old])))
    print("same bits as the kernel:", same)


if __name__ == "__main__":
    main()
