"""CPU, session 33: one Qwen3-30B-A3B MoE block (the bench's model, real widths) called alone, its own forward on
the "moekit" experts implementation against the same block swapped by ``moekit.hf.use_moekit_blocks`` (moekit's
router + experts; ``set_blocks_active`` switches between the two on the same module), at M = 1 (decode) and
M = 64 (the bench's CPU prefill) tokens: ms a call, interleaved rounds, the ratio each round, the outputs' rel. L2.

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
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
