"""Host time of a swapped Qwen3-MoE block's eager forward at M = 1 on the CPU, two trees of moekit against each other
(session 54's review: what the merged branches added per call).

    python benchmarks/rev54_block_host_cpu.py --base /tmp/rev54/base --new . [--rounds 7] [--calls 4000]

Each round starts one process per tree, in turn (base, new, base, new, ...: interleaved, so a neighbour's load on the
shared cores falls on both), with ``PYTHONPATH`` naming the tree. A process builds a 1-layer Qwen3-MoE offline
(hidden 64, 8 experts of 32, top-2, seed 0), swaps it (``use_moekit_blocks``, backend "grouped_mm"), checks the block's
output at x [1, 1, 64] against the eager block's (the same weights, ``experts_implementation="eager"``), and times
``calls`` back-to-back ``block(x)`` under ``torch.no_grad()`` after 200 calls of warm-up. Printed: the median over
rounds of each process's µs per call, per tree, and new - base; then the same for the block's own checks alone
(``checks``: 20 x ``calls`` calls of what the forward asks before it runs the MoE), where the merged additions show
above the layer's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = "--worker"


def _worker(calls: int) -> dict:
    import torch
    import transformers

    import moekit
    from moekit.hf import use_moekit_blocks

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    block = model.model.layers[0].mlp
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))  # [B=1, S=1, K]: a decode step
    with torch.no_grad():
        want = block(x)
    use_moekit_blocks(model, backend="grouped_mm")
    out = {"moekit": os.path.dirname(moekit.__file__)}
    with torch.no_grad():
        got = block(x)
    out["rel_err"] = float((got - want).norm() / want.norm())
    with torch.no_grad():
        for _ in range(200):
            block(x)
        start = time.perf_counter()
        for _ in range(calls):
            block(x)
        out["no_grad"] = (time.perf_counter() - start) / calls * 1e6
    out["checks"] = _checks_us(block, calls * 20)
    return out


def _checks_us(block, calls: int) -> float:
    """µs a call of the block's own checks (what its forward asks before it runs the MoE: router recording, then
    ``own_forward_needed``; session 54 added ``recording_router`` around transformers' ``router_recorded``)."""
    from moekit.hf import swap_state

    swap = block.__dict__[swap_state.SWAP_ATTR] if hasattr(swap_state, "SWAP_ATTR") else block._moekit_swap
    if hasattr(swap, "recording_router"):
        def checks():
            return swap.recording_router(block) or swap.own_forward_needed(block)
    else:
        def checks():
            return swap_state.router_recorded(block) or swap.own_forward_needed(block)
    start = time.perf_counter()
    for _ in range(calls):
        checks()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the tree before (holds moekit/)")
    parser.add_argument("--new", required=True, help="the tree after")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        for name in ("base", "new"):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(getattr(args, name))}
            done = subprocess.run([sys.executable, __file__, WORKER, str(args.calls)], env=env, check=True,
                                  capture_output=True, text=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for name, results in runs.items():
        errs = max(r["rel_err"] for r in results)
        print(f"{name}: {results[0]['moekit']}  rel_err vs eager block <= {errs:.1e}  "
              f"{'PASS' if errs < 1e-5 else 'FAIL'}")
    print(f"{'mode':8} {'base us':>9} {'new us':>9} {'new-base':>9}   (median of {args.rounds} interleaved rounds, "
          f"{args.calls} calls each, M = 1)")
    for mode in ("no_grad", "checks"):
        base, new = (statistics.median(r[mode] for r in runs[name]) for name in ("base", "new"))
        print(f"{mode:8} {base:9.3f} {new:9.3f} {new - base:+9.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER:
        print(json.dumps(_worker(int(sys.argv[2]))))
    else:
        main()
