"""The gate above 8 rows on tensor cores (``moekit.routing.gate_mma``) against cuBLAS, and where the eager layer's host
time goes at B = 1..256 (issue 13 item 4: the whole layer <= 60 µs of host time for B <= 256).

    PYTHONPATH=$PWD python benchmarks/layer3_device_check.py --out /tmp/l3 [--budget-s 120]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/layer3_device_check.py --smoke   (CPU: checks the script)

Cells by priority until --budget-s (then the hard limit stops measuring):
1. ``gate P M=m`` (the preset's gate: Qwen3-30B-A3B E 128 x K 2048, DeepSeek-V3 256 x 7168, Mixtral-8x7B 8 x 4096;
   bf16; M in GATE_ROWS): correctness first, every variant's logits against an fp64 ``x @ W^T`` (max |err| beside
   cuBLAS's own, PASS within 2x of it plus one bf16 ulp of the largest logit), and the one launch's ids / weights
   against ``moekit.route`` on its own logits (PASS: ids equal, weights within 1e-6); then GPU µs per call in a
   CUDA graph (REPEATS calls a graph, rounds interleaved over the variants, median): ``cublas`` (``torch.mm`` into
   the logits), ``cublas+route`` (and the router's bound launch: what the layer runs today above 8 rows), ``mma``
   tiles (gate only, the default ``mma_tiles`` and the SWEEP), ``mma+route`` (the one launch, default tiles).
2. ``parts P M=m`` and ``layer P M=m`` (``layer_host2_device_check``'s cells): the eager layer's host µs split into
   its stages on the decode fast path, and the layer's host / graph / floor, at B = 1, 8, 16, 64, 256.
Look for: mma+route GPU µs <= cublas+route at every M (the graph must not regress) and which tiles win; where the
host µs of the layer go at 16-256 (route = gate + router, experts). JSON to $OUT/layer3.json; a table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import host_align_device_check as ha
import host_mid_device_check as hm
import layer_host2_device_check as lh
from moekit import MoEConfig, route
from moekit.routing import fused
from moekit.routing import gate_mma as gm

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
GATE_ROWS = (64, 256, 16)
LAYER_ROWS = (16, 64, 256, 1, 8)
REPEATS = 20  # calls per graph
ROUNDS = 7


def sweep(e: int, k: int) -> dict:
    """Tile candidates besides the default: (block_m, block_e, block_k, split_k)."""
    be = max(16, min(128, 1 << (e - 1).bit_length()))
    cands = [(16, be, 128, 1), (16, be, 128, 4), (16, be, 128, 8), (16, be, 256, 4), (32, be, 128, 4),
             (64, be, 128, 2), (16, max(16, be // 2), 128, 4)]
    return {f"mma{bm}x{bee}x{bk}s{s}": gm.MmaTiles(bm, bee, bk, s) for bm, bee, bk, s in cands if k // (bk * s) >= 1}


class Gate:
    """One gate shape's tensors and launches."""

    def __init__(self, config: MoEConfig, m: int, device):
        self.config, self.m = config, m
        e, k = config.num_experts, config.hidden_size
        self.x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        self.w = (torch.randn(e, k, device=device) * k ** -0.5).to(torch.bfloat16)
        self.bias = torch.rand(e, device=device) * 0.1 if config.use_correction_bias else None
        self.logits = torch.empty(m, e, device=device, dtype=torch.bfloat16)
        slots = config.top_k
        self.ids = torch.empty(m, slots, device=device, dtype=torch.int32)
        self.weights = torch.empty(m, slots, device=device, dtype=torch.float32)
        self.router = fused.FusedRouter(config)
        self.plan = self.router._plans[0]
        self.route = fused.bound_route(self.plan, self.logits, self.bias, None, False)
        self.ref = self.x.double() @ self.w.double().t()  # [M, E]
        self.precise = device.type == "cuda"

    def scratch(self, bound):
        nc, npart = bound.scratch
        count = torch.zeros(max(nc, 1), dtype=torch.int32, device=self.x.device)
        part = torch.empty(max(npart, 1), dtype=torch.float32, device=self.x.device)
        return count, part

    def mma(self, tiles, with_route: bool):
        bound = gm.BoundGateMma(self.plan if with_route else None, self.x, self.w, None, self.bias, None, False,
                                tiles, precise=self.precise)
        count, part = self.scratch(bound)
        ids, weights = (self.ids, self.weights) if with_route else (None, None)
        return lambda: bound(self.x, self.w, None, self.bias, None, self.logits, ids, weights, count, part)

    def cublas(self, with_route: bool):
        def call():
            torch.mm(self.x, self.w.t(), out=self.logits)
            if with_route:
                self.route(self.logits, self.bias, None, (self.ids, self.weights))
        return call


def graph_us(fns: dict) -> dict:
    """GPU µs per call of each fn: REPEATS calls captured in one graph, rounds interleaved, median."""
    if hm.Run.device.type != "cuda":
        return {name: float("nan") for name in fns}
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(REPEATS):
                fn()
        g.replay()
        graphs[name] = g
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / REPEATS)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def gate_cell(config: MoEConfig, m: int) -> dict:
    g = Gate(config, m, hm.Run.device)
    e, k = config.num_experts, config.hidden_size
    default = gm.mma_tiles(m, e, k, torch.bfloat16)
    variants = {"cublas": g.cublas(False), "cublas+route": g.cublas(True), "mma": g.mma(default, False),
                "mma+route": g.mma(default, True)}
    if hm.Run.device.type == "cuda":
        variants.update({n: g.mma(t, False) for n, t in sweep(e, k).items() if t != default})
    row = {"default": f"{default.block_m}x{default.block_e}x{default.block_k}s{default.split_k}"}
    tol = None
    for name, fn in variants.items():
        fn()
        fn()  # twice: the counters must be back at 0
        err = float((g.logits.double() - g.ref).abs().max())
        if name == "cublas":
            tol = 2 * err + float(g.ref.abs().max()) * 2 ** -8
        ok = err <= tol
        if name == "mma+route":
            r = route(g.logits, config, g.bias)
            ok = ok and torch.equal(r.topk_ids, g.ids) and float((r.topk_weights - g.weights).abs().max()) <= 1e-6
        row[f"{name}_check"] = ("PASS" if ok else "FAIL") + f" err {err:.2e}"
    torch.cuda.synchronize() if hm.Run.device.type == "cuda" else None
    row.update({f"{n}_us": v for n, v in graph_us(variants).items()})
    return row


def measure(a, start: float, results: dict) -> None:
    lh.Run.ceilings = lh._ceilings(hm.Run.device)
    with torch.no_grad():
        cells = [(f"gate {p} M={m}", lambda p=p, m=m: gate_cell(hm.layer_config(p), m))
                 for m in a.gate_rows for p in a.presets]
        for key, cell in cells:
            ha.budgeted_cell(results, key, start, a.budget_s, cell)
        if a.smoke:  # the interpreter: the layer cells of the smallest router only
            a.presets = ["mixtral-8x7b"]
        layers = {p: lh.MoE(hm.layer_config(p), backend="triton", router=lh.Run.router, dtype=torch.bfloat16,
                            device=hm.Run.device).eval() for p in a.presets}
        cells = []
        for m in a.layer_rows:
            for p, layer in layers.items():
                cells.append((f"parts {p} M={m}", lambda m=m, layer=layer: lh.parts_cell(layer, m)))
        for m in a.layer_rows:
            for p, layer in layers.items():
                cells.append((f"layer {p} M={m}", lambda m=m, layer=layer: lh.layer_cell(layer, m)))
        for key, cell in cells:
            ha.budgeted_cell(results, key, start, a.budget_s, cell)


def table(results: dict) -> str:
    lines = ["gate: GPU µs per call in a graph; checks: logits vs fp64 (and the one launch's routing vs moekit.route)"]
    for key, r in results.items():
        if not isinstance(r, dict) or "skipped" in r or "error" in r:
            lines.append(f"{key:30} {r}")
        elif key.startswith("gate"):
            checks = " ".join(f"{k[:-6]}={v.split()[0]}" for k, v in r.items() if k.endswith("_check"))
            times = " ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us"))
            lines.append(f"{key:30} default {r['default']} | {times} | {checks}")
    lines.append(lh.table({k: v for k, v in results.items() if not k.startswith("gate")}))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=145, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--gate-rows", nargs="*", type=int, default=list(GATE_ROWS))
    p.add_argument("--layer-rows", nargs="*", type=int, default=list(LAYER_ROWS))
    p.add_argument("--out", default=os.environ.get("OUT", "layer3_out"), help="folder for layer3.json")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        hm.Run.device, hm.Run.scale, hm.Run.samples, hm.Run.loop_calls, hm.Run.warm = (
            torch.device("cpu"), ha.SMOKE_SCALE, 1, 2, 2)
        lh.Run.router = "fused"
        a.budget_s = 1e9
        a.presets, a.gate_rows, a.layer_rows = ["deepseek-v3", "mixtral-8x7b"], [16], [16]
    else:
        hm.Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = hm.Run.device
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "layer3.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
