"""CPU, session 33: one Qwen3-30B-A3B MoE block (the bench's model, real widths) called alone, its own forward on
the "moekit" experts implementation against the same block swapped by ``moekit.hf.use_moekit_blocks`` (moekit's
router + experts; ``set_blocks_active`` switches between the two on the same module), at M = 1 (decode) and
M = 64 (the bench's CPU prefill) tokens: ms a call, interleaved rounds, the ratio each round, the outputs' rel. L2.
``--wrapper``: the same at tiny widths (``--tiny`` of the bench), µs a decode call (M = 1), with a third
contender, the ``MoE`` called directly (session 32's ``moekit_block``): swapped - direct is what the swap's
forward adds (the recording, substitution and state checks, the reshapes, the block's module call).

    flock /work/wt/cpubench.lock env PYTHONPATH=$PWD python3 benchmarks/swap33_block_cpu.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import moekit.hf as mh
from moekit.bench.hf_models import build_model, hf_config
from moekit.hf.swap import set_blocks_active


def ms_per_call(model, block, x: torch.Tensor, active: bool, calls: int) -> float:
    set_blocks_active(model, active)
    with torch.no_grad():
        block(x)  # the first call of a kind keeps its entries
        start = time.perf_counter()
        for _ in range(calls):
            block(x)
        return (time.perf_counter() - start) / calls * 1e3


def us_per_call(fn, x: torch.Tensor, calls: int) -> float:
    with torch.no_grad():
        fn(x)
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return (time.perf_counter() - start) / calls * 1e6


def wrapper(rounds: int) -> None:
    model = build_model(hf_config("qwen3", 1, tiny=True), torch.float32, torch.device("cpu"))
    model.set_experts_implementation("moekit")
    block = model.model.layers[0].mlp
    mh.use_moekit_blocks(model)
    moe = block._moekit_swap.moe
    x = torch.randn(1, 1, model.config.hidden_size)
    # name -> (whether the block runs moekit's forward, the call timed)
    runs = {"own forward": (False, block), "swapped": (True, block), "MoE direct": (True, lambda t: moe.forward(
        t.view(1, -1)))}
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (active, fn) in runs.items():
            set_blocks_active(model, active)  # outside the timed calls: it walks the model
            times[name].append(us_per_call(fn, x, 2000))
    for name, values in times.items():
        print(f"tiny, M = 1, {name}: µs a call {[f'{v:.1f}' for v in values]} (median {statistics.median(values):.1f})")
    extra = [a - b for a, b in zip(times["swapped"], times["MoE direct"])]
    print(f"swapped - direct, µs a round: {[f'{v:.1f}' for v in extra]} (median {statistics.median(extra):.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--wrapper", action="store_true", help="µs a decode call at tiny widths, the swap's own cost")
    args = p.parse_args()
    if args.wrapper:
        print(f"torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
        wrapper(args.rounds)
        print(f"load {os.getloadavg()[0]:.2f}")
        return
    dtype = getattr(torch, args.dtype)
    model = build_model(hf_config("qwen3", 1), dtype, torch.device("cpu"))
    model.set_experts_implementation("moekit")
    block = model.model.layers[0].mlp
    report = mh.use_moekit_blocks(model)
    print(f"{args.dtype}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
          f"swapped {len(report.swapped)}, left {len(report.left)}")
    g = torch.Generator().manual_seed(0)
    for m, calls in ((1, 40), (64, 4)):
        x = torch.randn(1, m, 2048, generator=g).to(dtype)
        own, swapped = [], []
        for _ in range(args.rounds):
            own.append(ms_per_call(model, block, x, False, calls))
            swapped.append(ms_per_call(model, block, x, True, calls))
        ratios = [a / b for a, b in zip(own, swapped)]
        print(f"M = {m:3d}: own forward ms {[f'{v:.3f}' for v in own]} | swapped {[f'{v:.3f}' for v in swapped]} | "
              f"own / swapped {[f'{r:.3f}' for r in ratios]} (median {statistics.median(ratios):.3f})")
        with torch.no_grad():
            set_blocks_active(model, False)
            want = block(x).double()
            set_blocks_active(model, True)
            got = block(x).double()
        print(f"         rel. L2 swapped vs own {float((got - want).norm() / want.norm()):.2e}")
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
