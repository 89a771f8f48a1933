"""Issue #16, session 39 (brief gpt39): gpt-oss as it ships (expert biases, interleaved gate/up rows, its clamped
SwiGLU) on the weight-only Triton kernels' tile and register decodes, where main sent it to grouped_mm's dequantizing
path (the lead's H100 real client, main 22a0d8b: moekit_blocks_quant decode 7.6 tok/s against moekit_blocks' 175.8).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gpt39_device_check.py --out $OUT/gpt39 --deadline 75   # H100/H200
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gpt39_device_check.py --schemes int8_w8a16,int4_w4a16 --ms 1,64 ...
    PYTHONPATH=$PWD python3 benchmarks/gpt39_device_check.py --smoke     # CPU: interpreter, tiny shapes

Shape: gpt-oss-20b's experts from its preset (E = 32, K = hidden 2880, N = intermediate 2880, top-4; the smoke:
E 8, K 128, N 64, top-2), random bf16 weights quantized per scheme (mxfp4 first, then int8_w8a16, int4_w4a16 g128),
b13 [E, 2N] and b2 [E, K] bf16, gpt-oss's spec (silu, interleaved, alpha 1.702, limit 7, up_shift 1), M = 1, 8,
64, 512 (the smoke: 1, 5; ``--ms``). Per scheme (a cell; none starts past the deadline; <out>/gpt39.json after each):
  correct  per M against the torch twin ``fused_experts_wo_torch`` (the dequantized weights, float32; rel-L2 < TOL):
           the tile and the register decode by name (``run_experts_wo``), the route (``run_experts`` on the triton
           backend: ``run_quantized_triton``, and no "dequantizing path" warning), main's route (``experts_grouped_mm``
           on the quantized weights) and the bf16 Triton path on the dequantized weights.
  timing   CUDA graphs of the route ("new"), main's route ("old") and the bf16 Triton path, per M, ROUNDS
           ``bench_rounds.settled`` rounds (each graph after one replay of itself), median µs.
  --ab     also the route's decode ("pick") without biases on the plain silu ("plain": main's kernels, SASS-identical)
           and with biases and the spec but gate/up rows not interleaved ("unleaved"), each against its twin, timed
           with the rest: what the variant costs its decode, and what reading the rows interleaved in place costs.
The table last: per (scheme, M) new / old / bf16 µs, old / new and the rounds new was >= 3% faster, new / bf16
(--ab: plain and unleaved µs, new / plain, new / unleaved).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import faster_rounds, graph_of, settled  # noqa: E402
from bench_run import RunLog, rel_l2, run_info, write_json  # noqa: E402

from moekit.activations import ActivationSpec  # noqa: E402
from moekit.presets import hf_config_of_preset  # noqa: E402

SCHEMES = ("mxfp4", "int8_w8a16", "int4_w4a16")
MS = (1, 5) if SMOKE else (1, 8, 64, 512)
ROUNDS, REPLAYS, TOL = (1, 1, 1e-2) if SMOKE else (5, 5, 1e-2)
SPEC = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)  # gpt-oss's experts
UNLEAVED = ActivationSpec("silu", alpha=1.702, limit=7.0, up_shift=1.0)  # the same, gate rows then up rows
RUN = RunLog("gpt39: gpt-oss experts (biases + clamped SwiGLU), graph µs, median of settled rounds", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}


def shape() -> tuple[int, int, int, int]:
    """(E, K, N, top_k): gpt-oss-20b's from its preset (the bench's ``--hf-model gpt-oss-20b``), tiny in the smoke."""
    if SMOKE:
        return 8, 128, 64, 2
    cfg = hf_config_of_preset("gpt-oss-20b")
    return cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_experts_per_tok"]


def layer(scheme: str, dev) -> dict:
    """The quantized w13 / w2, their dequantized bf16 copies, b13 / b2 (random, seeded)."""
    import moekit.quant as Q

    e, k, n, _ = shape()
    g = torch.Generator(device=dev).manual_seed(39)
    w13 = (torch.randn(e, 2 * n, k, generator=g, device=dev) * k**-0.5).bfloat16()  # [E, 2N, K], rows interleaved
    w2 = (torch.randn(e, k, n, generator=g, device=dev) * n**-0.5).bfloat16()  # [E, K, N]
    options = {"group_size": 128} if scheme == "int4_w4a16" else {}
    q13, q2 = Q.quantize(w13, scheme, **options), Q.quantize(w2, scheme, **options)
    del w13, w2
    return {"q13": q13, "q2": q2, "d13": q13.dequantize(torch.bfloat16), "d2": q2.dequantize(torch.bfloat16),
            "b13": (torch.randn(e, 2 * n, generator=g, device=dev) * 0.5).bfloat16(),
            "b2": (torch.randn(e, k, generator=g, device=dev) * 0.1).bfloat16()}


def inputs(m: int, dev) -> tuple:
    e, k, _, top_k = shape()
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=dev).bfloat16()  # [M, K]
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[:top_k] for _ in range(m)]).int()  # [M, k]
    weights = torch.softmax(torch.randn(m, top_k, generator=g, device=dev), dim=1)  # [M, k]
    return x, ids, weights


def calls(w: dict, x, ids, weights, ab: bool) -> dict:
    """name -> (the call, the twin's activation and biases or None for SPEC's): the two variant decodes by name, the
    route, main's route, the bf16 path; with ``ab`` the route's decode plain and with UNLEAVED."""
    from moekit.experts import run_experts
    from moekit.experts.grouped_mm import experts_grouped_mm
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import run_experts_wo, weight_args
    from moekit.experts.triton_wo_plan import _usable_decode
    from moekit.layouts.block_aligned import use_naive

    a13, a2 = (weight_args(v.q, v.scale, v.zero, v.group_size) for v in (_wo(w["q13"]), _wo(w["q2"])))
    biases, scheme = dict(b13=w["b13"], b2=w["b2"]), w["q13"].scheme

    def decode(name: str, spec=SPEC, **bias):
        return lambda: run_experts_wo(x, a13, a2, ids, weights, None, scheme, spec, decode=name, **bias)

    out = {"tile": decode("tile", **biases), "register": decode("register", **biases),
            "new": lambda: run_experts(x, w["q13"], w["q2"], ids, weights, activation=SPEC, backend="triton", **biases),
            "old": lambda: experts_grouped_mm(x, w["q13"], w["q2"], ids, weights, activation=SPEC, **biases),
            "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=SPEC, backend="triton",
                                        **biases)}
    out = {name: (fn, None) for name, fn in out.items()}
    if ab:  # the route's decode (``triton_wo_plan._usable_decode`` of a variant call)
        e, k, n, top_k = shape()
        pick = _usable_decode(None, a13, a2, scheme, x.shape[0], e, n, k, top_k, use_naive(ids.numel(), e, None), True)
        out["plain"] = (decode(pick, "silu"), ("silu", None, None))
        out["unleaved"] = (decode(pick, UNLEAVED, **biases), (UNLEAVED, w["b13"], w["b2"]))
    return out


def twin(w: dict, x, ids, weights, variant=None) -> torch.Tensor:
    """``fused_experts_wo_torch`` with SPEC and the biases, or ``variant``'s (activation, b13, b2)."""
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import fused_experts_wo_torch

    activation, b13, b2 = variant or (SPEC, w["b13"], w["b2"])
    return fused_experts_wo_torch(x, _wo(w["q13"]), _wo(w["q2"]), ids, weights, activation=activation, b13=b13, b2=b2)


class EagerCall:
    """What ``bench_rounds.settled`` replays for a call that a CUDA graph cannot capture: the call itself, each replay
    (its host time included; the first run on the H100 found main's mxfp4 dequantizing path, ``Mxfp4Weight.dequantize``
    -> ``e2m1_decode``'s ``torch.tensor(E2M1_VALUES, device=...)``, a pageable copy that capture refuses)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def captured(name: str, fn, dev):
    """``fn`` in a CUDA graph, or an ``EagerCall`` where capture fails (logged; the table marks it "eager")."""
    try:
        return graph_of([fn], dev)
    except RuntimeError as exc:
        RUN.log(f"{name}: not capturable, timed eagerly ({str(exc)[:120]})")
        torch.cuda.synchronize()
        return EagerCall(fn)


def graph_rounds(timed: dict, dev, deadline: float, rounds: int, replays: int) -> tuple[dict, list]:
    """(name -> µs a call each round, the names timed eagerly): ``timed``'s calls (name -> fn) captured (``captured``)
    and timed in ``bench_rounds.settled`` rounds, none begun past ``deadline`` (s into the run), without autograd."""
    with torch.no_grad():
        graphs = {name: captured(name, fn, dev) for name, fn in timed.items()}
        us = settled({name: (g, None) for name, g in graphs.items()}, 1, dev, rounds, replays,
                     until=time.time() + max(1.0, deadline - RUN.elapsed()))
    return us, [name for name, g in graphs.items() if isinstance(g, EagerCall)]


def medians(label: str, us: dict, eager: list) -> tuple[dict, dict]:
    """(name -> median µs, name -> " (eager)" where timed eagerly, else ""): ``graph_rounds``' result, logged."""
    med = {name: statistics.median(v) for name, v in us.items()}
    RUN.log(f"{label}: " + ", ".join(f"{n} {v:.1f} µs" for n, v in med.items()))
    return med, {n: " (eager)" if n in eager else "" for n in med}


def reached(scheme: str, ms: tuple, deadline: float, blanks: int):
    """The Ms of ``ms`` that start before ``deadline`` (s into the run), in turn; each other one logged SKIP and its
    table row "not reached" (then ``blanks`` empty cells)."""
    for m in ms:
        if RUN.elapsed() > deadline:
            RUN.log(f"SKIP {scheme} M={m}: deadline")
            RUN.summary.append(f"| {scheme} | {m} | not reached |" + " |" * blanks)
            continue
        yield m


def cells(scheme: str, ms: tuple, dev, deadline: float, blanks: int):
    """(the scheme's ``layer``, M, its ``inputs``) for each M ``reached`` (``scr39`` / ``wom40``'s cells)."""
    w = layer(scheme, dev)
    RUN.log(f"{scheme}: weights quantized")
    for m in reached(scheme, ms, deadline, blanks):
        yield w, m, inputs(m, dev)


def checked(label: str, fns: dict, want, tol: float, fused: str) -> tuple[dict, bool]:
    """(name -> rel-L2 of each call of ``fns`` against ``want``, whether all are below ``tol``), a PASS / FAIL line
    each (the "fused" call named with its decode ``fused``)."""
    with torch.no_grad():
        errs = {name: rel_l2(fn(), want) for name, fn in fns.items()}
    return errs, all([RUN.check(f"{label} {name}{f' ({fused})' if name == 'fused' else ''}", err < tol,
                                f"rel_l2={err:.2e}") for name, err in errs.items()])  # every line printed


def run_scheme(scheme: str, ms: tuple, dev, deadline: float, ab: bool) -> None:
    from moekit.experts.triton_quant import _warn_once

    w = layer(scheme, dev)
    RUN.log(f"{scheme}: weights quantized")
    res = RESULT["run"][scheme] = {}
    for m in reached(scheme, ms, deadline, 4):
        x, ids, weights = inputs(m, dev)
        fns = calls(w, x, ids, weights, ab)
        errs = {}
        _warn_once.cache_clear()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, (fn, variant) in fns.items():
                errs[name] = rel_l2(fn(), twin(w, x, ids, weights, variant))
                RUN.check(f"{scheme} M={m} {name}", errs[name] < TOL, f"rel_l2={errs[name]:.2e}")
        fell_back = [str(c.message) for c in caught if "dequantizing path" in str(c.message)]
        RUN.check(f"{scheme} M={m} the route stays on the fused kernels", not fell_back, "; ".join(fell_back))
        RUN.log(f"{scheme} M={m}: checked")
        timed = {name: fns[name][0] for name in ("new", "old", "bf16", "plain", "unleaved") if name in fns}
        us, eager_timed = graph_rounds(timed, dev, deadline, ROUNDS, REPLAYS)
        res[m] = {"rel_l2": errs, "us": us, "eager_timed": eager_timed}
        med, eager = medians(f"{scheme} M={m}", us, eager_timed)
        ab_cells = "".join(f" {med[n]:.1f} (x{med['new'] / med[n]:.2f}) |" for n in ("plain", "unleaved") if n in med)
        RUN.summary.append(f"| {scheme} | {m} | {med['new']:.1f}{eager['new']} | {med['old']:.1f}{eager['old']} | "
                           f"{med['bf16']:.1f}{eager['bf16']} | "
                           f"x{med['old'] / med['new']:.2f} ({faster_rounds(us['new'], us['old'])}/{len(us['new'])})"
                           f" | {med['new'] / med['bf16']:.2f} |" + ab_cells)


def parser(description: str, deadline: float, schemes: tuple, ms: tuple) -> argparse.ArgumentParser:
    """--out, --deadline (s), --smoke, --schemes and --ms (comma-separated) with these defaults."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=deadline)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--schemes", type=lambda v: tuple(x for x in v.split(",") if x), default=schemes)
    p.add_argument("--ms", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=ms)
    return p


def begin(result: dict, ms: tuple, header: str) -> None:
    """A run's start (this one's or a check's that shares gpt39's shape, ``RUN`` set to its own): the watchdog, the
    run's info (in ``result`` and logged), the table's ``header`` row and its rule."""
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    result["info"] = {**run_info(), "shape": shape(), "spec": str(SPEC), "ms": ms}
    RUN.log(f"{result['info']}")
    RUN.summary.append(header)
    RUN.summary.append("| --- " * (header.count("|") - 1) + "|")


def run_checks(args, dev, head: str, name: str, result: dict, run_one) -> None:
    """The gpt-oss checks' run (this one's; wom40's ran it too): ``begin`` with the
    table's ``head`` row, ``run_one(scheme)`` for each of ``args.schemes`` as a cell that starts before the deadline,
    <out>/<name>.json after each, the GPU's cache emptied between schemes (a scheme's weights: 2 GB at gpt-oss's
    width), then the table."""
    begin(result, args.ms, head)
    path = os.path.join(args.out, f"{name}.json") if args.out else ""
    for scheme in args.schemes:
        RUN.each_cell([scheme], run_one, args.deadline)
        if path:
            write_json(path, result)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    RUN.print_table()


def main() -> int:
    p = parser(__doc__.split("\n")[0], 75.0, SCHEMES, MS)
    p.add_argument("--ab", action="store_true", help="also the route's decode plain and not interleaved (docstring)")
    args = p.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    ab_head = " plain µs (new / plain) | unleaved µs (new / unleaved) |" if args.ab else ""
    run_checks(args, dev, "| scheme | M | new (route) µs | old (grouped_mm) µs | bf16 µs | old / new (rounds >= 3%) "
               "| new / bf16 |" + ab_head, "gpt39", RESULT,
               lambda s: run_scheme(s, args.ms, dev, args.deadline, args.ab))
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
