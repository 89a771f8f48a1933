"""Issue #16 target 1, session 45 (brief w4g45): the int4 words gate-up (``moekit/experts/_kernels/gluon_wo_words.py``:
16-byte word loads straight into mma.sync's register operand) against the route's pick's gate-up and a pure read of
the same bytes in the same geometry (``w4g45_reads``).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/w4g45_device_check.py --out $OUT/w4g45 --deadline 70   # GPU
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/w4g45_device_check.py --out $OUT/w4g45 --deadline 70 --calls  # CK2
    PYTHONPATH=$PWD python3 benchmarks/w4g45_device_check.py --smoke        # CPU: the kernels' torch twins, tiny
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/w4g45_device_check.py --out $OUT/w4u45 --deadline 75 --calls \
        --aheads 1 2 --eager --ms 1 8 32 64                                 # session 46's one call (w4u45)

Per cell (int4, groups of 128, random scales and zero points): PASS / FAIL of the words gate-up's h against the torch
twin (``dequantize_wo`` in float32, silu(gate) * up; rel-L2 <= TOL), of the pick's h likewise, and of the read's
folds against ``read_fold_twin`` (its first blocks); then CUDA graphs over SETS rotated input sets, ROUNDS rounds
(``bench_rounds.settled``, shuffled), median µs a call of: "words" (x_words + the kernel), "words_k2" (K split
over two programs, then the split_glu launch), "kernel" (the kernel alone, x_words made before), "read" (the pure
read), "pick" (the route's launches up to its down GEMM: alignment, gate-up, split_glu where it has them) and
"align" (the pick's alignment alone, aligned cells). The floor: the touched experts' w13 bytes (codes, scales,
zero points) at the copy rate measured first. Table last; JSON <out>/w4g45.json.
CK2 (``--calls``): whole calls instead, PASS against ``fused_experts_wo_torch`` (w2 random too), graph µs of the pick
("pick": ``run_experts_wo``), the words kernels at each down split of SPLITS ("words_sS": the layout
(``words_layout``, w4u45: made in the call, as the pick's is; CK2 at c082770 passed the words calls a layout made
before), x reorder, gate-up storing h in the dot order, down, the k-sum launch), and both gate-ups alone; the
floor: w13 and w2 bytes.
``--aheads 1 2`` (w4u45): each words call with both kernels' words 1 and 2 steps in flight ("words_sS" and
"words_sS_a2"; ``gluon_wo_words.words_loop``'s AHEAD), the gate-ups alone likewise. ``--eager``: beside the graph
µs, each whole call eager (``eager_us``): its wall a call over EAGER_CALLS calls, and the host's part (the time
until the last call returned, before the synchronize). ``--ms``: the token counts of DeepSeek-V3 and Mixtral
(``--ms 1 8 32 64``: eight cells, M-major, the down split of a cell SPLITS lacks by ``down_split``).
"""

from __future__ import annotations

import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import graph_of, medians, settled, shuffled, wins  # noqa: E402
from bench_run import RunLog, check_parser, run_info, write_json  # noqa: E402
from decode_q3_device_check import measure_copy, rel_l2  # noqa: E402
from wo_device_check import quantized  # noqa: E402

from moekit.bench.cells import Shape, make_sets  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import dequantize_wo, fused_experts_wo_torch, run_experts_wo, wo_launches  # noqa: E402
from moekit.experts.triton_wo_plan import weight_args, wo_plan_for  # noqa: E402
from moekit.experts.triton_wo_words import (  # noqa: E402
    NUM_WARPS, down_split, experts_words, gate_up_words, words_gate_up_launch, words_layout, x_words,
)
from moekit.experts.triton_wo_words_twin import gate_up_words_torch  # noqa: E402
from moekit.layouts.block_aligned import align_block  # noqa: E402

CELLS = (("mixtral-8x7b", 1), ("deepseek-v3", 1), ("mixtral-8x7b", 8), ("deepseek-v3", 8), ("qwen3-30b-a3b", 1))
# CK2: the down GEMM's splits timed per cell (programs: Mixtral M = 1 has 2 x 64 row tiles of 64 outputs unsplit)
SPLITS = {("mixtral-8x7b", 1): (4, 8), ("deepseek-v3", 1): (1, 2), ("mixtral-8x7b", 8): (2, 4),
          ("deepseek-v3", 8): (1,), ("qwen3-30b-a3b", 1): (1, 3)}
SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
EAGER_CALLS, EAGER_ROUNDS = 24, 3  # --eager: calls a round (under the launch queue's depth), rounds (median)
WIDE_PRESETS = ("deepseek-v3", "mixtral-8x7b")  # --ms's cells
RUN = RunLog("w4g45: gate-up launches, graph µs, median of 5 rounds; % of the w13 byte floor; x pick = pick / words")


def _randomized(w, dev, seed: int):
    """``w`` with scales 0.5-1.5x the unit-variance one and zero points 0-15, random (in place)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w.scale.mul_(torch.rand(w.scale.shape, generator=g, device=dev) + 0.5)
    w.zero.copy_(torch.randint(0, 16, w.zero.shape, generator=g, device=dev, dtype=torch.uint8))
    return w


def weights(s: Shape, dev, seed: int, whole: bool = False):
    """w13 int4 (random codes, scales and zero points: ``_randomized``) and w2 likewise (``whole``) or uninitialised
    (the gate-up cells: only its plan reads it)."""
    w13 = _randomized(quantized("int4_w4a16", s.num_experts, 2 * s.n, s.k, dev, seed=seed), dev, seed + 7)
    w2 = quantized("int4_w4a16", s.num_experts, s.k, s.n, dev, seed=seed + 1 if whole else None)
    return w13, _randomized(w2, dev, seed + 8) if whole else w2


def h_twin(x, w13, ids) -> torch.Tensor:
    """h [A, N] float32 by ``dequantize_wo``, one touched expert at a time."""
    n, top_k = w13.q.shape[1] // 2, ids.shape[1]
    flat = ids.reshape(-1)
    h = torch.empty(flat.numel(), n, device=x.device)
    for e in flat.unique().tolist():
        slots = (flat == e).nonzero()[:, 0]
        v = x[slots // top_k].float() @ dequantize_wo(w13, x.shape[1], e).t()  # [m, 2N]
        h[slots] = torch.nn.functional.silu(v[:, :n]) * v[:, n:]
    return h


def pick_launches(c, a13, a2, upto_align: bool = False) -> tuple:
    """(a function running the route's launches before its down GEMM, its h buffer; None where the plan folds its
    gate-up's split partials into the down GEMM (``glu_fold``): that h is never written)."""
    plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, "int4_w4a16", "silu", None, LaunchOptions(),
                       None, None, None, None)
    b = plan.workspace.allocate(c.x.device)
    out = torch.empty_like(c.x)
    launches = wo_launches(plan, b, c.x, a13, a2, c.topk_ids, c.topk_weights, None, out)
    stop = next(i for i, (launch, _) in enumerate(launches) if launch in (plan.down, plan.down_sum))
    if upto_align:
        stop = next(i for i, (launch, _) in enumerate(launches) if launch is plan.gate_up)
    chosen = launches[:stop]

    def run() -> None:
        for launch, pointers in chosen:
            launch(*pointers)

    return run, None if plan.glu_fold else b["h"], plan.decode


def read_call(c, w13, layout, n: int):
    """(a function running the pure read on this set's blocks, its fold buffer, the blocks' experts)."""
    from w4g45_reads import read_words_kernel

    naive = layout.naive
    experts = c.topk_ids.reshape(-1) if naive else layout.expert_ids
    blocks = experts.numel()
    tiles = n // (8 * NUM_WARPS)
    out = torch.empty(blocks * tiles * 32, dtype=torch.int32, device=c.x.device)
    args = (w13.q, c.topk_ids.reshape(-1), layout.expert_ids, layout.num_padded, out, n, w13.q.shape[2] * 2,
            w13.q.stride(0) // 4, w13.q.stride(1) // 4)

    def run() -> None:
        read_words_kernel[(blocks * tiles,)](*args, BM=8, NAIVE=naive, num_warps=NUM_WARPS, enable_fp_fusion=True)

    return run, out, experts


def floor_us(s: Shape, ids: torch.Tensor, copy_tbps: float) -> float:
    """The touched experts' w13 bytes (codes, float32 scales, zero points) at the copy rate."""
    groups = s.k // 128
    per_expert = 2 * s.n * (s.k // 2 + 5 * groups)
    return ids.unique().numel() * per_expert / (copy_tbps * 1e12) * 1e6


def check_cell(label: str, s: Shape, c, w13, a13, a2, layout) -> dict:
    """The PASS / FAIL lines on set 0; returns the calls that passed, by name."""
    twin = h_twin(c.x, w13, c.topk_ids)
    calls = {}
    if SMOKE:
        mine = gate_up_words_torch(c.x, a13, c.topk_ids).float()
    else:
        mine = gate_up_words(c.x, a13, c.topk_ids, layout).float()
        torch.cuda.synchronize()
    if RUN.check(f"{label} words h", rel_l2(mine, twin) <= TOL, f"rel-L2 {rel_l2(mine, twin):.2e}"):
        calls["words"] = None
    if not SMOKE:
        halves = gate_up_words(c.x, a13, c.topk_ids, layout, split=2).float()
        err = rel_l2(halves, twin)
        if RUN.check(f"{label} words_k2 h (K split in 2)", err <= TOL, f"rel-L2 {err:.2e}"):
            calls["words_k2"] = None
    run, h, decode = pick_launches(c, a13, a2)
    run()
    if h is None:  # folded: checked as a whole call by --calls (CK2); timed here all the same
        print(f"INFO  {label} pick ({decode}): gate-up folded into the down GEMM, timed, no h to compare", flush=True)
        calls["pick"] = None
    else:
        err = rel_l2(h.float(), twin)
        if RUN.check(f"{label} pick ({decode}) h", err <= TOL, f"rel-L2 {err:.2e}"):
            calls["pick"] = None
    if not SMOKE:
        from w4g45_reads import read_fold_twin

        run, out, experts = read_call(c, w13, layout, s.n)
        run()
        first = experts[:2].tolist()
        twin_fold = read_fold_twin(w13.q, first, s.n, NUM_WARPS).reshape(-1)
        ok = torch.equal(out[:twin_fold.numel()], twin_fold)
        if RUN.check(f"{label} read folds", ok, f"first {len(first)} blocks"):
            calls["read"] = None
    return calls


def timed(label: str, s: Shape, sets: list, w13, a13, a2, layouts: list, calls: dict, stop: float) -> dict:
    """name -> [µs a call per round] of the cell's graphs."""
    fns = {}
    if "words" in calls:
        fns["words"] = [lambda c=c, lay=lay: gate_up_words(c.x, a13, c.topk_ids, lay) for c, lay in zip(sets, layouts)]
    if "words_k2" in calls:
        fns["words_k2"] = [lambda c=c, lay=lay: gate_up_words(c.x, a13, c.topk_ids, lay, split=2)
                           for c, lay in zip(sets, layouts)]
        made = [x_words(c.x) for c in sets]
        kernels = []
        for c, lay, xw in zip(sets, layouts, made):
            a, h = c.topk_ids.numel(), torch.empty(c.topk_ids.numel(), s.n, dtype=c.x.dtype, device=c.x.device)
            blocks = a if lay.naive else lay.expert_ids.numel()
            launch = words_gate_up_launch(a13, a, c.topk_ids.shape[1], blocks, lay.naive, 8)
            rows = (None, None, None) if lay.naive else (lay.sorted_ids, lay.expert_ids, lay.num_padded)
            ptrs = (xw.x, xw.sums, a13.q, a13.scale, a13.zero, h, c.topk_ids.reshape(-1), *rows, None)
            kernels.append(lambda launch=launch, ptrs=ptrs: launch(*ptrs))
        fns["kernel"] = kernels
    if "read" in calls:
        fns["read"] = [read_call(c, w13, lay, s.n)[0] for c, lay in zip(sets, layouts)]
    if "pick" in calls:
        fns["pick"] = [pick_launches(c, a13, a2)[0] for c in sets]
        if not layouts[0].naive:
            fns["align"] = [pick_launches(c, a13, a2, upto_align=True)[0] for c in sets]
    graphs = {name: graph_of(f, sets[0].x.device) for name, f in fns.items()}
    rounds = settled({n: (g, None) for n, g in graphs.items()}, len(sets), sets[0].x.device, ROUNDS, REPLAYS,
                     stop, order=shuffled)
    del graphs
    return rounds


def run_cell(preset: str, m: int, dev, copy_tbps: float, stop: float, results: list) -> None:
    s = Shape(f"{preset}/smoke", 8, 64, 512, 2) if SMOKE else Shape.from_preset(preset)
    label = f"{preset} int4 M={m}"
    w13, w2 = weights(s, dev, seed=m)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    sets = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    layouts = [align_block(c.topk_ids, s.num_experts, 8) for c in sets]
    RUN.log(f"{label}: {'tiny-batch shortcut' if layouts[0].naive else 'aligned, 8-row blocks'}")
    calls = check_cell(label, s, sets[0], w13, a13, a2, layouts[0])
    if dev.type != "cuda":
        return
    rounds = timed(label, s, sets, w13, a13, a2, layouts, calls, stop)
    times = medians(rounds)
    floor = sum(floor_us(s, c.topk_ids, copy_tbps) for c in sets) / len(sets)
    results.append({"cell": label, "floor_us": floor, "times": times, "rounds": rounds})
    RUN.log(f"{label}: floor {floor:.1f} " + "  ".join(f"{n} {t:.1f}" for n, t in times.items()))
    pick, words, read = times.get("pick"), times.get("words"), times.get("read")
    line = f"{label} (floor {floor:.1f} µs):"
    for n, t in times.items():
        line += f"  {n} {t:.1f} ({100 * floor / t:.0f}%)"
    if pick and words:
        won = wins(rounds["words"], rounds["pick"])
        line += f"; x pick {pick / words:.3f}, words faster {won}/{len(rounds['words'])}"
    if read and words:
        line += f"; words at {100 * read / words:.0f}% of the read"
    RUN.summary.append(line)


def eager_us(fns: list, dev) -> tuple[float, float]:
    """(wall µs a call, host µs a call) of ``fns`` (one a set) called eagerly, EAGER_CALLS a round from an idle GPU,
    the median of EAGER_ROUNDS rounds: the wall until the GPU finished, the host's part until the last call
    returned (both over the calls)."""
    walls, hosts = [], []
    for _ in range(EAGER_ROUNDS):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for i in range(EAGER_CALLS):
            fns[i % len(fns)]()
        t1 = time.perf_counter()
        torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        walls.append((t2 - t0) / EAGER_CALLS * 1e6)
        hosts.append((t1 - t0) / EAGER_CALLS * 1e6)
    return sorted(walls)[len(walls) // 2], sorted(hosts)[len(hosts) // 2]


def calls_cell(preset: str, m: int, dev, copy_tbps: float, stop: float, results: list, aheads=(1,),
               eager: bool = False) -> None:
    """CK2: whole calls, the route's pick against the words kernels at each split of SPLITS (else ``down_split``'s)
    and each AHEAD of ``aheads``, checked against ``fused_experts_wo_torch``; beside them both gate-ups alone, and
    with ``eager`` each call's eager wall and host µs (``eager_us``)."""
    s = Shape(f"{preset}/smoke", 8, 64, 512, 2) if SMOKE else Shape.from_preset(preset)
    label = f"{preset} int4 M={m} call"
    w13, w2 = weights(s, dev, seed=m, whole=True)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    sets = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    layouts = [align_block(c.topk_ids, s.num_experts, 8) for c in sets]
    c0 = sets[0]
    twin = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    makers = {"pick": lambda c, lay: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, "int4_w4a16")}
    blocks = c0.topk_ids.numel() if layouts[0].naive else layouts[0].expert_ids.numel()
    for split in SPLITS.get((preset, m)) or (down_split(s.n, s.k, blocks),):
        for ahead in aheads:
            makers[f"words_s{split}" + ("" if ahead == 1 else f"_a{ahead}")] = (
                lambda c, lay, split=split, ahead=ahead: experts_words(
                    c.x, a13, a2, c.topk_ids, c.topk_weights, words_layout(c.topk_ids, s.num_experts), split, ahead))
    fns = {}
    for name, make in makers.items():
        if SMOKE and name != "pick":
            continue
        err = rel_l2(make(c0, layouts[0]).float(), twin.float())
        if RUN.check(f"{label} {name}", err <= TOL, f"rel-L2 {err:.2e}"):
            fns[name] = [lambda c=c, lay=lay, make=make: make(c, lay) for c, lay in zip(sets, layouts)]
    if dev.type != "cuda":
        return
    calls = dict(fns)
    for ahead in aheads:
        fns["words_gu" + ("" if ahead == 1 else f"_a{ahead}")] = [
            lambda c=c, lay=lay, ahead=ahead: gate_up_words(c.x, a13, c.topk_ids, lay, ahead=ahead)
            for c, lay in zip(sets, layouts)]
    fns["pick_gu"] = [pick_launches(c, a13, a2)[0] for c in sets]
    walls = {name: eager_us(f, dev) for name, f in calls.items()} if eager else {}
    graphs = {name: graph_of(f, dev) for name, f in fns.items()}
    rounds = settled({n: (g, None) for n, g in graphs.items()}, len(sets), dev, ROUNDS, REPLAYS, stop, order=shuffled)
    del graphs
    times = medians(rounds)
    floor = sum(floor_us(s, c.topk_ids, copy_tbps) * 1.5 for c in sets) / len(sets)  # w2: half of w13's bytes
    results.append({"cell": label, "floor_us": floor, "times": times, "rounds": rounds,
                    "eager_wall_host_us": walls})
    line = f"{label} (floor {floor:.1f} µs):" + "".join(f"  {n} {t:.1f} ({100 * floor / t:.0f}%)"
                                                        for n, t in times.items() if "_gu" not in n)
    best = min((n for n in times if n.startswith("words_s")), key=times.get, default=None)
    if best and "pick" in times:
        won = wins(rounds[best], rounds["pick"])
        line += f"; best {best} x pick {times['pick'] / times[best]:.3f}, faster {won}/{len(rounds[best])}"
    line += "; gate-ups " + ", ".join(f"{n} {t:.1f}" for n, t in times.items() if "_gu" in n)
    if walls:
        line += "; eager wall / host µs " + ", ".join(f"{n} {w:.1f} / {h:.1f}" for n, (w, h) in walls.items())
    RUN.summary.append(line)


def main(args) -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    copy_tbps = 0.0 if SMOKE else measure_copy(dev)
    RUN.log(f"copy {copy_tbps:.2f} TB/s; {run_info()}")
    results, stop_at = [], time.time() + args.deadline - RUN.elapsed()
    if args.calls:
        cell = lambda *a: calls_cell(*a, aheads=tuple(args.aheads), eager=args.eager and not SMOKE)  # noqa: E731
    else:
        cell = run_cell
    cells = [(p, m) for m in args.ms for p in WIDE_PRESETS] if args.ms else CELLS
    for preset, m in cells[:1] if SMOKE else cells:
        if RUN.elapsed() > args.deadline - 12:
            RUN.summary.append(f"{preset} int4 M={m}: not reached (deadline)")
            continue
        try:
            cell(preset, m, dev, copy_tbps, stop_at, results)
        except Exception as e:  # noqa: BLE001  (a cell that fails is reported; the others still run)
            RUN.check(f"{preset} M={m}", False, f"{type(e).__name__}: {str(e)[:400]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            write_json(os.path.join(args.out, "w4g45.json"), {**run_info(), "copy_tbps": copy_tbps, "cells": results})
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    p = check_parser(deadline=70.0)
    p.add_argument("--calls", action="store_true", help="CK2: whole calls (pick against the words kernels)")
    p.add_argument("--aheads", type=int, nargs="+", default=[1], help="--calls: the words' steps in flight timed")
    p.add_argument("--eager", action="store_true", help="--calls: each whole call's eager wall and host µs too")
    p.add_argument("--ms", type=int, nargs="+", default=[], help="token counts of DeepSeek-V3 and Mixtral (cells)")
    sys.exit(main(p.parse_args()))
