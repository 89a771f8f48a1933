"""One launch for a whole tiny-batch experts call (``moekit.experts.triton_decode_one``) on the GPU: correctness
at real shapes, then CUDA-graph and eager µs against the current default ``triton`` path, as % of the byte floor.

    PYTHONPATH=$PWD OUT=/tmp/d1 timeout 170 python benchmarks/decode_one_device_check.py [--budget-s 120]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/decode_one_device_check.py --smoke --batches 1 \
        --presets qwen3-30b-a3b   (CPU, tiny shapes: checks the script, ~3 min; --no-fp8: ~1 min)

Cells (bf16, no_grad, uniform routing, 4 input sets rotated per timing pass so consecutive calls touch other
experts; L2 NOT flushed): Qwen3-30B-A3B M = 1, 2; DeepSeek-V3 M = 1, 2; Mixtral-8x7B M = 1, 2, 4, 8 (M*k <= 16).
Per cell:
- correctness on set 0: every variant against ``run_experts(backend="reference")`` in float32 (run on the
  touched experts only, ids remapped: DeepSeek-V3's 22.5 GB of bf16 weights would not fit twice in float32)
  and against the default ``triton`` output (rel L2 errors); ``stable``: 5 calls bit-equal; ``zero``: the
  counter arena all 0 afterwards; once per cell a graph check (the call captured, inputs of set 1 copied in,
  replayed: equal to eager on set 1 bit for bit);
- graph µs (``time_stats(graph=True)``: 16 calls, the 4 sets' 4 times, captured once, replayed; median of the passes) of
  ``default`` (today's fused path: gate-up, down with the k-sum folded or not) and of each variant below;
- eager µs (``time_eager``: 16 back-to-back calls, one sync) of ``default``, of ``on`` (the wiring:
  ``experts_triton(options=LaunchOptions(decode_one=True))``, the heuristic tiles) and of each variant
  (``run_decode_one`` with its config);
- floor: touched experts x 3·N·K·2 B + x and out, over the copy bandwidth measured in this run
  (``moekit.bench.ceilings.measure_ceilings``, read + write).
After each preset's bf16 cells, fp8_block cells (FP8_CELLS; the bf16 weights quantized 128 x 128): the default
fp8 path (activation quant, gate-up, down) against ``run_decode_one_fp8`` (``fp8_variants``), errors against the
fp8 torch twin (``err_twin``) and the float32 reference of the bf16 weights, floor in fp8 bytes + scales.
Variants (``DecodeOneConfig``; gate-up GEMV per slot unless "dot"): ``variants`` below. What to look for: the
``best`` column against ``default`` at Qwen3 M = 1 (target: the 18.1 µs floor, >= 90%; today ~25 µs); errors
like the default's (rel L2 ~3e-3 against float32). JSON to $OUT/decode_one.json; the short table is printed last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from host_align_device_check import budgeted_cell, run_with_hard_limit  # benchmarks/ is on sys.path
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import run_experts
from moekit.experts.triton import experts_triton
from moekit.experts.triton_decode_one import (
    _ARENA_USED, _ARENAS, ARENA_INTS, DecodeOneConfig, default_config, run_decode_one,
)
from moekit.experts.triton_decode_one_fp8 import decode_one_fp8_refusal, default_fp8_config, run_decode_one_fp8
from moekit.experts.triton_launch import LaunchOptions, cdiv, next_pow2

CELLS = (("qwen3-30b-a3b", (1, 2)), ("deepseek-v3", (1, 2)), ("mixtral-8x7b", (1, 2, 4, 8)))
FP8_CELLS = {"qwen3-30b-a3b": (1, 2), "deepseek-v3": (1,), "mixtral-8x7b": (1,)}  # after each preset's bf16 cells
SETS = 4
ON = LaunchOptions(decode_one=True)
SMOKE_SCALE = 64


class Run:
    device = torch.device("cuda")
    scale = 1
    smoke = False
    copy_TBps = float("nan")


def variants(n: int, k: int) -> dict[str, DecodeOneConfig]:
    """name -> tiles; the down step width capped at N's next power of two."""
    base = default_config(n, k)
    red = lambda w: min(w, next_pow2(n))  # noqa: E731
    up = dict(block_k_up=base.block_k_up)
    t4 = dict(block_k_out=8, block_n_red=red(1024), down_tiles=4)  # the down form the gate-up variants run with
    table = {
        "t4_o8": base,  # the heuristic (what ``on`` runs)
        "g16": DecodeOneConfig(**up, block_n_red=red(1024)),  # one [16, N] w2 load per program (214 registers)
        "g16_o8": DecodeOneConfig(**up, block_k_out=8, block_n_red=red(1024)),
        "g16_r256": DecodeOneConfig(**up, block_n_red=red(256)),
        "t4_r256": DecodeOneConfig(**up, block_n_red=red(256), down_tiles=4),
        "t8_r256_o32": DecodeOneConfig(**up, block_k_out=32, block_n_red=red(256), down_tiles=8),
        "t4_w8": DecodeOneConfig(**up, block_n_red=red(1024), down_tiles=4, num_warps=8),
        "g8_k1024": DecodeOneConfig(block_n_up=8, block_k_up=min(1024, next_pow2(k)), **t4),
        "g4_k2048": DecodeOneConfig(block_n_up=4, block_k_up=min(2048, next_pow2(k)), **t4),
        "pid": DecodeOneConfig(**up, **t4, ticket=False),
        "dot": DecodeOneConfig(gemv=False, block_n_up=32, block_k_up=128, num_stages=4, **t4),
    }
    if Run.smoke:  # the interpreter: two variants, small tiles
        return {"t4_o8": DecodeOneConfig(block_k_up=32, block_k_out=8, block_n_red=16, down_tiles=4),
                "dot": DecodeOneConfig(gemv=False, block_n_up=16, block_k_up=16, block_n_red=16)}
    return table


def fp8_variants(n: int, k: int) -> dict[str, DecodeOneConfig]:
    """name -> tiles of the fp8_block kernel (GEMV; rows <= 128 per tile, steps whole 128-column groups)."""
    base = default_fp8_config(n, k)
    if Run.smoke:
        return {"f16": DecodeOneConfig(block_k_up=128, block_n_red=128)}
    red = base.block_n_red
    return {
        "f16": base,
        "f16_t4": DecodeOneConfig(block_k_up=base.block_k_up, block_n_red=red, down_tiles=4),
        "f16_k1024": DecodeOneConfig(block_k_up=min(1024, next_pow2(k)), block_n_red=red),
        "f8_k2048_t4": DecodeOneConfig(block_n_up=8, block_k_up=min(2048, next_pow2(k)), block_n_red=red, down_tiles=4),
        "f16_o32": DecodeOneConfig(block_k_up=base.block_k_up, block_k_out=32, block_n_red=min(512, red)),
        "f16_w8": DecodeOneConfig(block_k_up=base.block_k_up, block_n_red=red, num_warps=8),
        "f16_t4_w8_o32": DecodeOneConfig(block_k_up=base.block_k_up, block_k_out=32, block_n_red=red, down_tiles=4,
                                         num_warps=8),
    }


def fp8_cell(shape: Shape, w, q, m: int) -> dict:
    """fp8_block weights (``q``: the bf16 weights quantized 128 x 128): the default fp8 path against the one launch."""
    from moekit.experts.triton_fp8 import fused_experts_fp8_torch

    sets = make_sets(shape, m, SETS, torch.bfloat16, Run.device, seed=m)
    args = [(s.x, q[0], q[1], s.topk_ids.contiguous(), s.topk_weights.contiguous()) for s in sets]
    touched = sum(len(torch.unique(a[3])) for a in args) / len(args)
    scale_bytes = 4 * (q[0].scale[0].numel() + q[1].scale[0].numel())
    floor_bytes = touched * (3 * shape.n * shape.k + scale_bytes) + 2 * m * shape.k * 2
    result = {"slots": m * shape.top_k, "touched": touched, "floor_MB": floor_bytes / 1e6,
              "floor_us": floor_bytes / (Run.copy_TBps * 1e12) * 1e6}
    x, w13, w2, ids, weights = args[0]
    twin = fused_experts_fp8_torch(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights)
    ref = reference32(x, w.w13, w.w2, ids, weights)
    default = experts_triton(*args[0])
    result["default"] = {"err_ref": rel_l2(default, ref), "err_twin": rel_l2(default, twin)}
    result["default"].update(timings([lambda a=a: experts_triton(*a) for a in args]))
    on = experts_triton(*args[0], options=ON)
    result["on"] = {"err_ref": rel_l2(on, ref), "err_twin": rel_l2(on, twin), "err_default": rel_l2(on, default)}
    result["on"].update({k: v for k, v in timings([lambda a=a: experts_triton(*a, options=ON) for a in args]).items()
                         if k != "graph_us"})
    for name, config in fp8_variants(shape.n, shape.k).items():
        refusal = decode_one_fp8_refusal(x, w13, w2, ids, config=config)
        if refusal:
            result[name] = {"error": f"refused: {refusal}"}
            continue
        try:
            outs = [run_decode_one_fp8(*args[0], config=config) for _ in range(5)]
            row = {"err_ref": rel_l2(outs[0], ref), "err_twin": rel_l2(outs[0], twin),
                   "err_default": rel_l2(outs[0], default), "stable": all(torch.equal(o, outs[0]) for o in outs),
                   "zero": _arena_zero()}
            row.update(timings([lambda a=a: run_decode_one_fp8(*a, config=config) for a in args]))
            row["zero_after"] = _arena_zero()
            result[name] = row
        except Exception as exc:  # noqa: BLE001
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return result


def reference32(x, w13, w2, ids, weights) -> torch.Tensor:
    """``run_experts(backend="reference")`` in float32 on the touched experts only (ids remapped)."""
    touched = torch.unique(ids.long())  # sorted
    local = torch.searchsorted(touched, ids.long()).to(ids.dtype)
    return run_experts(x.float(), w13[touched].float(), w2[touched].float(), local, weights.float(), backend="reference")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _arena_zero() -> bool:
    return all(bool((arena == 0).all()) for arena in _ARENAS.values())


def graph_check(args0: tuple, args1: tuple, config: DecodeOneConfig) -> bool | None:
    """The call captured on set 0's inputs (static buffers), set 1's copied in, replayed: equal to eager on set 1."""
    if Run.device.type != "cuda":
        return None
    static = [a.clone() for a in args0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_decode_one(*static, config=config)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_decode_one(*static, config=config)
    for dst, src in zip(static, args1):
        dst.copy_(src)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    return torch.equal(out, run_decode_one(*args1, config=config)) and _arena_zero()


def timings(fns: list) -> dict:
    """graph µs (median of the passes) and eager µs / host µs per call."""
    if Run.smoke:
        graph = time_stats(fns, Run.device, min_reps=1, max_reps=1, budget_s=0.0)
        eager = time_eager(fns, Run.device, calls=len(fns), repeats=1)
    else:
        graph = time_stats(fns * 4, Run.device, graph=True, budget_s=0.25)  # 16 calls a replay
        eager = time_eager(fns, Run.device)
    return {"graph_us": graph.us, "graph_spread_pct": graph.spread_pct, "eager_us": eager.eager_us,
            "host_us": eager.host_rest_us}


def cell(shape: Shape, w, m: int) -> dict:
    sets = make_sets(shape, m, SETS, torch.bfloat16, Run.device, seed=m)
    args = [(s.x, w.w13, w.w2, s.topk_ids.contiguous(), s.topk_weights.contiguous()) for s in sets]
    touched = sum(len(torch.unique(a[3])) for a in args) / len(args)
    floor_bytes = touched * 3 * shape.n * shape.k * 2 + 2 * m * shape.k * 2
    result = {"slots": m * shape.top_k, "touched": touched, "floor_MB": floor_bytes / 1e6,
              "floor_us": floor_bytes / (Run.copy_TBps * 1e12) * 1e6}
    ref = reference32(*args[0])
    default = experts_triton(*args[0])
    result["default"] = {"err_ref": rel_l2(default, ref)}
    result["default"].update(timings([lambda a=a: experts_triton(*a) for a in args]))
    on = experts_triton(*args[0], options=ON)
    result["on"] = {"err_ref": rel_l2(on, ref), "err_default": rel_l2(on, default)}
    result["on"].update({k: v for k, v in timings([lambda a=a: experts_triton(*a, options=ON) for a in args]).items()
                         if k != "graph_us"})
    for name, config in variants(shape.n, shape.k).items():
        try:
            result[name] = variant_row(args, config, ref, default, graph=name == "t4_o8")
        except Exception as exc:  # noqa: BLE001  one failing variant must not lose the others
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    result["default"]["graph_us_after"] = timings([lambda a=a: experts_triton(*a) for a in args])["graph_us"]  # drift
    return result


def variant_row(args: list, config: DecodeOneConfig, ref, default, graph: bool) -> dict:
    outs = [run_decode_one(*args[0], config=config) for _ in range(5)]
    x = args[0][0]
    row = {"err_ref": rel_l2(outs[0], ref), "err_default": rel_l2(outs[0], default),
           "stable": all(torch.equal(o, outs[0]) for o in outs), "zero": _arena_zero(),
           "programs": args[0][3].numel() * (cdiv(args[0][2].shape[2], config.block_n_up)
                                             + cdiv(x.shape[1], config.block_k_out))}
    if graph:
        row["graph_eq"] = graph_check(args[0], args[1], config)
    row.update(timings([lambda a=a: run_decode_one(*a, config=config) for a in args]))
    row["zero_after"] = _arena_zero()
    return row


def measure(a, start: float, results: dict) -> None:
    if Run.device.type == "cuda":
        from moekit.bench.ceilings import measure_ceilings

        Run.copy_TBps = measure_ceilings(Run.device).copy_TBps
    results["copy_TBps"] = Run.copy_TBps
    with torch.no_grad():
        for preset, batches in CELLS:
            if preset not in a.presets:
                continue
            shape = Shape.from_preset(preset, Run.scale)
            w = make_weights(shape, torch.bfloat16, Run.device)
            for m in batches:
                if m in a.batches and m * shape.top_k <= 16:
                    budgeted_cell(results, f"{preset} M={m}", start, a.budget_s, lambda: cell(shape, w, m))
            fp8_batches = [m for m in FP8_CELLS.get(preset, ()) if m in a.batches]
            if fp8_batches and not a.no_fp8 and time.perf_counter() - start < a.budget_s:
                if Run.smoke:  # whole 128 x 128 scale blocks: the scaled presets have none
                    shape = Shape(f"{preset}/smoke", min(shape.num_experts, 16), 128, 256, shape.top_k)
                    w = make_weights(shape, torch.bfloat16, Run.device)
                q = quantized(w)
                for m in fp8_batches:
                    budgeted_cell(results, f"fp8 {preset} M={m}", start, a.budget_s, lambda: fp8_cell(shape, w, q, m))
                del q
            del w
            if Run.device.type == "cuda":
                torch.cuda.empty_cache()
    results["arena"] = {"ints_used": {str(d): n for d, n in _ARENA_USED.items()}, "of": ARENA_INTS}


def quantized(w) -> tuple:
    """(w13, w2) as ``Fp8BlockWeight`` (128 x 128 blocks), a few experts at a time (``fp8_device_check``'s)."""
    from fp8_device_check import quantize_blocks

    from moekit.quant.fp8_block import Fp8BlockWeight

    if Run.smoke:
        from moekit.quant.fp8_block import quantize_fp8_block

        return quantize_fp8_block(w.w13), quantize_fp8_block(w.w2)
    return tuple(Fp8BlockWeight(q=qs[0], scale=qs[1]) for qs in (quantize_blocks(w.w13), quantize_blocks(w.w2)))


def _bad(row: dict) -> list:
    """Variants of a row that errored, were unstable, left counters set, failed the graph check or erred > 2x default."""
    limit = 2 * row["default"]["err_ref"] + 2e-3
    return [n for n, r in row.items() if isinstance(r, dict) and n != "default"
            and ("error" in r or r.get("stable") is False or r.get("zero_after") is False or r.get("graph_eq") is False
                 or r.get("err_ref", 0) > limit)]


def table(results: dict) -> str:
    lines = [f"copy {results.get('copy_TBps', float('nan')):.2f} TB/s; graph µs (% of byte floor), L2 not flushed, "
             "4 rotated input sets; err = rel L2 against the float32 reference (bf16 weights)",
             f"{'cell':<26}{'floor':>7}{'default (/ again at the end)':>16}{'best variant':>26}   others (graph µs)"]
    eager_lines = []
    for key, row in results.items():
        if not isinstance(row, dict) or "floor_us" not in row:
            if isinstance(row, dict):
                lines.append(f"{key:<26}{row}")
            continue
        floor, d = row["floor_us"], row["default"]
        timed = {n: r["graph_us"] for n, r in row.items() if isinstance(r, dict) and n not in ("default", "on")
                 and r.get("graph_us") is not None}
        best = min(timed, key=timed.get) if timed else None
        pct = lambda us: f"{us:>8.1f} ({100 * floor / us:>3.0f}%)"  # noqa: E731
        lines.append(f"{key:<26}{floor:>7.1f}{pct(d['graph_us']):>16}"
                     + (f" / {d['graph_us_after']:.1f}" if "graph_us_after" in d else "")
                     + (f"{best:>12} {pct(timed[best])}" if best else f"{'-':>26}") + "   "
                     + " ".join(f"{n}:{us:.1f}" for n, us in timed.items() if n != best))
        bad = _bad(row)
        eager_lines.append(f"{key:<26} eager µs default {d.get('eager_us', 0):.1f}, on {row['on'].get('eager_us', 0):.1f}"
                           f" (host {row['on'].get('host_us', 0):.1f}), best {row.get(best, {}).get('eager_us', 0):.1f};"
                           f" err default {d['err_ref']:.1e}, on {row['on']['err_ref']:.1e}"
                           + (f"  BAD: {bad}" if bad else "  all ok"))
    return "\n".join(lines + eager_lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=145, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=[c[0] for c in CELLS])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--no-fp8", action="store_true", help="skip the fp8_block cells")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale, Run.smoke = torch.device("cpu"), SMOKE_SCALE, True
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(os.environ.get("OUT", "decode_one_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    run_with_hard_limit(a, start, out_dir / "decode_one.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
