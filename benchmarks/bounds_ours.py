"""moekit's side of ``bounds_device_check.py``: a cell's routing sets, moekit's weights in the cell's format, the
experts call or the ``MoE`` layer as timed variants, the byte floor, and the lines fitted through the Qwen3 cells.

Shapes: E experts, N intermediate, K hidden, k slots, M tokens, S experts a set touches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import bounds_cells as bc

OURS, ROUTE = "moekit", "moekit gate + router alone"
ISSUE_WAY = {"experts": bc.BENCH_WAY, "layer": bc.ANALYZE_WAY}  # how each issue's number is timed

TOLERANCE = 2e-2


@dataclass
class Cell:
    spec: object  # bounds_device_check.CellSpec
    touched: list[int]  # per rotated set: distinct experts its routing reads
    parts: bc.Parts  # bytes of one expert
    floor_us: float  # mean touched bytes + x and out, at copy speed
    bytes_per_call: float
    gate_io: list  # per set (x [M, K], k): the shapes of the chains' k-sum
    gate_words: int  # E·K/2: int32 words of the bf16 gate weight [E, K], which the chains' gate stage reads
    ours: list  # bc.Variant
    note: str
    extra: dict = field(default_factory=dict)
    layer: object = None  # the MoE (layer cells)
    xs: list = field(default_factory=list)  # the layer's inputs, one a set


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(out.isfinite().all()):
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def status(err: float) -> str:
    return f"PASS (rel L2 {err:.1e})" if err < TOLERANCE else f"FAIL (rel L2 {err:.1e})"


def smoke_shape():
    from moekit.bench.cells import Shape

    return Shape("smoke", 8, 128, 256, 2)


def random_weights(fmt: str, s, dev):
    """(w13, w2) of every expert in ``fmt``: bf16 as the bench makes them; fp8_block / int4_w4a16 straight as their
    packed tensors with random codes and scales (quantizing DeepSeek-V3's 22 GB of bf16 would take the run)."""
    from moekit.bench.cells import make_weights
    from moekit.quant.fp8_block import Fp8BlockWeight
    from moekit.quant.int4 import Int4Weight

    if fmt == "bf16":
        w = make_weights(s, torch.bfloat16, dev)
        return w.w13, w.w2
    pair = []
    for rows, cols in ((2 * s.n, s.k), (s.k, s.n)):
        g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
        e, groups = s.num_experts, -(-cols // 128)
        if fmt == "fp8":  # e4m3 bytes without the NaN codes (0x7f, 0xff), either sign
            q = torch.randint(0, 0x7F, (e, rows, cols), generator=g, device=dev, dtype=torch.uint8)
            q |= torch.randint(0, 2, (e, rows, cols), generator=g, device=dev, dtype=torch.uint8) << 7
            scale = torch.rand(e, -(-rows // 128), groups, generator=g, device=dev) * 2e-5 + 1e-5
            pair.append(Fp8BlockWeight(q=q.view(torch.float8_e4m3fn), scale=scale, dtype=torch.bfloat16))
        else:
            q = torch.randint(0, 256, (e, rows, -(-cols // 2)), generator=g, device=dev, dtype=torch.uint8)
            scale = torch.rand(e, rows, groups, generator=g, device=dev) * 2e-2 / cols**0.5 + 1e-3 / cols**0.5
            zero = torch.randint(0, 16, (e, rows, groups), generator=g, device=dev, dtype=torch.uint8)
            pair.append(Int4Weight(q=q, scale=scale, zero=zero, group_size=128, cols=cols, dtype=torch.bfloat16))
    return tuple(pair)


def subset_reference(x, w13, w2, ids, weights) -> torch.Tensor:
    """``experts_reference`` on the touched experts alone (dequantizing every DeepSeek-V3 expert would not fit)."""
    from moekit.experts.reference import experts_reference
    from moekit.quant.base import QuantizedWeight

    uniq, local = torch.unique(ids, return_inverse=True)
    pick = lambda w: w.select_experts(uniq) if isinstance(w, QuantizedWeight) else w[uniq]  # noqa: E731
    return experts_reference(x, pick(w13), pick(w2), local.to(torch.int32), weights)


def floor_us(touched: list[int], parts: bc.Parts, m: int, k: int, copy_tbps: float) -> tuple[float, float]:
    nbytes = float(np.mean(touched)) * (parts.gate_up + parts.down) + 2 * m * k * 2
    return nbytes / (copy_tbps * 1e12) * 1e6, nbytes


def experts_cell(spec, dev, copy_tbps: float, smoke: bool) -> Cell:
    from moekit.bench.cells import Shape, make_sets, measured_experts_touched
    from moekit.experts import run_experts

    s = smoke_shape() if smoke else Shape.from_preset(spec.preset)
    parts = bc.parts_of(spec.fmt, s.n, s.k)
    sets = make_sets(s, spec.m, 1 if smoke else bc.num_sets(min(s.num_experts, spec.m * s.top_k)
                                                            * (parts.gate_up + parts.down)), torch.bfloat16, dev)
    touched = [measured_experts_touched(t.topk_ids, s.num_experts) for t in sets]
    w13, w2 = random_weights(spec.fmt, s, dev)
    fns = [lambda t=t: run_experts(t.x, w13, w2, t.topk_ids, t.topk_weights, backend="triton") for t in sets]
    t0 = sets[0]
    ref = subset_reference(t0.x, w13, w2, t0.topk_ids, t0.topk_weights)
    check = lambda: status(rel_l2(fns[0](), ref))  # noqa: E731
    ours = [bc.Variant(OURS, "ours", fns, check), bc.Variant(OURS, "ours", fns, check, per_graph=bc.BENCH_WAY)]
    floor, nbytes = floor_us(touched, parts, spec.m, s.k, copy_tbps)
    return Cell(spec, touched, parts, floor, nbytes, [(t.x, s.top_k) for t in sets], s.num_experts * s.k // 2, ours,
                f"{spec.fmt} experts call, E={s.num_experts} N={s.n} K={s.k} k={s.top_k}")


def layer_cell(spec, dev, copy_tbps: float, smoke: bool) -> Cell:
    from moekit.analysis.formats import WeightFormat
    from moekit.analysis.gpus import GpuSpec
    from moekit.analysis.roofline import batch_cost
    from moekit.bench.cells import measured_experts_touched
    from moekit.config import MoEConfig
    from moekit.experts.reference import experts_reference
    from moekit.layer import MoE

    cfg = MoEConfig.preset("qwen3-30b-a3b" if smoke else spec.preset)
    cfg = cfg.replace(shared_expert_intermediate_size=0, shared_expert_gate=False)  # routed experts only: analyze's
    if smoke:
        cfg = cfg.replace(num_experts=8, top_k=2, hidden_size=256, moe_intermediate_size=128)
    e, k, n, top_k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    layer = MoE(cfg, dtype=torch.bfloat16, device=dev)
    parts = bc.parts_of("bf16", n, k)
    g = torch.Generator(device=dev).manual_seed(11)
    nsets = 1 if smoke else bc.num_sets(min(e, spec.m * top_k) * (parts.gate_up + parts.down))
    xs = [torch.randn(spec.m, k, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(nsets)]  # [M, K]
    with torch.no_grad():
        routings = [layer.route_tokens(x).routing for x in xs]
    touched = [measured_experts_touched(r.topk_ids, e) for r in routings]

    def forward(x):
        with torch.no_grad():
            return layer(x)

    fns = [lambda x=x: forward(x) for x in xs]
    ref = experts_reference(xs[0], layer.w13.detach(), layer.w2.detach(), routings[0].topk_ids,
                            routings[0].topk_weights)
    check = lambda: status(rel_l2(fns[0](), ref))  # noqa: E731
    ours = [bc.Variant(OURS, "ours", fns, check), bc.Variant(OURS, "ours", fns, check, per_graph=bc.ANALYZE_WAY),
            route_variant(layer, xs, routings)]
    floor, nbytes = floor_us(touched, parts, spec.m, k, copy_tbps)
    fmt = WeightFormat("bfloat16", 16, 0.0, 1, "bfloat16")
    gpu = GpuSpec("measured", copy_tbps, 0.0, {"bfloat16": 1.0e3}, "copy measured in this run")
    analyze_floor = batch_cost(cfg, spec.m, fmt, gpu).time_floor_s * 1e6
    cell = Cell(spec, touched, parts, floor, nbytes, [(x, top_k) for x in xs], e * k // 2, ours,
                f"MoE layer (gate, routing, experts), E={e} N={n} K={k} k={top_k}; analyze's floor "
                f"{analyze_floor:.1f} µs (uniform touch), x1.15 = {1.15 * analyze_floor:.1f}",
                dict(analyze_floor_us=analyze_floor), layer, xs)
    return cell


def route_variant(layer, xs: list, routings: list) -> bc.Variant:
    """The layer's own gate + router stage alone (``MoE.route_tokens``), as the forward runs it."""

    def route(x):
        with torch.no_grad():
            return layer.route_tokens(x).routing

    fns = [lambda x=x: route(x) for x in xs]
    check = lambda: "PASS" if torch.equal(fns[0]().topk_ids, routings[0].topk_ids) else "FAIL (ids differ)"  # noqa
    return bc.Variant(ROUTE, "route", fns, check)


def build_cell(spec, dev, copy_tbps: float, smoke: bool) -> Cell:
    return (layer_cell if spec.kind == "layer" else experts_cell)(spec, dev, copy_tbps, smoke)


def analyze_time_layer(cell: Cell) -> float | str | None:
    """``moekit.bench.layer_measure.time_layer``'s graph µs for set 0 (what ``moekit analyze --measure`` reports)."""
    from moekit.bench.layer_measure import time_layer

    t = time_layer(cell.layer, cell.xs[0], budget_s=0.2)
    return t.graph_s * 1e6 if isinstance(t.graph_s, float) else t.graph_s


def pick(row: dict, kind: str | None = None, names: tuple = (), per_graph: int = bc.QUEUED) -> tuple[float | None, str]:
    """The fastest variant of a row timed ``per_graph`` way, by kind or by name; (µs, name)."""
    vs = [v for v in row["variants"] if v["us"] is not None and v["per_graph"] == per_graph
          and (v["kind"] == kind or v["name"] in names)]
    if not vs:
        return None, "-"
    best = min(vs, key=lambda v: v["us"])
    return best["us"], best["name"]


def fit_lines(rows: list) -> None:
    """µs = fixed + bytes / rate through the Qwen3 bf16 experts cells (M = 1..8) and the Qwen3 layer cells, for the
    one-launch read, the two-launch chain and ours: the fixed part and the marginal stream rate of each."""
    for kind in ("experts", "layer"):
        pts = [r for r in rows if r["kind"] == kind and r["preset"] == "qwen3-30b-a3b" and r["fmt"] == "bf16"]
        if len(pts) < 2:
            continue
        for label, how in (("1 read", dict(kind="read1")), ("2 dep", dict(names=bc.LENGTHS["2 launches"])),
                           ("gate + 2", dict(names=bc.LENGTHS["gate + 2"])), ("ours", dict(names=(OURS,)))):
            xy = [(r["bytes_per_call"], pick(r, **how)[0]) for r in pts]
            xy = [(b, us) for b, us in xy if us is not None]
            if len(xy) < 2:
                continue
            slope, fixed = np.polyfit([b for b, _ in xy], [us for _, us in xy], 1)
            print(f"fit Qwen3 {kind} {label:<9}: {fixed:5.1f} µs + bytes at {1e-6 / slope:.2f} TB/s "
                  f"({len(xy)} cells)", flush=True)
