"""The whole ``MoE`` layer eagerly (issue 13 item 4: host <= 60 µs per forward at decode sizes), beside its graph
replay and the byte model's floor, and eager against graph bit for bit at every M.

    PYTHONPATH=$PWD OUT=/tmp/lh2 python benchmarks/layer_host2_device_check.py [--budget-s 115]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/layer_host2_device_check.py --smoke   (CPU: checks the script)

Cells by priority (``measure``) until --budget-s (then the hard limit stops measuring):
1. ``eq deepseek-v3 M=m`` (m = 5..8; the one gate+router launch up to 8 rows for every plan, main: 4 for
   sigmoid/grouped ones): the layer's eager output (the decode fast path) against the same forward captured in a
   CUDA graph, the capture's routing as shipped (the one launch into fresh buffers, ``gate_route.wants_fresh``:
   ``layer_graph``) or the gate kernel, then the router kernel (``layer_graph_two``); the routing of the one
   launch (``route_tokens`` with the kept buffers) against the two launches: logits, ids, weights equal; the
   experts on the one launch's routing: the decode fast path's experts call against ``MoE._experts_call`` and
   against its graph, and (the shared expert fused) ``experts_triton`` eagerly in VARIANTS against the layer's call; the
   eager layer twice (a nondeterministic reduction would show here).
2. ``layer P M=m`` for Qwen3-30B-A3B, DeepSeek-V3 (shared expert fused), Mixtral-8x7B; bf16, no_grad, the
   preset's full layer (backend triton, router auto), M in BATCHES: host µs per forward as ``moekit bench``
   measures it (``time_eager``: 16 calls, one sync) split into the first call after the sync and the rest's
   mean, eager wall µs per forward, graph replay µs, the floor (``moekit.analysis.roofline.batch_cost`` of the
   routed experts on this run's measured ceilings, plus the fused shared expert's weights read at copy rate),
   graph / floor, and eager against graph: equal; at M <= 8 the graph also with the gate kernel and the router's
   launch captured instead of the one launch (``graph_two``: main's capture).
3. ``parts P M=m`` (M in PARTS_AT): the fast path's pieces, host µs each (``parts_cell``): where the layer's
   microseconds go on the device's host.
Look for: ``layer_graph`` yes in every ``eq`` row (the other columns say where one and two launches differ); host rest
<= 60 at M <= 8 for the three presets (and how far at 16, 64, 256); graph/floor <= 1.15 for M <= 256. JSON to
$OUT/layer_host2.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import host_align_device_check as ha
import host_mid_device_check as hm
from moekit import MoEConfig
from moekit.analysis.formats import WeightFormat
from moekit.analysis.roofline import batch_cost
from moekit.bench.layer_measure import _ceilings
from moekit.bench.timing import time_eager
from moekit.experts.triton import experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit import layer as layer_module
from moekit.layer import MoE
from moekit.routing import Routing, gate_route
from moekit.routing.routed import RoutedTokens

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (1, 2, 4, 8, 16, 64, 256)
EQ_ROWS = (8, 5, 6, 7)
PARTS_AT = (1, 8, 64, 256)  # the fast path's pieces timed apart
SHIPPED_WANTS_FRESH = layer_module.wants_fresh
# the experts' eager variants the eq cells compare with the layer's experts call: the k-sum as its own launch (what
# a graph capture runs), the alignment folded into gate-up up to 128 assignments (DeepSeek-V3's 9 slots x 8 rows = 72)
VARIANTS = {"ksum_separate": LaunchOptions(sum_fold_max=0), "align_fold128": LaunchOptions(align_fold_max=128)}


class Run:
    ceilings = None  # this run's measured copy bandwidth and matmul rate (GpuSpec)
    router = "auto"  # "fused" in a smoke run: the CPU routes with the kernels only when asked (interpreted)


class fresh_off:
    """Calls without kept buffers (captures, stats) route with the gate kernel and the router's launch meanwhile."""

    def __enter__(self):
        layer_module.wants_fresh = lambda *args: False

    def __exit__(self, *exc):
        layer_module.wants_fresh = SHIPPED_WANTS_FRESH


def captured(fn):
    """``fn`` captured in a CUDA graph (warmed on a side stream first) -> (graph, its output); CPU: (None, fn())."""
    if hm.Run.device.type != "cuda":
        return None, fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    hm.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    hm.sync()
    return graph, out


def eq_cell(layer: MoE, m: int) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device=hm.Run.device, dtype=torch.bfloat16)
    fn = lambda: layer(x)  # noqa: E731
    for _ in range(hm.Run.warm):
        out = fn()
    again = fn()
    hm.sync()
    one = layer.route_tokens(x, layer._route_ws)
    with fresh_off():
        two = layer.route_tokens(x)  # the gate kernel, then the router's launch
    row = {"fast_path": m in layer._decode._entries, "one_launch": layer._decode._entries.get(m) is not None
           and layer._decode._entries[m].bound is not None,
           "eager_twice": torch.equal(out, again), "logits": torch.equal(one.router_logits, two.router_logits),
           "ids": torch.equal(one.routing.topk_ids, two.routing.topk_ids),
           "weights": torch.equal(one.routing.topk_weights, two.routing.topk_weights)}
    ids, weights = one.routing.topk_ids.clone(), one.routing.topk_weights.clone()
    routed = RoutedTokens(routing=Routing(topk_ids=ids, topk_weights=weights), dropped_count=None,
                          router_logits=one.router_logits, router_ids=ids, top_k=layer.config.top_k)
    experts = lambda: layer._experts_and_shared(x, routed)  # noqa: E731
    plain = experts()
    _, graphed_experts = captured(experts)
    row["experts_eager_vs_layer"] = torch.equal(plain, out) if row["ids"] and row["weights"] else "routing differs"
    row["experts_graph"] = "cpu" if hm.Run.device.type != "cuda" else torch.equal(graphed_experts, plain)
    if layer.shared_w13 is None:  # the experts alone, eager, on that routing: the k-sum folded or not, the alignment
        w13, w2 = layer.w13, layer.w2  # folded at these rows or not (what the graph path may run differently)
        for name, options in VARIANTS.items():
            call = lambda options=options: experts_triton(x, w13, w2, ids, weights, options=options)  # noqa: E731
            for _ in range(2):
                got = call()
            row[name] = torch.equal(got, plain)
            if m == max(EQ_ROWS):  # its cost: GPU µs (graph) and host µs (calls after the first)
                row[f"{name}_gpu_host"] = (hm.gpu_us(call), hm.loop_split([call], "sync")["rest"])
        if m == max(EQ_ROWS):
            call = lambda: experts_triton(x, w13, w2, ids, weights)  # noqa: E731
            row["default_gpu_host"] = (hm.gpu_us(call), hm.loop_split([call], "sync")["rest"])
    for name, fresh in (("layer_graph", SHIPPED_WANTS_FRESH), ("layer_graph_two", lambda *args: False)):
        layer_module.wants_fresh = fresh  # the capture's gate + router as shipped, or the gate kernel and the router
        _, graphed = captured(fn)
        layer_module.wants_fresh = SHIPPED_WANTS_FRESH
        row[name] = "cpu" if hm.Run.device.type != "cuda" else torch.equal(graphed, out)
        if row[name] is False:
            diff = (graphed.float() - out.float()).abs()
            row[f"{name}_rel_diff"] = float(diff.max() / out.float().abs().max().clamp_min(1e-30))
    return row


def floor_us(config: MoEConfig, m: int) -> float:
    """The byte model's floor for the routed experts on this run's ceilings, plus the fused shared expert's
    weights at the copy rate (the analysis models routed experts only)."""
    fmt = WeightFormat("bfloat16", 16, 0.0, 1, next(iter(Run.ceilings.dense_tflops)))  # the CPU's: float32
    routed = config.replace(shared_expert_intermediate_size=0, shared_expert_gate=False)
    shared_bytes = 3 * config.hidden_size * config.shared_expert_intermediate_size * fmt.bytes_per_weight
    cost = batch_cost(routed, m, fmt, Run.ceilings)
    return (cost.time_floor_s + shared_bytes / Run.ceilings.bandwidth_bytes_s) * 1e6


def layer_cell(layer: MoE, m: int) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device=hm.Run.device, dtype=torch.bfloat16)
    fn = lambda: layer(x)  # noqa: E731
    for _ in range(hm.Run.warm):
        out = fn()
    hm.sync()
    t = time_eager([fn], hm.Run.device)
    split = hm.loop_split([fn], "sync")
    graph = hm.gpu_us(fn)
    floor = floor_us(layer.config, m)
    extra = {}
    if m <= gate_route.MAX_TOKENS:  # the capture with the gate kernel and the router's launch instead of the one
        with fresh_off():
            extra = {"graph_two_us": hm.gpu_us(fn), "graph_two_eq": hm.graph_equal(fn, out)}
    return {**extra, "fast_path": m in layer._decode._entries, "host": round(t.host_us, 2),
            "host_rest": round(t.host_rest_us, 2),
            "first": split["first"], "rest": split["rest"], "eager": round(t.eager_us, 2), "graph_us": graph,
            "floor": round(floor, 2), "graph_over_floor": round(graph / floor, 3), "graph_eq": hm.graph_equal(fn, out)}


def parts_cell(layer: MoE, m: int) -> dict:
    """Host µs per call (back to back, the calls after a loop's first) of the layer's pieces on its decode fast
    path: the whole ``layer(x)``, ``forward`` (no ``nn.Module.__call__``), ``DecodeFast`` (no forward checks), the
    gate + router (the one bound launch, or ``MoE._gate`` / ``torch.mm`` and the router's bound launch), the
    experts' kept call (what the path runs) and the backend's fast path (its own checks: the kept call's saving),
    and ``torch.empty_like`` (one allocation) as a yardstick."""
    x = torch.randn(m, layer.config.hidden_size, device=hm.Run.device, dtype=torch.bfloat16)
    for _ in range(hm.Run.warm):
        layer(x)
    entry = layer._decode._entries.get(m)
    if entry is None:
        return {"skipped": "no fast-path entry"}
    w, bias, buffers = layer.gate.weight, layer.e_score_correction_bias, entry.buffers
    if entry.bound is not None:
        route = lambda: entry.bound(x, w, None, bias, None, buffers)  # noqa: E731
    elif m <= gate_route.MAX_TOKENS:
        route = lambda: (layer._gate(x, w, None, buffers.logits),  # noqa: E731
                         entry.route(buffers.logits, bias, None, (buffers.ids, buffers.weights)))
    else:
        route = lambda: (torch.mm(x, w.t(), out=buffers.logits),  # noqa: E731
                         entry.route(buffers.logits, bias, None, (buffers.ids, buffers.weights)))
    fns = {"layer": lambda: layer(x), "forward": lambda: layer.forward(x), "decode": lambda: layer._decode(layer, x),
           "route": route, "empty_like": lambda: torch.empty_like(x)}
    if entry.kept is not None:  # what the fast path runs (triton_fast.KeptCall)
        fns["experts"] = lambda: entry.kept(x, layer.w13, layer.w2, buffers.ids, buffers.weights)
    if entry.fast is not None:  # the backend's fast path with its own checks (before the kept call)
        fns["experts_fast"] = lambda: entry.fast(x, layer.w13, layer.w2, buffers.ids, buffers.weights, entry.activation)
    row = {name: hm.loop_split([fn], "sync")["rest"] for name, fn in fns.items()}
    row["launches"] = "one" if entry.bound is not None else "gate+router"
    return row


FIRST = (8, 1)  # decode sizes measured for every preset before the other batches


def measure(a, start: float, results: dict) -> None:
    """Every preset's layer built first (~27 GB at full size), then cells by priority until the budget is spent:
    DeepSeek-V3's equality cells, the layer and its parts at FIRST for each preset, then the other batches."""
    Run.ceilings = _ceilings(hm.Run.device)
    with torch.no_grad():
        layers = {p: MoE(hm.layer_config(p), backend="triton", router=Run.router, dtype=torch.bfloat16,
                         device=hm.Run.device).eval() for p in a.presets}
        cells = [(f"eq deepseek-v3 M={m}", lambda m=m: eq_cell(layers["deepseek-v3"], m))
                 for m in (a.eq_rows if "deepseek-v3" in layers else ())]
        for first in (True, False):
            for p, layer in layers.items():
                cells += [(f"layer {p} M={m}", lambda m=m, layer=layer: layer_cell(layer, m))
                          for m in a.batches if (m in FIRST) == first]
                cells += [(f"parts {p} M={m}", lambda m=m, layer=layer: parts_cell(layer, m))
                          for m in a.parts_at if (m in FIRST) == first]
        for key, cell in cells:
            ha.budgeted_cell(results, key, start, a.budget_s, cell)


def _f(v, width: int = 7) -> str:
    return f"{v:{width}.1f}" if isinstance(v, float) else f"{str(v):>{width}}"


def table(results: dict) -> str:
    lines = ["eq: eager layer vs its CUDA graph, one launch vs two (logits ids weights), experts on that routing "
             "(eager = the layer's, graph), eager twice",
             "layer: host = moekit bench's host_us; rest = calls after the first (target <= 60 at M <= 8); eager wall; "
             "graph replay; floor; graph/floor (target <= 1.15)"]
    for key, r in results.items():
        if not isinstance(r, dict) or "skipped" in r or "error" in r:
            lines.append(f"{key:34} {r}")
        elif key.startswith("parts"):
            lines.append(f"{key:34} " + " ".join(f"{k} {_f(v, 5)}" for k, v in r.items()))
        elif key.startswith("eq"):
            cols = ("layer_graph", "layer_graph_two", "logits", "ids", "weights", "experts_eager_vs_layer",
                    "experts_graph", "eager_twice",
                    *VARIANTS)
            lines.append(f"{key:34} " + " ".join(f"{c}={ha._yn(r[c]) if isinstance(r[c], bool) else r[c]}" for c in cols
                                                 if c in r)
                         + "".join(f" {k}={v}" for k, v in r.items() if k.endswith("_gpu_host"))
                         + f" one_launch={r['one_launch']}" + "".join(f" {k}={v:.1e}" for k, v in r.items()
                                                                      if k.endswith("rel_diff")))
        else:
            graph_eq = r["graph_eq"] if r["graph_eq"] == "cpu" else ha._yn(r["graph_eq"])
            two = ("" if "graph_two_us" not in r
                   else f" | two launches: graph {_f(r['graph_two_us'])} eq {r['graph_two_eq']}")
            lines.append(f"{key:34} host {_f(r['host'])} rest {_f(r['rest'])} first {_f(r['first'])} eager "
                         f"{_f(r['eager'])} graph {_f(r['graph_us'])} floor {_f(r['floor'])} g/f "
                         f"{_f(r['graph_over_floor'], 5)} eq {graph_eq} fast {r['fast_path']}{two}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=115.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=140, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    p.add_argument("--eq-rows", nargs="*", type=int, default=list(EQ_ROWS))
    p.add_argument("--parts-at", nargs="*", type=int, default=list(PARTS_AT))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        hm.Run.device, hm.Run.scale, hm.Run.samples, hm.Run.loop_calls, hm.Run.warm = (
            torch.device("cpu"), ha.SMOKE_SCALE, 1, 2, 2)
        Run.router = "fused"
        a.budget_s = 1e9  # the interpreter takes minutes: every cell runs
        if a.batches == list(BATCHES):
            a.batches, a.eq_rows, a.presets, a.parts_at = [2], [8], ["deepseek-v3"], [2]
    else:
        hm.Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = hm.Run.device
    out_dir = Path(os.environ.get("OUT", "layer_host2_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "layer_host2.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
