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
2. ``ab P M=m`` (M > 8; with ``--second`` all M after): the layer with the one launch up to 256 rows joined to the
   experts' one C call (``new``, the default), that launch on its own (``step``, ``layer_fast.JOINED = False``) and
   main's ``torch.mm`` + the router's launch above 8 (``main``, ``gate_route.ROWS = 8``): host µs per forward (calls
   after a loop's first, rounds interleaved), graph µs, eager == graph, eager twice equal, new vs main's output.
3. ``parts P M=m`` / ``parts-main`` and ``layer P M=m`` (``layer_host2_device_check``'s cells): the eager layer's
   host µs split into its stages on the decode fast path, and the layer's host / graph / floor, at B = 1..256.
4. ``measure P`` (``--second``, after the A/B): ``moekit analyze --preset P --measure`` over B = 1..256 in this
   process (``moekit.bench.layer_measure.measure``, its table printed): host rest, graph, floor, ``host ok`` /
   ``graph ok``.
5. ``stages qwen3-30b-a3b M=m`` (``--second``, M = 1, 2, 4): graph µs of the layer and of its stages alone (the one
   gate + router launch, the gate kernel + the router's launch, the experts) beside the floor.
Look for: mma+route GPU µs <= cublas+route at every M (the graph must not regress) and which tiles win; ab: new
rest < main rest, graph new <= main, graph_eq yes; where the host µs of the layer go at 16-256 (route, experts). JSON to
$OUT/layer3.json; a table last.
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
from moekit import MoEConfig, layer_fast, route
from moekit.routing import fused
from moekit.routing import gate_mma as gm
from moekit.routing import gate_route
from moekit.routing.workspace import RouteBuffers

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
GATE_ROWS = (64, 256, 16)  # the first two measured before the layers
LAYER_ROWS = (16, 64, 256, 1, 8)
REPEATS = 20  # calls per graph
ROUNDS = 7


def sweep(e: int, k: int) -> dict:
    """Tile candidates besides the default: (block_m, block_e, block_k, split_k)."""
    be = max(16, min(128, 1 << (e - 1).bit_length()))
    cands = [(16, be, 128, 1), (16, be, 128, 4), (16, be, 256, 4), (32, be, 128, 4), (64, be, 128, 2),
             (16, max(16, be // 2), 128, 4)]
    return {f"mma{bm}x{bee}x{bk}s{s}": gm.MmaTiles(bm, bee, bk, s) for bm, bee, bk, s in cands if k // (bk * s) >= 1}


def buffers_for(bound, m: int, e: int, slots: int, device) -> RouteBuffers:
    count, part = bound.scratch
    return RouteBuffers(logits=torch.empty(m, e, device=device, dtype=torch.bfloat16),
                        ids=torch.empty(m, slots, device=device, dtype=torch.int32),
                        weights=torch.empty(m, slots, device=device, dtype=torch.float32),
                        count=torch.zeros(max(count, 1), dtype=torch.int32, device=device),
                        part=torch.empty(max(part, 1), dtype=torch.float32, device=device))


class Gate:
    """One gate shape's tensors and launches; every variant writes its own buffers."""

    def __init__(self, config: MoEConfig, m: int, device):
        self.config, self.m, self.device = config, m, device
        e, k = config.num_experts, config.hidden_size
        self.x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        self.w = (torch.randn(e, k, device=device) * k ** -0.5).to(torch.bfloat16)
        self.bias = torch.rand(e, device=device) * 0.1 if config.use_correction_bias else None
        self.router = fused.FusedRouter(config)
        self.plan = self.router._plans[0]
        self.ref = self.x.double() @ self.w.double().t()  # [M, E]
        self.out = {}  # variant -> its buffers

    def mma(self, name: str, tiles, with_route: bool):
        bound = gm.BoundGateMma(self.plan if with_route else None, self.x, self.w, None, self.bias, None, False, tiles)
        b = self.out[name] = buffers_for(bound, self.m, self.config.num_experts, self.config.top_k, self.device)
        return lambda: bound(self.x, self.w, None, self.bias, None, b)

    def cublas(self, name: str, with_route: bool):
        b = self.out[name] = buffers_for(gm.BoundGateMma(None, self.x, self.w, None, tiles=gm.MmaTiles(16, 16, 64, 1)),
                                         self.m, self.config.num_experts, self.config.top_k, self.device)
        route_launch = fused.bound_route(self.plan, b.logits, self.bias, None, False)

        def call():
            torch.mm(self.x, self.w.t(), out=b.logits)
            if with_route:
                route_launch(b.logits, self.bias, None, (b.ids, b.weights))
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
    variants = {"cublas": g.cublas("cublas", False), "cublas+route": g.cublas("cublas+route", True),
                "mma": g.mma("mma", default, False), "mma+route": g.mma("mma+route", default, True)}
    if hm.Run.device.type == "cuda":
        variants.update({n: g.mma(n, t, False) for n, t in sweep(e, k).items() if t != default})
    row = {"default": f"{default.block_m}x{default.block_e}x{default.block_k}s{default.split_k}"}
    tol = None
    for name, fn in variants.items():
        fn()
        fn()  # twice: the counters must be back at 0
        b = g.out[name]
        err = float((b.logits.double() - g.ref).abs().max())
        if name == "cublas":
            tol = 2 * err + float(g.ref.abs().max()) * 2 ** -8
        ok = err <= tol and int(b.count.abs().sum()) == 0
        if name.endswith("+route"):
            r = route(b.logits, config, g.bias)
            ok = ok and torch.equal(r.topk_ids, b.ids) and float((r.topk_weights - b.weights).abs().max()) <= 1e-6
        row[f"{name}_check"] = ("PASS" if ok else "FAIL") + f" err {err:.2e}"
    row.update({f"{n}_us": v for n, v in graph_us(variants).items()})
    return row


def set_rows(layer, rows: int, joined: bool = True) -> None:
    """The one launch up to ``rows`` (256: this branch; gate.MAX_TOKENS = 8: main, torch.mm and the router above),
    joined to the experts' C call or not (``layer_fast.JOINED``); the layer's kept entries dropped."""
    gate_route.ROWS, layer_fast.JOINED = rows, joined
    layer._decode.clear()


def ab_cell(layer, m: int) -> dict:
    """The layer with the one launch up to 256 rows joined to the experts' C call (new), the same launch on its own
    (step), main's torch.mm + router launch above 8 rows (main): host µs (calls after a loop's first, rounds
    interleaved), graph µs, eager == graph, eager twice equal, new vs main's output."""
    x = torch.randn(m, layer.config.hidden_size, device=hm.Run.device, dtype=torch.bfloat16)
    fn = lambda: layer(x)  # noqa: E731
    variants = {"new": (gm.MAX_ROWS, True), "step": (gm.MAX_ROWS, False), "main": (gate_route.MAX_TOKENS, True)}
    if m <= gate_route.MAX_TOKENS:
        variants.pop("main")
    row, outs, rests = {}, {}, {n: [] for n in variants}
    try:
        for name, how in variants.items():
            set_rows(layer, *how)
            for _ in range(hm.Run.warm):
                outs[name] = fn()
            entry = layer._decode._entries.get(m)
            row[f"{name}_path"] = "full" if entry is None else (
                "joint" if entry.joint is not None else "one" if entry.bound is not None else "two")
            row[f"{name}_graph_us"] = hm.gpu_us(fn)
            row[f"{name}_graph_eq"] = hm.graph_equal(fn, outs[name])
            row[f"{name}_eager_twice"] = torch.equal(fn(), outs[name])
        for _ in range(ROUNDS // 2):
            for name, how in variants.items():
                set_rows(layer, *how)
                for _ in range(hm.Run.warm):
                    fn()
                rests[name].append(hm.loop_split([fn], "sync")["rest"])
    finally:
        set_rows(layer, gm.MAX_ROWS)
    row["new_eq_step"] = torch.equal(outs["new"], outs["step"])
    if "main" in outs:
        new, main = outs["new"].float(), outs["main"].float()
        row["new_vs_main_rel"] = float((new - main).abs().max() / main.abs().max().clamp_min(1e-30))
    row.update({f"{n}_rest": round(statistics.median(v), 2) for n, v in rests.items()})
    return row


def parts_main(layer, m: int) -> dict:
    set_rows(layer, gate_route.MAX_TOKENS)
    try:
        return lh.parts_cell(layer, m)
    finally:
        set_rows(layer, gm.MAX_ROWS)


def stages_cell(layer, m: int) -> dict:
    """Graph µs of the layer (as a capture runs it) and of its stages alone: the one gate + router launch, the gate
    kernel then the router's launch, the experts (``experts_triton`` on that routing), beside the floor: which kernel
    keeps graph / floor above 1.15 at Qwen3's M = 1-4."""
    from moekit.experts.triton import experts_triton
    from moekit.routing import gate as gate_mod

    x = torch.randn(m, layer.config.hidden_size, device=hm.Run.device, dtype=torch.bfloat16)
    for _ in range(hm.Run.warm):
        layer(x)
    entry = layer._decode._entries.get(m)
    if entry is None or entry.bound is None:
        return {"skipped": "no one-launch entry"}
    w, bias, b = layer.gate.weight, layer.e_score_correction_bias, entry.buffers
    fns = {"layer": lambda: layer(x), "one_launch": lambda: entry.bound(x, w, None, bias, None, b),
           "experts": lambda: experts_triton(x, layer.w13, layer.w2, b.ids, b.weights)}
    if m <= gate_route.MAX_TOKENS:
        fns["gate"] = lambda: gate_mod.gate_logits(x, w, None, b.logits)
        plan = layer._fused_router._plans[1 if layer.fuse_shared else 0]
        route_launch = fused.bound_route(plan, b.logits, bias, None, layer._fused_router.assert_in_kernel)
        fns["gate+router"] = lambda: (gate_mod.gate_logits(x, w, None, b.logits),
                                      route_launch(b.logits, bias, None, (b.ids, b.weights)))
    row = graph_us(fns)
    row["floor"] = round(lh.floor_us(layer.config, m), 2)
    return row


def measure_cell(preset: str) -> dict:
    """``moekit analyze --preset P --measure --batches 1,2,4,8,16,64,256`` in this process (its ``measure``: the
    routed experts only, K and N scaled where the weight budget says) -> per batch host rest, graph, floor, verdicts;
    the analyze table printed."""
    from rich.console import Console

    from moekit.bench.layer_measure import measure as layer_measure
    from moekit.cli._analyze_tables import print_measurement

    m = layer_measure(hm.layer_config(preset), lh.BATCHES)
    print_measurement(m, Console(width=160))
    us = lambda v: None if not isinstance(v, float) else round(v * 1e6, 1)  # noqa: E731
    return {"scale": m.scale, "rows": {r.batch: {"host_rest": us(r.host_rest_s), "graph": us(r.graph_s),
                                                 "eager": us(r.eager_s), "floor": us(r.predicted_time_s),
                                                 "host_ok": r.host_within_target, "graph_ok": r.graph_within_target}
                                       for r in m.rows}}


def measure(a, start: float, results: dict) -> None:
    """Gate cells at the larger rows, the layers built (~27 GB), the layer A/B and its parts above 8 rows, then the
    rest, each until the budget is spent. ``--second`` (merged main): the A/B, then ``analyze --measure`` per preset,
    then the gate cells and the parts."""
    lh.Run.ceilings = lh._ceilings(hm.Run.device)
    big = [m for m in a.layer_rows if m > gate_route.MAX_TOKENS]
    with torch.no_grad():
        gate_cells = [(f"gate {p} M={m}", lambda p=p, m=m: gate_cell(hm.layer_config(p), m))
                      for m in a.gate_rows for p in a.presets]
        first = [] if a.second else gate_cells[:2 * len(a.presets)]
        for key, cell in first:
            ha.budgeted_cell(results, key, start, a.budget_s, cell)
        if a.smoke:  # the interpreter: the layer cells of the smallest router only
            a.presets = ["mixtral-8x7b"]
        layers = {p: lh.MoE(hm.layer_config(p), backend="triton", router=lh.Run.router, dtype=torch.bfloat16,
                            device=hm.Run.device).eval() for p in a.presets}
        cells = [(f"ab {p} M={m}", lambda m=m, layer=layer: ab_cell(layer, m)) for m in big for p,
                 layer in layers.items()]
        if a.second:
            cells += [(f"ab {p} M={m}", lambda m=m, layer=layer: ab_cell(layer, m))
                      for m in a.layer_rows if m not in big for p, layer in layers.items()]
            cells += [(f"measure {p}", lambda p=p: measure_cell(p)) for p in a.presets]
            cells += [(f"stages {p} M={m}", lambda m=m, layer=layer: stages_cell(layer, m))
                      for p, layer in layers.items() if p.startswith("qwen3") for m in (1, 2, 4)]
        cells += [(f"parts {p} M={m}", lambda m=m, layer=layer: lh.parts_cell(layer, m))
                  for m in big for p, layer in layers.items()]
        cells += [(f"parts-main {p} M={m}", lambda m=m, layer=layer: parts_main(layer, m))
                  for m in big for p, layer in layers.items()]
        cells += [c for c in gate_cells if c not in first]
        cells += [(f"parts {p} M={m}", lambda m=m, layer=layer: lh.parts_cell(layer, m))
                  for m in a.layer_rows if m not in big for p, layer in layers.items()]
        cells += [(f"layer {p} M={m}", lambda m=m, layer=layer: lh.layer_cell(layer, m))
                  for m in a.layer_rows for p, layer in layers.items()]
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
        elif key.startswith("measure"):
            lines.append(f"{key:30} scale {r['scale']} | " + " | ".join(
                f"B={b} host {v['host_rest']} graph {v['graph']} floor {v['floor']} ok {v['host_ok']}/{v['graph_ok']}"
                for b, v in r["rows"].items()))
        elif key.startswith("stages"):
            lines.append(f"{key:30} graph µs " + " ".join(f"{k} {v}" for k, v in r.items()))
        elif key.startswith("ab"):
            names = [n for n in ("new", "step", "main") if f"{n}_rest" in r]
            lines.append(f"{key:30} host rest " + " ".join(f"{n} {r[n + '_rest']:.1f}" for n in names) + " | graph "
                         + " ".join(f"{n} {r[n + '_graph_us']:.1f}" for n in names) + " | graph_eq "
                         + " ".join(f"{n} {r[n + '_graph_eq']}" for n in names) + " | path "
                         + " ".join(f"{n} {r[n + '_path']}" for n in names) + f" | new==step {r['new_eq_step']}"
                         + (f" | new vs main {r['new_vs_main_rel']:.1e}" if "new_vs_main_rel" in r else ""))
    lines.append(lh.table({k: v for k,
                           v in results.items() if not k.startswith(("gate", "ab", "measure", "stages", "elapsed"))}))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=145, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--gate-rows", nargs="*", type=int, default=list(GATE_ROWS))
    p.add_argument("--layer-rows", nargs="*", type=int, default=list(LAYER_ROWS))
    p.add_argument("--second", action="store_true", help="merged main: the A/B and analyze --measure first")
    p.add_argument("--out", default=os.environ.get("OUT", "layer3_out"), help="folder for layer3.json")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        hm.Run.device, hm.Run.scale, hm.Run.samples, hm.Run.loop_calls, hm.Run.warm = (
            torch.device("cpu"), ha.SMOKE_SCALE, 1, 2, 2)
        lh.Run.router = "fused"
        a.budget_s = 1e9
        a.presets, a.gate_rows, a.layer_rows = ["deepseek-v3", "mixtral-8x7b"], [16], [16, 1]
    else:
        hm.Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = hm.Run.device
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "layer3.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
