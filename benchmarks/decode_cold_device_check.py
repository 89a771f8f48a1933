"""Decode-size experts calls from a cold L2, and one compiled transformers decode step by kernel (issues 13, 19).

    PYTHONPATH=$PWD python benchmarks/decode_cold_device_check.py

Part A (per shape: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B; M = 1, 2, 4, 8; bf16; CUDA graphs):
- L2 states: ``warm`` replays one routing (what ``moekit bench`` does), ``cold`` rotates over 8 (weight
  set, routing) pairs whose experts do not overlap (as a model's layers would: Qwen3 gets 8 weight sets, the
  others touch >= 700 MB per call anyway), ``flush`` writes 256 MB before each call (the flush's own graph
  time subtracted);
- what runs: ``base`` = the plan's gate-up, down GEMM and k-sum (three launches, the naive shortcut) or the
  whole call (aligned M); ``fused`` = gate-up then ``down_sum`` (the k-sum folded into the down GEMM) over
  tiles (DOT: tensor-core step; CUDA-core step otherwise) and, at M = 1, gate-up tiles, each alone, cold.
- every fused output is checked against the base output (relative error, bf16).
Part B: torch.profiler over transformers' compiled decode (static cache, torch.compile "reduce-overhead")
of a 1-layer Qwen3-MoE at Qwen3-30B-A3B widths, for moekit and grouped_mm: GPU time per kernel name per
decode step (a 9-token generate minus a 1-token generate, / 8).
A hard limit (110 s) prints what has been measured and exits. Table last; JSON under $OUT if set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import torch

T0 = time.time()
LIMIT_S = 110.0
PART_A_S = 65.0  # part A stops starting new variants after this
RESULTS: dict = {"cells": [], "kernels": {}, "errors": []}
DEV = torch.device("cuda")
SHAPES = {  # E, N, K, k, weight sets
    "qwen3": (128, 768, 2048, 8, 8),
    "deepseek": (256, 2048, 7168, 8, 1),
    "mixtral": (8, 14336, 4096, 2, 1),
}
MS = (1, 2, 4, 8)
ROT = 8
UP_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (128, 128, 4, 4)]  # BN, BK, warps, stages
DS_TILES = [(True, 16, 128, 4, 4), (True, 16, 256, 4, 3), (True, 32, 128, 4, 4), (True, 64, 128, 4, 4),
            (False, 16, 256, 4, 3)]  # DOT, BN, BK, warps, stages


def elapsed() -> float:
    return time.time() - T0


def graph_us(calls, reps: int = 10) -> float:
    """µs per call: the calls captured in one CUDA graph in order, the graph replayed (median of 5)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000 / reps / len(calls))
    del g
    return statistics.median(samples)


class Bench:
    """One shape's weights, 8 routings per M, and the launches to time."""

    def __init__(self, name):
        from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options

        self.name = name
        e, n, k, top_k, sets = SHAPES[name]
        self.e, self.n, self.k, self.top_k = e, n, k, top_k
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.w13 = [torch.randn(e, 2 * n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(sets)]
        self.w2 = [torch.randn(e, k, n, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(sets)]
        self.options = resolve_launch_options(LaunchOptions(), DEV)
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    def routing(self, m: int, r: int):
        """Routing r of M tokens: experts disjoint from routing r-1's where E allows."""
        g = torch.Generator().manual_seed(1000 * m + r)
        perm = torch.randperm(self.e, generator=g)
        need = m * self.top_k
        if need * ROT <= self.e:  # disjoint across rotations
            perm = torch.randperm(self.e, generator=torch.Generator().manual_seed(m))[r * need:(r + 1) * need]
            ids = perm.view(m, self.top_k)
        else:
            ids = torch.stack([torch.randperm(self.e, generator=g)[:self.top_k] for _ in range(m)])
        weights = torch.softmax(torch.randn(m, self.top_k, generator=g), -1)
        return ids.to(DEV, torch.int64), weights.to(DEV, torch.float32)

    def inputs(self, m: int):
        x = torch.randn(m, self.k, generator=torch.Generator().manual_seed(m)).to(DEV, torch.bfloat16)  # same per m
        return x, [(r % len(self.w13),) + self.routing(m, r) for r in range(ROT)]


def plan_of(b: Bench, x, ids, weights, up=None, down=None):
    from moekit.experts.configs import GemmTile, KernelConfig, get_config, device_key
    from moekit.experts.triton_plan import plan_for

    cfg = get_config(x.shape[0], b.e, b.n, b.k, b.top_k, x.dtype, device_key(DEV))
    if up is not None or down is not None:
        cfg = KernelConfig(cfg.BLOCK_M, GemmTile(*up[:2], 1, *up[2:]) if up else cfg.up,
                           GemmTile(*down[:2], 1, *down[2:]) if down else cfg.down)
    return plan_for(x, b.w13[0], b.w2[0], ids, weights, None, "silu", cfg, b.options)


def launchers(b: Bench, m: int, up=None, ds=None):
    """Per rotation: (gate_up_only, base3, fused) closures over fresh buffers, and the outputs."""
    from moekit.experts.triton_cache import descriptor_pair, weight_descriptor
    from moekit.experts.triton_plan import down_sum_launch
    from moekit.experts.configs import GemmTile

    x, rots = b.inputs(m)
    plan = plan_of(b, x, rots[0][1], rots[0][2], up=up)
    out = []
    for s, ids, weights in rots:
        a = ids.numel()
        h = torch.empty(a, b.n, device=DEV, dtype=torch.bfloat16)
        y = torch.empty(a, b.k, device=DEV, dtype=torch.bfloat16)
        o3, of = torch.empty_like(x), torch.empty_like(x)
        pair = descriptor_pair(b.w13[s], b.w2[s], plan.descriptor_key) if plan.descriptor_key else None
        w13a, w13u, w2a = (pair.w13, pair.w13_up, pair.w2) if pair else (b.w13[s], None, b.w2[s])
        gu = (lambda p=plan, w=w13a, u=w13u, h=h, ids=ids: p.gate_up(x, w, u, None, h, ids, None, None, None))

        def base(gu=gu, w2a=w2a, h=h, y=y, weights=weights, ids=ids, o=o3):
            gu()
            plan.down(h, w2a, None, y, weights, ids, None, None, None)
            plan.sum_slots(y, ids, ids, o)
        fused = None
        if ds is not None:
            dot, bn, bk, nw, ns = ds
            tile = GemmTile(bn, bk, 1, nw, ns)
            desc = plan.descriptor_key is not None
            launch = down_sum_launch(x, b.w2[s], None, b.top_k, tile, desc, None, b.options, dot=dot)
            w2d = weight_descriptor(b.w2[s], bn, bk) if desc else b.w2[s]

            def fused(gu=gu, launch=launch, w2d=w2d, h=h, weights=weights, ids=ids, o=of):
                gu()
                launch(h, w2d, None, weights, ids, ids, o)
        out.append((gu, base, fused, o3, of))
    return plan, out


def three_states(fns, flush) -> dict:
    """µs per call: warm (first rotation 8x), cold (8 rotations), flush (flush + call, minus flush)."""
    warm = graph_us([fns[0]] * ROT)
    cold = graph_us(fns)
    fl = graph_us([f for fn in fns[:1] for f in (flush, fn)] * 4) * 2 - graph_us([flush] * 4)
    return dict(warm=round(warm, 2), cold=round(cold, 2), flush=round(fl, 2))


def floor_us(b: Bench, m: int, ids_list) -> float:
    touched = statistics.mean(len(torch.unique(ids)) for _, ids, _ in ids_list)
    return touched * 3 * b.n * b.k * 2 / 4.27e12 * 1e6


def rel(a, ref) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def record(cell: dict) -> None:
    RESULTS["cells"].append(cell)
    print(json.dumps(cell), flush=True)


def part_a() -> None:
    from moekit.experts.triton import experts_triton

    for name, ms in [(n, (1,)) for n in SHAPES] + [(n, MS[1:]) for n in SHAPES]:  # M = 1 first everywhere
        if elapsed() > PART_A_S:
            break
        b = Bench(name)
        flush = b.flush_buf.zero_
        for m in ms:
            if elapsed() > PART_A_S:
                break
            naive = m * b.top_k * 4 <= b.e
            x, rots = b.inputs(m)
            fl = floor_us(b, m, rots)
            if not naive:  # the aligned path: the whole call, as a model runs it
                calls = [(lambda s=s, i=i, w=w: experts_triton(x, b.w13[s], b.w2[s], i, w)) for s, i, w in rots]
                record(dict(shape=name, M=m, variant="call(aligned)", floor_us=round(fl, 2), **three_states(calls, flush)))
                continue
            tiles = DS_TILES if m == 1 else DS_TILES[:1] + DS_TILES[2:3]
            plan, ls = launchers(b, m)
            record(dict(shape=name, M=m, variant="base3", floor_us=round(fl, 2),
                        **three_states([l[1] for l in ls], flush)))
            record(dict(shape=name, M=m, variant="gate_up(plan)", **three_states([l[0] for l in ls], flush)))
            ls[0][1]()  # the base output of rotation 0, the fused variants' reference
            ref = ls[0][3]
            for ds in tiles:
                if elapsed() > PART_A_S:
                    break
                try:
                    _, lf = launchers(b, m, ds=ds)
                    cell = dict(shape=name, M=m, variant=f"fused{ds}", floor_us=round(fl, 2),
                                **three_states([l[2] for l in lf], flush))
                    cell["rel_err_vs_base"] = round(rel(lf[0][4], ref), 5)
                    record(cell)
                except Exception as err:  # a tile that does not compile or fit: recorded, not fatal
                    RESULTS["errors"].append(f"{name} M={m} {ds}: {type(err).__name__}: {str(err)[:160]}")
            if m == 1:
                for up in UP_TILES:
                    if elapsed() > PART_A_S:
                        break
                    try:
                        _, lu = launchers(b, m, up=up)
                        record(dict(shape=name, M=m, variant=f"gate_up{up}", **three_states([l[0] for l in lu], flush)))
                    except Exception as err:
                        RESULTS["errors"].append(f"{name} up {up}: {type(err).__name__}: {str(err)[:160]}")
        del b
        torch.cuda.empty_cache()


def kernel_times(fn) -> dict:
    """{kernel name: [total µs, count]} of the CUDA kernels ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    acc: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = acc.setdefault(ev.name, [0.0, 0])
            t[0] += ev.time_range.elapsed_us()
            t[1] += 1
    return acc


def part_b() -> None:
    from moekit.bench.hf_measure import compile_config, decode
    from moekit.bench.hf_models import build_model, hf_config
    import moekit.hf  # noqa: F401

    model = build_model(hf_config("qwen3", 1), torch.bfloat16, DEV)
    prompt = torch.randint(1, 32000, (1, 8), device=DEV)
    config = compile_config(DEV)
    steps = 8
    for impl in ("moekit", "grouped_mm"):
        if elapsed() > LIMIT_S - 35:
            RESULTS["errors"].append(f"part B {impl}: skipped (time)")
            break
        model.set_experts_implementation(impl)
        decode(model, prompt, steps + 1, compiled=config)
        timed = decode(model, prompt, steps + 1, compiled=config)
        short, long = (kernel_times(lambda n=n: decode(model, prompt, n, compiled=config)) for n in (1, steps + 1))
        per_step = {k: [round((v[0] - short.get(k, [0, 0])[0]) / steps, 2), (v[1] - short.get(k, [0, 0])[1]) / steps]
                    for k, v in long.items()}
        per_step = {k: v for k, v in per_step.items() if v[1] > 0}
        RESULTS["kernels"][impl] = dict(generate_ms=round(timed.seconds * 1e3, 2), per_step=per_step)


def table() -> str:
    lines = ["", "shape     M  variant                          floor   warm    cold    flush  err"]
    for c in RESULTS["cells"]:
        lines.append(f"{c['shape']:9} {c['M']:<2} {c['variant']:32} {c.get('floor_us', ''):>6} {c['warm']:>7} "
                     f"{c['cold']:>7} {c['flush']:>7} {c.get('rel_err_vs_base', '')}")
    for impl, k in RESULTS["kernels"].items():
        total = sum(v[0] for v in k["per_step"].values())
        lines.append(f"\n{impl}: generate 9 tokens {k['generate_ms']} ms; GPU kernel µs per decode step (1 layer) {total:.1f}")
        for name, (us, cnt) in sorted(k["per_step"].items(), key=lambda kv: -kv[1][0])[:14]:
            lines.append(f"  {us:8.2f} µs  x{cnt:<4g} {name[:90]}")
    lines += [f"error: {e}" for e in RESULTS["errors"]]
    return "\n".join(lines)


def finish(code: int = 0) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_cold_device_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(table(), flush=True)
    os._exit(code)


def main() -> None:
    threading.Timer(LIMIT_S, lambda: (RESULTS["errors"].append("hard time limit"), finish(2))).start()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for part in (part_a, part_b):
        try:
            part()
        except Exception as err:
            import traceback
            traceback.print_exc()
            RESULTS["errors"].append(f"{part.__name__}: {type(err).__name__}: {str(err)[:200]}")
    finish(0)


if __name__ == "__main__":
    sys.exit(main())
