"""gate52 device check (session 52): the float32 gate at M = 16..256 on narrower expert tiles. Float32 logits run the
tensor-core gate's FMA dot (no float32 MMA at ieee): a serial FFMA chain over a program's K slice per output, 16 of
them a thread in session 51's [16, 128] tiles. ``gate_mma.mma_tiles(..., fp32_block_e=B)`` keeps the split of K (so
each output's chain and the split sum: the bits) and cuts the expert blocks to B: more programs, shorter ones.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/gate52_device_check.py --out $OUT/gate52 --deadline 55
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/gate52_device_check.py --smoke --out /tmp/gate52  (CPU)

(The smoke runs the script, not the bits: the interpreter's dot is numpy's matmul, whose order moves with the tile's
shape, so its candidates' bits lines FAIL there; ``tests/test_routing_gate_fp32_tiles.py`` models the GPU's chain.)

Gate cells (Qwen3-30B-A3B's gate: bf16 x and W, E 128, K 2048, softmax top-8; DeepSeek-V3's: bf16 x, float32 W, E 256,
K 7168, grouped sigmoid + correction bias; the gate and router in one launch as the layer runs it), M in GATE_ROWS:
correctness first, PASS / FAIL: each candidate's logits, ids and weights bit for bit today's (``fp32_block_e=None``);
the logits within 1e-5 of the largest |logit| of the float64 GEMM; then against transformers' float32 router computed
by torch on the GPU (``F.linear`` on the float32 casts, TF32 off, then ``moekit.route``: its softmax / sigmoid, top-k
and renormalisation): ids differing and weights off by more than one float32 ulp, counted, today's and the new
tiles'. Then GPU µs per launch in CUDA graphs (REPEATS launches a graph, variants interleaved over ROUNDS, medians):
``today``, ``e32`` / ``e16`` (fp32_block_e), ``m16e32`` (M > 64: 16-row blocks too, the router over twice
the row blocks; info, its bits compared but not claimed), ``bf16`` (the bf16 gate: bf16 W and logits, for scale).
At M = 1 / 8 the row-loop gate (untouched): fp32 and bf16.
Layer cells (the MoE layer, bf16 experts, the fused router; Qwen3 with router_dtype float32 and a bf16 gate weight,
V3 with its float32 gate weight), M in LAYER_ROWS: the decode step's GPU µs in CUDA graphs: ``today``, ``new``
(fp32_block_e=LAYER_NEW), ``bf16`` (a bf16 gate / router); PASS: new's output bit for bit today's (eager).
Cells run by priority until --deadline; a table last; JSON to --out/gate52.json.
"""

from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rounds import graph_of, interleaved, medians  # noqa: E402
from bench_run import check_parser, run_info, write_json  # noqa: E402
from moekit import MoE, MoEConfig, route  # noqa: E402
from moekit.routing import fused, gate_route  # noqa: E402
from moekit.routing import gate_mma as gm  # noqa: E402
from moekit.routing.workspace import RouteBuffers  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = {"qwen3": ("qwen3-30b-a3b", BF16), "dsv3": ("deepseek-v3", FP32)}  # preset, gate weight dtype
GATE_ROWS = (64, 256, 16, 100, 1, 8)  # by priority; 100: a tail (not a multiple of 16)
LAYER_ROWS = (64, 256, 16, 8, 1)
CANDIDATES = {"e32": 32, "e16": 16}
LAYER_NEW = 32
REPEATS, ROUNDS = 20, 7


def configs(smoke: bool) -> dict:
    """name -> (config, gate weight dtype); the smoke's small shapes keep K split and the experts in several tiles."""
    if not smoke:
        return {n: (MoEConfig.preset(p).replace(router_dtype="float32") if n == "qwen3" else MoEConfig.preset(p), w)
                for n, (p, w) in SHAPES.items()}
    small = MoEConfig(hidden_size=640, moe_intermediate_size=32, num_experts=60, top_k=4, router_dtype="float32")
    grouped = MoEConfig(hidden_size=576, moe_intermediate_size=32, num_experts=64, top_k=4, scoring="sigmoid",
                        n_group=4, topk_group=2, use_correction_bias=True, routed_scaling_factor=2.5)
    return {"qwen3": (small, BF16), "dsv3": (grouped, FP32)}


@dataclass
class Variant:
    """One launch of the gate and router into its own buffers."""

    call: object  # () -> None
    buffers: RouteBuffers


class GateCase:
    """One gate shape at M rows: x [M, K] bf16, W [E, K] in the gate's dtype, the correction bias, the router's plan."""

    def __init__(self, config: MoEConfig, w_dtype: torch.dtype, m: int, device) -> None:
        torch.manual_seed(m)
        e, k = config.num_experts, config.hidden_size
        self.config, self.m, self.device = config, m, device
        self.x = torch.randn(m, k, device=device).to(BF16)
        self.w = (torch.randn(e, k, device=device) * k ** -0.5).to(w_dtype)
        self.bias = torch.rand(e, device=device) * 0.1 if config.use_correction_bias else None
        self.plan = fused.FusedRouter(config)._plans[0]

    def variant(self, dtype: torch.dtype, tiles: gm.MmaTiles | None) -> Variant:
        """The launch with logits in ``dtype`` (bf16: W cast once, here) on ``tiles`` (M > 8) or the row-loop gate."""
        x, bias, m, e = self.x, self.bias, self.m, self.config.num_experts
        w = self.w if dtype == FP32 else self.w.to(BF16)
        if m <= 8:
            bound = gate_route._BoundGateRoute(self.plan, x, w, None, bias, None, False)
            count, part = 1, 1
        else:
            bound = gm.BoundGateMma(self.plan, x, w, None, bias, None, False, tiles, dtype=dtype)
            count, part = (max(n, 1) for n in bound.scratch)
        k = self.config.top_k
        buffers = RouteBuffers(logits=torch.empty(m, e, device=self.device, dtype=dtype),
                               ids=torch.empty(m, k, device=self.device, dtype=torch.int32),
                               weights=torch.empty(m, k, device=self.device, dtype=FP32),
                               count=torch.zeros(count, dtype=torch.int32, device=self.device),
                               part=torch.empty(part, dtype=FP32, device=self.device))
        return Variant(lambda: bound(x, w, None, bias, None, buffers), buffers)

    def variants(self) -> dict:
        m, e, k = self.m, self.config.num_experts, self.config.hidden_size
        if m <= 8:
            return {"today": self.variant(FP32, None), "bf16": self.variant(BF16, None)}
        today = gm.mma_tiles(m, e, k, FP32, fp32_block_e=None)
        out = {"today": self.variant(FP32, today)}
        for name, block_e in CANDIDATES.items():
            tiles = gm.mma_tiles(m, e, k, FP32, fp32_block_e=block_e)
            if tiles != today:
                out[name] = self.variant(FP32, tiles)
        if today.block_m > 16:
            tiles = gm.mma_tiles(m, e, k, FP32, fp32_block_e=32)
            out["m16e32"] = self.variant(FP32, gm.MmaTiles(16, tiles.block_e, tiles.block_k, tiles.split_k))
        out["bf16"] = self.variant(BF16, gm.mma_tiles(m, e, k, BF16))
        return out


def ulps_off(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's float32 ulp (2^(exponent - 24) with frexp's mantissa in [0.5, 1))."""
    _, exponent = torch.frexp(want.float())
    return (got.double() - want.double()).abs() / torch.pow(2.0, exponent.double() - 24)


def gate_checks(case: GateCase, variants: dict) -> dict:
    """PASS / FAIL of each variant against today's bits and the float64 GEMM; the torch float32 router's counts."""
    for v in variants.values():
        v.call()
    cfg, today = case.config, variants["today"].buffers
    ref64 = case.x.double() @ case.w.double().t()  # [M, E]
    logits32 = torch.nn.functional.linear(case.x.float(), case.w.float())  # transformers' float32 router's GEMM
    hf = route(logits32, cfg, case.bias)
    out = {}
    for name, v in variants.items():
        if name == "bf16":
            continue
        b = v.buffers
        err = float((b.logits.double() - ref64).abs().max() / ref64.abs().max())
        same = (torch.equal(b.logits, today.logits) and torch.equal(b.ids, today.ids)
                and torch.equal(b.weights, today.weights))
        ids_off = int((b.ids.long() != hf.topk_ids.long()).sum())
        agree = b.ids.long() == hf.topk_ids.long()
        weights_off = int((ulps_off(b.weights, hf.topk_weights) > 1)[agree].sum())
        ok = err <= 1e-5 and (same or name == "m16e32")
        out[name] = dict(ok=ok, bits_equal=same, err=err, ids_vs_torch=ids_off, weights_gt_1ulp=weights_off,
                         slots=b.ids.numel())
    return out


def graph_us(fns: dict, device) -> dict:
    """GPU µs per call of each fn: REPEATS calls captured in one graph, rounds interleaved, medians (``bench_rounds``);
    NaN off the GPU."""
    graphs = {name: graph_of([fn] * REPEATS, device) for name, fn in fns.items()}
    return {name: round(us, 2) for name, us in medians(interleaved(graphs, REPEATS, device, ROUNDS, 1)).items()}


@contextmanager
def fp32_block_e(value):
    """The launches bound inside on ``gate_mma.FP32_BLOCK_E = value`` (the gate + router launches' cache cleared)."""
    original = gm.FP32_BLOCK_E
    gm.FP32_BLOCK_E = value
    gate_route.clear_launch_caches()
    try:
        yield
    finally:
        gm.FP32_BLOCK_E = original
        gate_route.clear_launch_caches()


def layers(config: MoEConfig, w_dtype: torch.dtype, device) -> dict:
    """{variant: (layer, fp32_block_e)}: today's and the new tiles' layers and the bf16 router's, the experts shared."""
    torch.manual_seed(0)
    first = None
    out = {}
    for name, block_e in (("today", None), ("new", LAYER_NEW), ("bf16", None)):
        cfg = config.replace(router_dtype=None) if name == "bf16" else config
        layer = MoE(cfg, router="fused", dtype=BF16, device=device).eval()
        layer.gate.to(BF16 if name == "bf16" else w_dtype)
        if first is None:
            first = layer
            if cfg.use_correction_bias:
                layer.e_score_correction_bias.copy_(torch.rand(cfg.num_experts, device=device) * 0.1)
        else:
            with torch.no_grad():
                layer.gate.weight.copy_(first.gate.weight)
                if cfg.use_correction_bias:
                    layer.e_score_correction_bias.copy_(first.e_score_correction_bias)
            for p in ("w13", "w2", "shared_w13", "shared_w2"):  # one copy of the experts (V3's are 22 GB)
                if getattr(first, p) is not None:
                    setattr(layer, p, getattr(first, p))
        out[name] = (layer, block_e)
    return out


def layer_cell(cases: dict, m: int, device) -> dict:
    """new's output == today's (eager, bit for bit), then the decode step's GPU µs of each variant: captured under
    its tiles, replayed interleaved."""
    x = torch.randn(m, next(iter(cases.values()))[0].config.hidden_size, device=device).to(BF16)
    outs, graphs = {}, {}
    with torch.no_grad():
        for name, (layer, block_e) in cases.items():
            with fp32_block_e(block_e):
                layer(x)  # keeps its entry (bound on these tiles)
                outs[name] = layer(x)
                graphs[name] = graph_of([functools.partial(layer, x)] * REPEATS, device)
        us = medians(interleaved(graphs, REPEATS, device, ROUNDS, 1))
    return {"ok": torch.equal(outs["new"], outs["today"]), "us": {name: round(v, 2) for name, v in us.items()}}


def cells(smoke: bool) -> list[tuple[str, str, int]]:
    """(kind, shape, M) by priority: the tensor-core gate at 64 and 256, the layers there, then 16, the tail, 1 / 8."""
    if smoke:
        return [("gate", s, m) for m in (20, 100, 8) for s in SHAPES] + [("layer", s, 20) for s in SHAPES]
    gates = [("gate", s, m) for m in GATE_ROWS[:2] for s in SHAPES]
    mid = [("layer", s, m) for m in LAYER_ROWS[:2] for s in SHAPES]
    rest = [("gate", s, m) for m in GATE_ROWS[2:] for s in SHAPES]
    return gates + mid + rest + [("layer", s, m) for m in LAYER_ROWS[2:] for s in SHAPES]


def main() -> None:
    a, start = check_parser(55.0).parse_args(), time.monotonic()
    device = torch.device("cpu" if a.smoke else "cuda")
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the torch float32 router: full float32 products
    shapes = configs(a.smoke)
    built: dict = {}
    gate_rows, layer_rows, failed = [], [], 0
    for kind, shape, m in cells(a.smoke):
        if time.monotonic() - start > a.deadline:
            print(f"SKIPPED {kind} {shape} M={m}: deadline", flush=True)
            continue
        config, w_dtype = shapes[shape]
        if kind == "gate":
            case = GateCase(config, w_dtype, m, device)
            variants = case.variants()
            checks = gate_checks(case, variants)
            for name, c in checks.items():
                failed += not c["ok"]
                print(f"{'PASS' if c['ok'] else 'FAIL'} gate {shape} M={m} {name}: bits_equal_today={c['bits_equal']} "
                      f"err {c['err']:.1e}; vs torch fp32 router: ids off {c['ids_vs_torch']}/{c['slots']}, "
                      f"weights > 1 ulp {c['weights_gt_1ulp']}", flush=True)
            us = graph_us({name: v.call for name, v in variants.items()}, device)
            gate_rows.append({"shape": shape, "m": m, "checks": checks, "us": us})
            print(f"  [{time.monotonic() - start:5.1f}s] gate {shape} M={m} µs {us}", flush=True)
        else:
            if shape not in built:
                built[shape] = layers(config, w_dtype, device)
            row = layer_cell(built[shape], m, device)
            failed += not row["ok"]
            print(f"{'PASS' if row['ok'] else 'FAIL'} layer {shape} M={m}: new output == today's", flush=True)
            layer_rows.append({"shape": shape, "m": m} | row)
            print(f"  [{time.monotonic() - start:5.1f}s] layer {shape} M={m} µs {row['us']}", flush=True)
        if a.out:  # after every cell: a run cut short keeps what it measured
            write_json(f"{a.out}/gate52.json", {"info": run_info(), "gate": gate_rows, "layer": layer_rows})
    info = run_info() | {"seconds": round(time.monotonic() - start, 1)}
    if a.out:
        write_json(f"{a.out}/gate52.json", {"info": info, "gate": gate_rows, "layer": layer_rows})
    print(f"\n{info}  GPU µs per call in CUDA graphs (medians of {ROUNDS} interleaved rounds of {REPEATS})")
    names = ("today", *CANDIDATES, "m16e32", "bf16")
    print(f"{'gate':6} {'M':>4} " + " ".join(f"{n:>8}" for n in names))
    for r in gate_rows:
        print(f"{r['shape']:6} {r['m']:>4} " + " ".join(f"{r['us'].get(n, float('nan')):>8}" for n in names))
    print(f"{'layer':6} {'M':>4} " + " ".join(f"{n:>8}" for n in ("today", "new", "bf16")))
    for r in layer_rows:
        print(f"{r['shape']:6} {r['m']:>4} " + " ".join(f"{r['us'][n]:>8}" for n in ("today", "new", "bf16")))
    print(f"total {time.monotonic() - start:.1f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
