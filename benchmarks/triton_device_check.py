"""GPU checks of the Triton experts backend that the CPU interpreter cannot make (run on the device).

    PYTHONPATH=. python benchmarks/triton_device_check.py [STEP ...]

Steps (all by default): alignment (equal to the torch twin at real shapes); experts (vs the float32
reference at the three preset shapes in bf16 and fp32, an expert map with -1, skipped ids); graphs
(CUDA-graph capture, replay with different routing); compiled (torch.compile(fullgraph=True) on MoE);
layer_graph (a CUDA graph of the whole MoE forward); races (programmatic dependent launch replayed
many times in a CUDA graph against the path without it).
Prints one line per check; exit 1 on any failure.
"""

from __future__ import annotations

import sys
import traceback

import torch

from moekit.bench.cells import PRESETS, Shape, make_weights, uniform_routing
from moekit.experts.reference import experts_reference
from moekit.experts.triton import experts_triton
from moekit.experts.triton_align import align_block_triton
from moekit.experts.triton_gluon import DEFAULT_CHOICE, gluon_takes
from moekit.experts.triton_launch import LaunchOptions
from moekit.layouts.block_aligned import align_block
from bench_run import RunLog

RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check


def rel_err(out, ref):
    if out.isnan().any():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def alignment(dev):
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        for m in (1, 8, 64, 1024, 16384):
            ids = uniform_routing(m, s, dev, seed=m).topk_ids
            for block in (16, 64, 128):
                for emap in (None, torch.where(torch.arange(s.num_experts, device=dev) % 5 == 3, -1,
                                               torch.arange(s.num_experts, device=dev)).int()):
                    a = align_block(ids, s.num_experts, block, emap)
                    b = align_block_triton(ids, s.num_experts, block, emap)
                    ok = all(torch.equal(getattr(a, f), getattr(b, f))
                             for f in ("sorted_ids", "expert_ids", "num_padded", "counts"))
                    if not ok:
                        check(f"align {preset} M={m} B={block} map={emap is not None}", False)
                        return
    check("align == twin at real shapes (3 presets x 5 M x 3 blocks x map)", True)


def experts(dev):
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        expert_weights = make_weights(s, torch.bfloat16, dev)
        w13, w2 = expert_weights.w13, expert_weights.w2
        # 4096: Mixtral's calls take the Gluon GEMMs (triton_gluon.DEFAULT_CHOICE)
        for m in (1, 3, 33, 256, 2048, 4096):
            x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
            routing = uniform_routing(m, s, dev, seed=m)
            ids, w = routing.topk_ids, routing.topk_weights
            out = experts_triton(x, w13, w2, ids, w)
            ref = _ref32(x, w13, w2, ids, w)
            e = rel_err(out, ref)
            check(f"experts bf16 {preset} M={m}", e < 1e-2, f"rel_err={e:.2e}")
        del expert_weights, w13, w2
        torch.cuda.empty_cache()
    s = Shape("small", 64, 200, 333, 6)
    expert_weights = make_weights(s, torch.float32, dev)
    w13, w2 = expert_weights.w13, expert_weights.w2
    x = torch.randn(77, s.k, device=dev)
    routing = uniform_routing(77, s, dev, seed=1)
    ids, w = routing.topk_ids, routing.topk_weights
    check("experts fp32 odd K,N",
          (e := rel_err(experts_triton(x, w13, w2, ids, w), _ref32(x, w13, w2, ids, w, torch.float64))) < 1e-5,
          f"rel_err={e:.2e}")
    emap = torch.full((80,), -1, dtype=torch.int32, device=dev)
    emap[torch.randperm(80, device=dev)[:64]] = torch.arange(64, dtype=torch.int32, device=dev)
    gids = torch.randint(-1, 90, (77, 6), device=dev, dtype=torch.int32)
    e = rel_err(experts_triton(x, w13, w2, gids, w, expert_map=emap), _ref32(x, w13, w2, gids, w, torch.float64, emap))
    check("experts fp32 expert map with -1, skipped ids", e < 1e-5, f"rel_err={e:.2e}")


def _ref32(x, w13, w2, ids, w, dtype=torch.float32, emap=None):
    return experts_reference(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, w, expert_map=emap)


def graphs(dev):
    s = Shape.from_preset("qwen3-30b-a3b")
    expert_weights = make_weights(s, torch.bfloat16, dev)
    w13, w2 = expert_weights.w13, expert_weights.w2
    for m in (1, 64, 1024):
        x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(m, s, dev, seed=0)
        ids, w = routing.topk_ids, routing.topk_weights
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            experts_triton(x, w13, w2, ids, w)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = experts_triton(x, w13, w2, ids, w)
        worst = 0.0
        for seed in (1, 2, 3):
            routing = uniform_routing(m, s, dev, seed=seed)
            new_ids, new_w = routing.topk_ids, routing.topk_weights
            ids.copy_(new_ids)
            w.copy_(new_w)
            x.normal_()
            g.replay()
            worst = max(worst, rel_err(out, experts_triton(x, w13, w2, ids, w)))
        check(f"cuda graph replay with new routing M={m}", worst < 1e-6, f"max rel diff vs eager {worst:.1e}")


def compiled(dev):
    from moekit.config import MoEConfig
    from moekit.layer import MoE

    cfg = MoEConfig.preset("qwen3-30b-a3b")  # nonfinite="raise": a device-side assert, traced too
    layer = MoE(cfg, backend="triton", dtype=torch.bfloat16, device=dev)
    x = torch.randn(4, 16, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        out = torch.compile(layer, fullgraph=True)(x)
    check("torch.compile(fullgraph=True) MoE", (e := rel_err(out, eager)) < 1e-2, f"rel_err={e:.1e}")


def layer_graph(dev):
    """The whole MoE forward (gate, route, align, experts) captured once, replayed on new tokens."""
    from moekit.config import MoEConfig
    from moekit.layer import MoE

    layer = MoE(MoEConfig.preset("deepseek-v3").replace(hidden_size=1024, moe_intermediate_size=256),
                backend="triton", dtype=torch.bfloat16, device=dev)
    x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            layer(x)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = layer(x)
        worst = 0.0
        for _ in range(3):
            x.normal_()
            g.replay()
            worst = max(worst, rel_err(out, layer(x)))
    check("cuda graph of the whole MoE forward (grouped routing, shared slot), new tokens", worst < 1e-6,
          f"{worst:.1e}")


def races(dev):
    """A kernel that read its input before the previous one had finished would show up as an occasional
    wrong row: replay 50 times, compare each with the path launched without PDL."""
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        expert_weights = make_weights(s, torch.bfloat16, dev)
        w13, w2 = expert_weights.w13, expert_weights.w2
        for m in (1, 8, 64, 1024):
            x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
            routing = uniform_routing(m, s, dev, seed=m)
            ids, w = routing.topk_ids, routing.topk_weights
            # The default call's Gluon route (prefill sizes, ``triton_gluon.DEFAULT_CHOICE``) launches without PDL and
            # only under the default options: its reference is its own eager call (a no-PDL options object would
            # take the fused kernels, another summation order: 3.3e-3 at Mixtral M = 1024 in session 20's run).
            gluon = gluon_takes(x, w13, w2, w, "silu", None, None, DEFAULT_CHOICE)
            no_pdl = {} if gluon else {"options": LaunchOptions(dependent_launch=False)}
            want = experts_triton(x, w13, w2, ids, w, **no_pdl)
            experts_triton(x, w13, w2, ids, w)  # compile outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = experts_triton(x, w13, w2, ids, w)
            worst = 0.0
            for _ in range(50):
                out.zero_()
                g.replay()
                worst = max(worst, rel_err(out, want))
            against = "its eager call (Gluon route, no PDL)" if gluon else "no PDL"
            check(f"races {preset} M={m}: 50 graph replays vs {against}", worst < 1e-3, f"max rel diff {worst:.1e}")
        del expert_weights, w13, w2
        torch.cuda.empty_cache()


def main() -> int:
    dev = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    import triton

    print("triton", triton.__version__, flush=True)
    steps = {f.__name__: f for f in (alignment, experts, graphs, compiled, layer_graph, races)}
    for step in [steps[name] for name in sys.argv[1:]] or steps.values():
        try:
            step(dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            check(step.__name__, False, "raised")
    print("FAILED:", FAILED if FAILED else "none", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
