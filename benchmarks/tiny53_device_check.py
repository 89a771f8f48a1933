"""tiny53 device check (session 53, issues 16, 19, 15): the weight-only decodes at the tiny-batch cells, today's
shortcut (vLLM's A*4 <= E: block a = assignment a, so an expert two slots pick is read and decoded twice) against
the same decode on aligned blocks (``LaunchOptions.shortcut_max_tokens=1``: an expert's slots in one block).

    PYTHONPATH=$PWD timeout 110 python3 benchmarks/tiny53_device_check.py --out $OUT/tiny53 --deadline 85
    PYTHONPATH=$PWD python3 benchmarks/tiny53_device_check.py --smoke --out /tmp/tiny53   (CPU, interpreted, tiny)
    --cells 0,2   the cells of CELLS by position (default: all, in order, while the deadline allows)

Per cell (CELLS; random packed weights of the preset's real shape, made on the device, no quantization pass):
1. PASS / FAIL of every variant against the torch twin (``triton_wo.fused_experts_wo_torch``, float32 on the touched
   experts), rel L2 < 1e-2; PASS that each aligned variant's plans align and each shortcut one's take the shortcut.
2. One CUDA graph per variant over the cell's input sets, 5 interleaved rounds (``bench_rounds.settled``), medians;
   % of the packed floor (touched experts' q + scales + zeros, x and out, at this run's copy rate, as ``moekit
   bench`` counts it); x = route / variant and the rounds >= 3% faster than the route.
Variants: ``route`` (the triton backend, as ``moekit bench`` times it), ``<decode>`` (that decode named, the
shortcut), ``<decode>-aligned`` (the same on aligned blocks), ``gemv-aligned-bm2`` (the gemv's 2-row blocks: an
expert's two slots share the decode of its words). Prints PASS / FAIL lines, the table last; writes --out/tiny53.json
after each cell.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from bench_run import RunLog, cells_check, rel_l2, smoke_mode

SMOKE = smoke_mode()  # TRITON_INTERPRET=1 before moekit imports its kernels

import torch  # noqa: E402

from bench_rounds import faster_rounds, medians, timed_graphs, variant_lines  # noqa: E402
from moekit.bench.cells import Shape, cell_model, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts import get_backend, triton_wo_plan  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import WoWeight, fused_experts_wo_torch, run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.quant.int4 import Int4Weight  # noqa: E402
from moekit.quant.int8 import Int8Weight  # noqa: E402
from moekit.quant.mxfp4 import Mxfp4Weight  # noqa: E402

ROUNDS = 5
SAMPLE_US = 3000.0  # µs of GPU work a timed sample (replays of the cell's graph)
SHORTCUT = LaunchOptions(lean_launch=False)  # a plan key no route call has; neither option changes a kernel
ALIGNED = replace(SHORTCUT, shortcut_max_tokens=1)
GROUP = {"int4_w4a16": 128, "mxfp4": 32, "int8_w8a16": 0}  # the bench's quantize defaults
RUN = RunLog("tiny53: graph µs a call (median of 5 interleaved rounds), % of the packed floor at this run's copy "
             "rate; x = route / variant, rounds >= 3% faster than the route", stall_s=60.0)


@dataclass(frozen=True)
class Variant:
    name: str
    decode: str | None  # None: the route (the backend's call)
    aligned: bool = False
    block_m: int = 0  # > 0: the decode's config with this BLOCK_M (the gemv's 2-row blocks)


@dataclass(frozen=True)
class Cell:
    preset: str
    scheme: str
    m: int
    variants: tuple[Variant, ...]  # the first is the route: every x is against it
    sets: int = 2  # input sets rotated in a graph: DeepSeek-V3's touched bytes dwarf the L2; Qwen3's do not

    @property
    def name(self) -> str:
        return f"{self.preset} {self.scheme} M={self.m}"


def pair(decode: str) -> tuple[Variant, Variant]:
    return Variant(decode, decode), Variant(f"{decode}-aligned", decode, aligned=True)


ROUTE, BM2 = Variant("route", None), Variant("gemv-aligned-bm2", "gemv", aligned=True, block_m=2)
WORDS, GEMV, MMA, TILE = pair("gluon_words"), pair("gemv"), pair("mma"), pair("tile")
DSV3, QWEN3 = "deepseek-v3", "qwen3-30b-a3b"
CELLS = (
    Cell(DSV3, "int4_w4a16", 8, (ROUTE, *WORDS, *GEMV)),  # H100 route: words; H200: gemv (2-row gemv: cell 2)
    Cell(DSV3, "mxfp4", 8, (ROUTE, *MMA, *WORDS)),
    Cell(QWEN3, "int4_w4a16", 4, (ROUTE, *GEMV, BM2), sets=4),
    Cell(DSV3, "int8_w8a16", 8, (ROUTE, *TILE)),
    Cell(DSV3, "int4_w4a16", 4, (ROUTE, *WORDS, *GEMV)),
    Cell(QWEN3, "mxfp4", 4, (ROUTE, *MMA), sets=4),
    Cell(QWEN3, "int8_w8a16", 4, (ROUTE, *TILE), sets=4),
    Cell(DSV3, "mxfp4", 4, (ROUTE, *MMA)),
    Cell(DSV3, "int4_w4a16", 2, (ROUTE, *WORDS, *GEMV)),
)
SMOKE_SHAPE = Shape("tiny", num_experts=32, n=256, k=256, top_k=2)  # M = 4: A*4 = 32 <= E, the shortcut
SMOKE_CELLS = (Cell("tiny", "int4_w4a16", 4, (ROUTE, *GEMV, BM2, *MMA, *WORDS), sets=2),
               Cell("tiny", "int8_w8a16", 4, (ROUTE, *TILE), sets=2))
TOL = 1e-2


def shape_of(cell: Cell) -> Shape:
    return SMOKE_SHAPE if cell.preset == "tiny" else Shape.from_preset(cell.preset)


def packed(scheme: str, e: int, rows: int, cols: int, dev, g: torch.Generator):
    """(QuantizedWeight the backend takes, WoWeight the kernels and the twin take): random codes in the scheme's
    layout, scales that keep each GEMM's output near unit size (``tests/test_triton_wo.make_weight``'s)."""
    if scheme == "int8_w8a16":
        q = torch.randint(-128, 128, (e, rows, cols), generator=g, dtype=torch.int8, device=dev)
        scale = (torch.rand(e, rows, generator=g, device=dev) + 0.5) / (64 * cols**0.5)
        return Int8Weight(q=q, scale=scale), WoWeight(scheme, q, scale, None, 0)
    group = GROUP[scheme]
    q = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8, device=dev)
    if scheme == "int4_w4a16":
        scale = (torch.rand(e, rows, cols // group, generator=g, device=dev) + 0.5) / (4 * cols**0.5)
        zero = torch.randint(0, 16, (e, rows, cols // group), generator=g, dtype=torch.uint8, device=dev)
        return (Int4Weight(q=q, scale=scale, zero=zero, group_size=group, cols=cols),
                WoWeight(scheme, q, scale, zero, group))
    exponents = torch.randint(122, 127, (e, rows, cols // group), generator=g, dtype=torch.uint8, device=dev)
    return Mxfp4Weight(q=q, scale=exponents, cols=cols), WoWeight(scheme, q, exponents, None, group)


def make_weights(cell: Cell, shape: Shape, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(53)
    (q13, w13), (q2, w2) = (packed(cell.scheme, shape.num_experts, 2 * shape.n, shape.k, dev, g),
                            packed(cell.scheme, shape.num_experts, shape.k, shape.n, dev, g))
    args = [triton_wo_plan.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    expert_bytes = sum(t[0].numel() * t.element_size() for w in (w13, w2) for t in (w.q, w.scale, w.zero)
                       if t is not None)
    return {"q13": q13, "q2": q2, "w13": w13, "w2": w2, "args": args, "expert_bytes": expert_bytes}


def variant_call(cell: Cell, v: Variant, shape: Shape, w: dict, dev):
    """``call(s)``: one call of ``v`` on input set ``s``."""
    if v.decode is None:
        backend = get_backend("triton")
        return lambda s: backend(s.x, w["q13"], w["q2"], s.topk_ids, s.topk_weights)
    config = None
    if v.block_m:
        config = replace(wo_config(cell.m, shape.num_experts, shape.n, shape.k, shape.top_k, cell.scheme,
                                   device_key(dev), v.decode), BLOCK_M=v.block_m)
    options = ALIGNED if v.aligned else SHORTCUT
    return lambda s: run_experts_wo(s.x, *w["args"], s.topk_ids, s.topk_weights, None, cell.scheme, config=config,
                                    options=options, decode=v.decode)


def route_decode(cell: Cell, shape: Shape, w: dict, x) -> str:
    """What the route runs here: the words default where it covers the call, else the chooser's decode."""
    from moekit.experts.triton_wo_words_default import words_default_covers

    if words_default_covers(x, w["args"][0], cell.scheme, "silu", None):
        return "gluon_words"
    return triton_wo_plan.choose_decode(cell.scheme, cell.m, shape.num_experts, shape.n, shape.k, shape.top_k,
                                        None, fused=True)


def layouts(options: LaunchOptions) -> list[bool]:
    """For each fused plan built with ``options`` (and, for options without the shortcut past one token, each words
    plan built without it: its key's last field): whether it aligns."""
    from moekit.experts import triton_wo_words_lean

    fused = [p.align is not None for k, p in triton_wo_plan._WO_PLANS.items() if options in k]
    if options.shortcut_max_tokens > 1:
        return fused
    return fused + [p.align is not None for k, p in triton_wo_words_lean._PLANS.items() if k[-1] is False]


def check_cell(cell: Cell, w: dict, sets, fns: dict, res: dict) -> None:
    s = sets[0]
    ref = fused_experts_wo_torch(s.x, w["w13"], w["w2"], s.topk_ids, s.topk_weights)
    for name, calls in list(fns.items()):
        try:
            out = calls[0]()
        except ValueError as exc:  # the words decode off Hopper, a decode the weights refuse: left out, said why
            RUN.log(f"{cell.name} {name}: cannot run here ({str(exc)[:160]}): left out")
            del fns[name]
            continue
        err = rel_l2(out, ref)
        res.setdefault("rel_l2", {})[name] = err
        RUN.check(f"{cell.name} {name} vs twin", err < TOL, f"rel_l2={err:.2e}")
    aligned = layouts(ALIGNED)
    RUN.check(f"{cell.name} aligned variants' plans align", bool(aligned) and all(aligned), f"{aligned}")
    shortcut = [not aligns for aligns in layouts(SHORTCUT)]
    RUN.check(f"{cell.name} shortcut variants' plans take it", all(shortcut), f"{shortcut}")


def run_cell(cell: Cell, dev, ceil: dict, until: float, result: dict) -> None:
    shape = shape_of(cell)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    w = make_weights(cell, shape, dev)
    sets = make_sets(shape, cell.m, cell.sets, torch.bfloat16, dev, seed=53)
    hit = sum(measured_experts_touched(s.topk_ids, shape.num_experts) for s in sets) / len(sets)
    res = {"route_decode": route_decode(cell, shape, w, sets[0].x), "slots": cell.m * shape.top_k, "touched": hit,
           "expert_bytes": w["expert_bytes"]}
    RUN.log(f"{cell.name}: route runs {res['route_decode']}; {res['slots']} slots on {hit:.1f} experts a call")
    fns = {v.name: [lambda s=s, c=variant_call(cell, v, shape, w, dev): c(s) for s in sets] for v in cell.variants}
    check_cell(cell, w, sets, fns, res)
    _, rounds = timed_graphs(RUN.log, cell.name, fns, len(sets), dev, ROUNDS, SAMPLE_US, until)
    med = medians(rounds)
    floor = cell_model(shape, cell.m, hit, 2, ceil["copy_TBps"], float("inf"), w["expert_bytes"]).floor_us
    res |= {"variants": list(fns), "rounds": rounds, "median_us": med, "floor_us": floor,
            "x": {n: med["route"] / med[n] for n in med},
            "wins": {n: faster_rounds(rounds[n], rounds["route"]) for n in med if n != "route"}}
    result["cells"][cell.name] = res
    RUN.summary.extend(table_lines(cell, res))


def table_lines(cell: Cell, res: dict) -> list[str]:
    return [f"{cell.name}: route = {res['route_decode']}, {res['slots']} slots on {res['touched']:.1f} experts, "
            f"floor {res['floor_us']:.1f} µs", *variant_lines(res, res["floor_us"])]


def main() -> int:
    cells = SMOKE_CELLS if SMOKE else CELLS
    return cells_check(RUN, SMOKE, "tiny53", 85.0, {cell.name: cell for cell in cells}, run_cell, margin_s=10.0)


if __name__ == "__main__":
    sys.exit(main())
