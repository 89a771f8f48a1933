"""Issue #16 target 1, session 48 (brief wd48): the words decode as the default of its measured cells
(``moekit/experts/triton_wo_words_default.py``) through the real client, against the previous pick (the default off:
``triton_wo_words_default.set_enabled(False)``).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wd48_device_check.py --out $OUT/wd48 --deadline 72 --rounds 3  # GPU
    PYTHONPATH=$PWD python3 benchmarks/wd48_device_check.py --smoke     # CPU, interpreted: the layers and the twin
    ... wd48_device_check.py --out $OUT/wd48b --deadline 72 --rounds 3 --cases deepseek-v3:2 mixtral-8x7b:2 ...

Layers: a ``moekit.MoE`` of DeepSeek-V3 (E 256, N 2048, K 7168, top-8, its shared expert; int4_w4a16, groups of 128)
and of Mixtral-8x7B (E 8, N 14336, K 4096, top-2; mxfp4), backend "triton", bf16, random init, quantized with
``quantize_`` (DeepSeek-V3: the same ``moekit.quant.quantize`` per 32 experts and ``install_quantized_experts_``, since
the whole [256, 4096, 7168] tensor's float32 temporaries do not fit beside it; quantization is per expert row group,
so the result is the same). Cells: each layer at M = 1, 8, 16, 2, 4 (the table's Ms first), DeepSeek-V3 then Mixtral
(``--cases``: some of these, as "preset:M").
Per cell, first PASS / FAIL:
  experts   ``experts_triton`` on the layer's quantized weights (fixed random routing), default on: rel-L2 <= TOL
            against ``fused_experts_wo_torch``, and the words kernels ran it (counted); default off: the same
            against the twin, and the words never ran
  layer     the layer's forward on / off: rel-L2 <= TOL between the two (the same gate and routing)
then eager wall and host µs a call (EAGER_CALLS calls, behind ~1 ms of GPU sleep for host, to completion for
wall; each variant warmed after its switch; --rounds rounds, the variants interleaved, medians) and CUDA-graph µs a
call (SETS input sets captured per variant; --rounds rounds shuffled, medians; wins: rounds on <= 0.97 x off) of the
experts call and the layer forward, on and off. Table last; JSON <out>/wd48.json. Cells past the deadline: "not
reached".
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import graph_of, medians, settled, shuffled, wins  # noqa: E402
from bench_run import RunLog, case_args, rel_l2, run_cases  # noqa: E402

import moekit.experts.triton_wo_words_default as words_default  # noqa: E402
import moekit.experts.triton_wo_words_lean as words_lean  # noqa: E402
from moekit import MoE  # noqa: E402
from moekit.bench.cells import Shape, make_sets  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402
from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_quant import _wo  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch  # noqa: E402
from moekit.experts.triton_wo_words_default import set_enabled  # noqa: E402
from moekit.quant import quantize  # noqa: E402
from moekit.quant.module import install_quantized_experts_  # noqa: E402

LAYERS = {"deepseek-v3": "int4_w4a16", "mixtral-8x7b": "mxfp4"}
MS = (1, 8, 16, 2, 4)
CASES = [f"{preset}:{m}" for m in MS for preset in LAYERS]  # "preset:M"; --cases picks some
SETS, REPLAYS, TOL = 2, 3, 1e-2
EAGER_CALLS, WARM = 16, 3
CHUNK = 32  # DeepSeek-V3's experts quantized at a time (the whole tensor's float32 temporaries would not fit)
RUN = RunLog("wd48: the words default on / off through the client; graph µs (wins/rounds), eager wall / host µs")
WORDS = [0]  # words launches (lean hits and plan calls) since the last read


def _count_words() -> None:
    """Count every words launch: ``words_lean_call`` hits and ``run_words`` calls (both looked up on their module)."""
    lean_call, run_words = words_lean.words_lean_call, words_lean.run_words

    def counted_lean(*args, **kwargs):
        out = lean_call(*args, **kwargs)
        WORDS[0] += out is not None
        return out

    def counted_run(*args, **kwargs):
        WORDS[0] += 1
        return run_words(*args, **kwargs)

    words_lean.words_lean_call, words_lean.run_words = counted_lean, counted_run


def taken() -> int:
    n, WORDS[0] = WORDS[0], 0
    return n


def build_layer(preset: str, dev) -> MoE:
    """The preset's layer (bf16, random init) with its routed experts quantized to LAYERS[preset]."""
    config = MoEConfig.preset(preset)
    if SMOKE:
        config = dataclasses.replace(config, hidden_size=512, moe_intermediate_size=256, num_experts=8, top_k=2,
                                     n_group=1, topk_group=1, shared_expert_intermediate_size=0)
    layer = MoE(config, backend="triton", fuse_shared=False, dtype=torch.bfloat16, device=dev).eval()
    scheme, experts, chunk = LAYERS[preset], config.num_experts, 4 if SMOKE else CHUNK
    if preset == "mixtral-8x7b":
        return layer.quantize_(scheme)
    with torch.no_grad():  # quantize_'s arithmetic, ``chunk`` experts at a time
        pair = []
        for name in ("w13", "w2"):
            w = getattr(layer, name).detach()
            parts = [quantize(w[e:e + chunk], scheme) for e in range(0, experts, chunk)]
            pair.append(dataclasses.replace(parts[0], **{f: torch.cat([getattr(p, f) for p in parts])
                                                          for f in parts[0].tensor_fields}))
            del w, parts
    install_quantized_experts_(layer, *pair)
    layer._weights_changed()
    return layer


def switched(on: bool, fn):
    """A call that first sets the default where it is not ``on`` (``set_enabled``: the kept entries dropped)."""

    def call():
        if words_default.ENABLED is not on:
            set_enabled(on)
        return fn()

    return call


def checks(label: str, layer: MoE, sets: list) -> dict:
    """The PASS / FAIL lines on set 0; name -> [a call per set] of the variants (experts / layer, on / off)."""
    c0, ok = sets[0], True
    twin = fused_experts_wo_torch(c0.x, _wo(layer.w13), _wo(layer.w2), c0.topk_ids, c0.topk_weights).float()
    outs = {}
    for on in (True, False):
        set_enabled(on)
        taken()
        got = [experts_triton(c0.x, layer.w13, layer.w2, c0.topk_ids, c0.topk_weights) for _ in range(3)]
        ran, err = taken(), rel_l2(got[0].float(), twin)
        same = all(torch.equal(g, got[0]) for g in got)
        # the rule itself (its device's row; the CPU has no Gluon: the default never takes it there)
        want_ran = words_default.words_default_covers(c0.x, _wo(layer.w13), layer.quant_scheme,
                                                      layer.config.activation, None)
        ok &= RUN.check(f"{label} experts {'on' if on else 'off'}", err <= TOL and same and
                              (ran > 0) == want_ran, f"rel-L2 {err:.2e}, words ran {ran} of 3, repeats equal {same}")
        outs[on] = [layer(c0.x) for _ in range(3)][-1]
    err = rel_l2(outs[True].float(), outs[False].float())
    ok &= RUN.check(f"{label} layer on/off", err <= TOL, f"rel-L2 {err:.2e}")
    if not ok:
        return {}
    fns = {}
    for on in (True, False):
        tag = "on" if on else "off"
        fns[f"experts_{tag}"] = [switched(on, lambda c=c: experts_triton(c.x, layer.w13, layer.w2, c.topk_ids,
                                                                        c.topk_weights)) for c in sets]
        fns[f"layer_{tag}"] = [switched(on, lambda c=c: layer(c.x)) for c in sets]
    return fns


def eager(fns: dict, dev, rounds: int) -> dict:
    """name -> (wall µs a call, host µs a call): per round each variant switched and warmed (WARM calls), then
    EAGER_CALLS calls behind ~1 ms of GPU sleep (host) and to completion (wall); medians of ``rounds`` rounds, the
    variants' order reversed every other round."""
    got = {name: ([], []) for name in fns}
    for r in range(rounds):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            calls = fns[name]
            for i in range(WARM):
                calls[i % len(calls)]()
            for record, busy in ((got[name][1], True), (got[name][0], False)):
                torch.cuda.synchronize(dev)
                if busy:
                    torch.cuda._sleep(2_000_000)
                t0 = time.perf_counter()
                for i in range(EAGER_CALLS):
                    calls[i % len(calls)]()
                if not busy:
                    torch.cuda.synchronize(dev)
                record.append((time.perf_counter() - t0) / EAGER_CALLS * 1e6)
    return {name: (statistics.median(w), statistics.median(h)) for name, (w, h) in got.items()}


def graphs(fns: dict, dev, rounds: int, stop: float) -> dict:
    """name -> [µs a call, each round]: each variant's calls captured under its switch, timed interleaved."""
    entries = {}
    for name, calls in fns.items():
        calls[0]()  # the switch set (and its entries dropped) outside the capture
        entries[name] = (graph_of(calls, dev), None)
    return settled(entries, len(next(iter(fns.values()))), dev, rounds, REPLAYS, stop, order=shuffled)


def run_cell(preset: str, m: int, layers: dict, dev, rounds: int, stop: float, results: list) -> None:
    if preset not in layers:  # both kept (DeepSeek-V3's codes ~6 GB, Mixtral's ~0.7): the Ms alternate presets
        layers[preset] = build_layer(preset, dev)
    layer = layers[preset]
    c = layer.config
    label = f"{preset} {LAYERS[preset]} M={m}"
    shape = Shape(preset, c.num_experts, c.moe_intermediate_size, c.hidden_size, c.top_k)
    sets = make_sets(shape, m, SETS, torch.bfloat16, dev, seed=m)
    fns = checks(label, layer, sets)
    if dev.type != "cuda" or not fns:
        return
    walls = eager(fns, dev, rounds)
    timed = graphs(fns, dev, rounds, stop)
    times = medians(timed)
    results.append({"cell": label, "graph_us": times, "rounds": timed, "eager_wall_host_us": walls})
    parts = []
    for what in ("experts", "layer"):
        on, off = f"{what}_on", f"{what}_off"
        parts.append(f"{what} graph {times[off]:.1f} / {times[on]:.1f} (x{times[off] / times[on]:.2f}, "
                     f"{wins(timed[on], timed[off])}/{len(timed[on])}), eager wall {walls[off][0]:.1f} / "
                     f"{walls[on][0]:.1f}, host {walls[off][1]:.1f} / {walls[on][1]:.1f}")
    RUN.summary.append(f"{label} off / on: " + "; ".join(parts))


def main() -> int:
    args = case_args(__doc__, 72.0, CASES)
    dev, result, layers = torch.device("cpu" if SMOKE else "cuda"), {"cells": []}, {}
    _count_words()
    stop_at = time.time() + args.deadline - RUN.elapsed()
    if SMOKE:
        args.cases = args.cases[:2]

    def one(case: str) -> None:
        preset, m = case.split(":")
        with torch.no_grad():
            run_cell(preset, int(m), layers, dev, args.rounds, stop_at, result["cells"])

    run_cases(RUN, result, args, "wd48", one)
    set_enabled(True)
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
