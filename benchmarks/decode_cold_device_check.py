"""Decode-size experts calls from a cold L2, and one compiled transformers decode step by kernel (issues 13, 19).

    PYTHONPATH=$PWD python benchmarks/decode_cold_device_check.py            # parts A and B (< 2 min)
    PYTHONPATH=$PWD python benchmarks/decode_cold_device_check.py --part-b   # part B alone (< 90 s)

Part A (per shape: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B; M = 1, 2, 4, 8; bf16; CUDA graphs):
- L2 states: ``warm`` replays one routing (what ``moekit bench`` does), ``cold`` rotates over 8 (weight
  set, routing) pairs whose experts do not overlap (as a model's layers would: Qwen3 gets 8 weight sets, the
  others touch >= 700 MB per call anyway), ``flush`` writes 256 MB before each call (the flush's own graph
  time subtracted);
- what runs: ``base3`` = the plan's gate-up, down GEMM and k-sum launched one by one (the naive shortcut),
  ``call`` = the whole experts call as a model makes it, ``gate_up`` = the gate-up launch alone; at M = 1
  also other gate-up tiles (alone) and other down GEMM tiles (base3 with each).
Part B: torch.profiler over transformers' compiled decode (static cache, torch.compile "reduce-overhead") of a
1-layer Qwen3-MoE at Qwen3-30B-A3B widths, for moekit, grouped_mm and no_experts (experts that cost nothing),
each in a process of its own (they compile at once; one profiles at a time, under a file lock): GPU µs per
kernel name per decode step (a 9-token generate minus a 1-token generate, / 8), the wall ms per step, and
every kernel of moekit's / grouped_mm's step that no_experts' step lacks (or has less of).
Hard time limits inside; the table is printed last; JSON under $OUT if set.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

T0 = time.time()
LIMIT_S = 110.0  # both parts; part B alone: PART_B_LIMIT_S
PART_B_LIMIT_S = 85.0
PART_A_S = 100.0  # part A starts no new cell after this (set per pass)
RESULTS: dict = {"cells": [], "kernels": {}, "errors": []}
DEV = torch.device("cuda")
SHAPES = {  # E, N, K, k, weight sets
    "qwen3": (128, 768, 2048, 8, 8),
    "deepseek": (256, 2048, 7168, 8, 1),
    "mixtral": (8, 14336, 4096, 2, 1),
}
MS = (1, 2, 4, 8)
ROT = 8
UP_TILES = [(64, 256, 4, 3), (128, 128, 4, 4)]  # M = 1 gate-up tiles (BN, BK, warps, stages) next to the plan's
DOWN_TILES = [(32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4)]  # M = 1 down GEMM tiles, base3 with each
IMPLS = ("moekit", "grouped_mm", "no_experts")  # part B; no_experts is the ceiling every other is compared with


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


def launchers(b: Bench, m: int, up=None, down=None):
    """Per rotation: (gate_up alone, base3) closures over fresh buffers, and base3's output."""
    from moekit.experts.triton_cache import descriptor_pair

    x, rots = b.inputs(m)
    plan = plan_of(b, x, rots[0][1], rots[0][2], up=up, down=down)
    out = []
    for s, ids, weights in rots:
        h = torch.empty(ids.numel(), b.n, device=DEV, dtype=torch.bfloat16)
        y = torch.empty(ids.numel(), b.k, device=DEV, dtype=torch.bfloat16)
        o3 = torch.empty_like(x)
        pair = descriptor_pair(b.w13[s], b.w2[s], plan.descriptor_key) if plan.descriptor_key else None
        w13a, w13u, w2a = (pair.w13, pair.w13_up, pair.w2) if pair else (b.w13[s], None, b.w2[s])
        gu = (lambda w=w13a, u=w13u, h=h, ids=ids: plan.gate_up(x, w, u, None, h, ids, None, None, None))

        def base(gu=gu, w2a=w2a, h=h, y=y, weights=weights, ids=ids, o=o3):
            gu()
            plan.down(h, w2a, None, y, weights, ids, None, None, None)
            plan.sum_slots(y, ids, ids, o)
        out.append((gu, base, o3))
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


def part_a(passes, stop_s: float) -> None:
    """Cells of (shape, Ms) in ``passes``, each shape's weights made afresh; none starts after ``stop_s``."""
    global PART_A_S
    PART_A_S = stop_s
    for name, ms in passes:
        if elapsed() > PART_A_S:
            break
        b = Bench(name)
        for m in ms:
            if elapsed() > PART_A_S:
                break
            try:
                measure_m(b, m)
            except Exception as err:
                RESULTS["errors"].append(f"{name} M={m}: {type(err).__name__}: {str(err)[:200]}")
        del b
        torch.cuda.empty_cache()


def measure_m(b: Bench, m: int) -> None:
    from moekit.experts.triton import experts_triton

    name, flush = b.name, b.flush_buf.zero_
    x, rots = b.inputs(m)
    fl = round(floor_us(b, m, rots), 2)
    calls = [(lambda s=s, i=i, w=w: experts_triton(x, b.w13[s], b.w2[s], i, w)) for s, i, w in rots]
    if m * b.top_k * 4 > b.e:  # the aligned path: the whole call only
        record(dict(shape=name, M=m, variant="call(aligned)", floor_us=fl, **three_states(calls, flush)))
        return
    plan, ls = launchers(b, m)
    ls[0][1]()
    ref = ls[0][2].clone()
    record(dict(shape=name, M=m, variant="base3", floor_us=fl, **three_states([l[1] for l in ls], flush)))
    record(dict(shape=name, M=m, variant="call", floor_us=fl, **three_states(calls, flush),
                rel_err_vs_base=round(rel(calls[0](), ref), 5)))
    record(dict(shape=name, M=m, variant="gate_up(plan)", floor_us=round(fl * 2 / 3, 2),
                **three_states([l[0] for l in ls], flush)))
    for up in UP_TILES if m == 1 else ():
        if elapsed() > PART_A_S:
            return
        try:
            _, lu = launchers(b, m, up=up)
            record(dict(shape=name, M=m, variant=f"gate_up{up}", **three_states([l[0] for l in lu], flush)))
        except Exception as err:
            RESULTS["errors"].append(f"{name} up {up}: {type(err).__name__}: {str(err)[:160]}")
    for down in DOWN_TILES if m == 1 else ():
        if elapsed() > PART_A_S:
            return
        try:
            _, ld = launchers(b, m, down=down)
            record(dict(shape=name, M=m, variant=f"base3 down{down}", floor_us=fl,
                        **three_states([l[1] for l in ld], flush)))
        except Exception as err:
            RESULTS["errors"].append(f"{name} down {down}: {type(err).__name__}: {str(err)[:160]}")


def kernel_times(fn) -> dict:
    """{kernel name: [total µs, count]} of the CUDA kernels (and copies) ``fn`` ran."""
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


def profile_impl(model, prompt, config, steps: int = 8) -> dict:
    """Wall ms per decode step ((9-token generate - 1-token generate) / 8, medians of 3), and GPU µs and
    launches per kernel name per decode step."""
    from moekit.bench.hf_measure import decode

    wall = {n: statistics.median(decode(model, prompt, n, compiled=config).seconds for _ in range(3))
            for n in (1, steps + 1)}
    short, long = (kernel_times(lambda n=n: decode(model, prompt, n, compiled=config)) for n in (1, steps + 1))
    per_step = {k: [round((v[0] - short.get(k, [0, 0])[0]) / steps, 2), (v[1] - short.get(k, [0, 0])[1]) / steps]
                for k, v in long.items()}
    return dict(step_ms=round((wall[steps + 1] - wall[1]) * 1e3 / steps, 4),
                per_step={k: v for k, v in per_step.items() if v[1] > 0})


def part_b_child(impl: str, flags: str) -> None:
    """One implementation of part B in this process: compile (at once with the others), then profile
    holding the GPU lock (no other measurement runs meanwhile)."""
    from moekit.bench.hf_measure import compile_config, decode
    from moekit.bench.hf_models import build_model, hf_config, register_no_experts
    import moekit.hf  # noqa: F401  (registers "moekit")

    register_no_experts()
    model = build_model(hf_config("qwen3", 1), torch.bfloat16, DEV)
    model.set_experts_implementation(impl)
    prompt = torch.randint(1, 32000, (1, 8), device=DEV)
    config = compile_config(DEV)
    for _ in range(2):  # compile, record the graphs
        decode(model, prompt, 9, compiled=config)
    out: dict = {"kernels": {}, "errors": []}
    with open(os.path.join(flags, "gpu.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            out["kernels"][impl] = profile_impl(model, prompt, config)
        except Exception as err:
            out["errors"].append(f"part B {impl}: {type(err).__name__}: {str(err)[:200]}")
        fcntl.flock(lock, fcntl.LOCK_UN)
    with open(os.path.join(flags, f"{impl}.json"), "w") as f:
        json.dump(out, f)


CHILDREN: dict = {}


def start_part_b(flags: str) -> None:
    for impl in IMPLS:
        log = open(os.path.join(flags, f"{impl}.log"), "w")
        CHILDREN[impl] = subprocess.Popen([sys.executable, __file__, "--child", impl, flags, str(T0)],
                                          stdout=log, stderr=subprocess.STDOUT)


def wait_part_b(until_s: float) -> None:
    while any(c.poll() is None for c in CHILDREN.values()) and elapsed() < until_s:
        time.sleep(0.2)


def merge_children(flags: str) -> None:
    """Each child's results into RESULTS (its log's tail where it wrote none); children still running are ended."""
    for impl, child in CHILDREN.items():
        path = os.path.join(flags, f"{impl}.json")
        if os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
            RESULTS["kernels"].update(got["kernels"])
            RESULTS["errors"] += got["errors"]
        else:
            with open(os.path.join(flags, f"{impl}.log")) as f:
                RESULTS["errors"].append(f"part B {impl} wrote nothing; log tail: " + f.read()[-400:])
        if child.poll() is None:
            child.kill()


def extra_kernels(impl: str, base: str = "no_experts") -> list:
    """(µs, launches, name) per step of each kernel ``impl``'s step has more of than ``base``'s."""
    have, ref = RESULTS["kernels"][impl]["per_step"], RESULTS["kernels"][base]["per_step"]
    rows = [(round(us - ref.get(k, [0, 0])[0], 2), round(cnt - ref.get(k, [0, 0])[1], 3), k)
            for k, (us, cnt) in have.items()]
    return sorted([r for r in rows if r[0] > 0.3 or r[1] > 0], reverse=True)


def table() -> str:
    lines = ["", "shape     M  variant                             floor   warm    cold   flush  err"]
    for c in RESULTS["cells"]:
        lines.append(f"{c['shape']:9} {c['M']:<2} {c['variant']:34} {c.get('floor_us', ''):>6} {c['warm']:>7} "
                     f"{c['cold']:>7} {c['flush']:>7} {c.get('rel_err_vs_base', '')}")
    kernels = RESULTS["kernels"]
    for impl, k in kernels.items():
        total = sum(v[0] for v in k["per_step"].values())
        lines.append(f"\n{impl}: {k['step_ms']} ms per decode step (wall); GPU kernel µs per step (1 layer) {total:.1f}")
        for name, (us, cnt) in sorted(k["per_step"].items(), key=lambda kv: -kv[1][0])[:12]:
            lines.append(f"  {us:8.2f} µs  x{cnt:<6g} {name[:100]}")
    for impl in ("moekit", "grouped_mm"):
        if impl in kernels and "no_experts" in kernels:
            extra = extra_kernels(impl)
            lines.append(f"\n{impl} minus no_experts: wall {1e3 * (kernels[impl]['step_ms'] - kernels['no_experts']['step_ms']):.1f}"
                         f" µs per step, kernels {sum(r[0] for r in extra):.1f} µs:")
            lines += [f"  {us:8.2f} µs  x{cnt:<6g} {name[:100]}" for us, cnt, name in extra[:16]]
    lines += [f"error: {e}" for e in RESULTS["errors"]]
    return "\n".join(lines)


def finish(flags: str, code: int = 0) -> None:
    try:
        merge_children(flags)
    except Exception as err:
        RESULTS["errors"].append(f"merge: {type(err).__name__}: {err}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_cold_device_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(table(), flush=True)
    os._exit(code)


def main() -> None:
    global T0
    if sys.argv[1:2] == ["--child"]:
        T0 = float(sys.argv[4])
        threading.Timer(max(1.0, LIMIT_S - 3 - elapsed()), lambda: os._exit(3)).start()
        part_b_child(sys.argv[2], sys.argv[3])
        os._exit(0)
    only_b = sys.argv[1:2] == ["--part-b"]
    limit = PART_B_LIMIT_S if only_b else LIMIT_S
    flags = tempfile.mkdtemp(prefix="decode_cold_")
    threading.Timer(limit, lambda: (RESULTS["errors"].append("hard time limit"), finish(flags, 2))).start()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    lock = open(os.path.join(flags, "gpu.lock"), "a+")
    if not only_b:  # part B profiles only while part A waits
        fcntl.flock(lock, fcntl.LOCK_EX)
    start_part_b(flags)
    if only_b:
        wait_part_b(limit - 2)
        finish(flags)
    part_a([(n, (1,)) for n in SHAPES], 65.0)
    fcntl.flock(lock, fcntl.LOCK_UN)
    wait_part_b(90.0)
    part_a([(n, MS[1:]) for n in SHAPES], 100.0)
    finish(flags)


if __name__ == "__main__":
    sys.exit(main())
