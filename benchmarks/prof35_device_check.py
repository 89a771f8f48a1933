"""Where transformers' compiled decode through moekit spends its GPU time (session 35): the ``moekit bench --hf``
Qwen3 model (8 Qwen3-MoE layers at Qwen3-30B-A3B widths, random weights, bf16, batch 1) decoding with ``generate``
compiled as the bench compiles it (transformers' ``CompileConfig``, inductor, mode "reduce-overhead": CUDA graphs),
each step's GPU kernels under ``torch.profiler`` (``prof35_trace``: steps marked by a logits processor).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/prof35_device_check.py --out $OUT/prof35 --deadline 66   # H200
    PYTHONPATH=$PWD timeout 80 python3 benchmarks/prof35_device_check.py --out $OUT/prof35d --deadline 66 \
        --modes default --impls moekit,no_experts                        # no CUDA graphs (inductor's calls each step)
    PYTHONPATH=$PWD python3 benchmarks/prof35_device_check.py --smoke     # CPU: 1 tiny layer, Triton interpreted

Per mode (--modes) and implementation (--impls; an implementation is not started past --deadline - 15 s, about one
compile): a compiled warm-up generate (its step logits kept), a 17-token generate's median step wall (unprofiled,
``StepClock``), then a 7-token generate profiled: steps 2..6 (5 decode steps). Per step: the wall (profiled marks),
the kernels' busy time (interval union), the gap (wall - busy), kernels by name (count and µs a step) and by part;
the tables each implementation minus no_experts by kernel name, µs a step and a layer, and no_experts minus
``no_router``: the ceiling as it was before this session (routing weights times the int 0, which inductor's constant
folder turns into zeros, dropping the whole router from the graph: the router's cost in the step).
Correctness: each compiled implementation's step logits (moekit, moekit_blocks, grouped_mm) vs grouped_mm's in eager
generate (no compile; rel-L2 < 2e-2 over the steps whose tokens agree).
JSON: <out>/prof35.json after each implementation. The table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prof35_trace as trace  # noqa: E402
from bench_run import RunLog, run_generate, run_info, write_json  # noqa: E402

# the diffs' implementations first: the rest may miss the deadline (~13 s of compile each)
IMPLS = ("moekit", "no_experts", "no_router", "grouped_mm", "moekit_blocks")
BASE, NO_ROUTER, CHECKED = "no_experts", "no_router", ("moekit", "moekit_blocks", "grouped_mm")
LAYERS, WALL_TOKENS, PROF_TOKENS, FIRST_STEP, TOL = (1, 5, 5, 2, 2e-2) if SMOKE else (8, 17, 7, 2, 2e-2)
COMPILE_S = 15.0  # about one implementation's compile and capture on the H100 (the 8678ccc log: 11-19 s)
RUN = RunLog("prof35: transformers' compiled decode through moekit, GPU time a step (µs; medians of the steps)",
             stall_s=45.0)
RESULT: dict = {"run": {}, "failed": RUN.failed, "modes": {}}
ARGS = argparse.Namespace()


def dump() -> None:
    if ARGS.out:
        write_json(os.path.join(ARGS.out, "prof35.json"), RESULT)


def build():
    """(model, prompt [1, 16], device): the bench's Qwen3 (1 tiny layer, the triton backend interpreted, in the
    smoke); every experts plan built."""
    import moekit.experts as experts
    import moekit.hf as mh
    from moekit.bench.hf_models import build_model, hf_config, register_no_experts

    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:  # the CUDA default's backend, interpreted
        mh.HF_BACKEND = "triton"
        experts._RESOLVED.clear()
    else:  # the profiler started once before any CUDA graph is made: graphs made before it go unseen (pytorch#100441)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            pass
    config = hf_config("qwen3", LAYERS, tiny=SMOKE)
    model = build_model(config, torch.bfloat16, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=g).to(dev)
    register_no_experts()
    register_no_router()
    mh.prepare(model)
    return model, prompt, dev


def _no_router_forward(self, hidden_states, top_k_index, top_k_weights):
    """The no_experts ceiling before session 35: times the int 0, folded to zeros by inductor with the router."""
    return (top_k_weights.sum(-1, keepdim=True) * 0).to(hidden_states.dtype).expand(hidden_states.shape)


def register_no_router() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NO_ROUTER, _no_router_forward)


def _smoke_backend(gm, example_inputs, **kwargs):
    """The smoke's torch.compile backend: the traced graph run as it is (no inductor on this CPU)."""
    return gm.forward


def compile_config(dev: torch.device, mode: str):
    """transformers' ``CompileConfig`` as ``moekit bench --hf`` builds it (inductor) in ``mode``; the smoke traces
    with ``_smoke_backend``."""
    from transformers import CompileConfig

    config = CompileConfig(backend=_smoke_backend, mode=mode) if SMOKE else CompileConfig(mode=mode)
    if dev.type != "cuda":
        config._compile_all_devices = True
    return config


class StepMarks:
    """A ``generate`` logits processor: each step, the host clock and a ``trace.MARK`` range in the profile (the host
    has just queued the step's forward; generate waits for its token before the next)."""

    def __init__(self):
        self.stamps: list[int] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter_ns())
        with torch.profiler.record_function(trace.MARK):
            pass
        return scores

    def steps_ms(self) -> list[float]:
        return [(b - a) / 1e6 for a, b in zip(self.stamps[1:], self.stamps[2:])]  # after the first decode step


def generate(model, impl: str, prompt, tokens: int, config, marks=None, logits: bool = False):
    """``bench_run.run_generate`` through ``impl`` (``moekit bench --hf``'s implementations and ceilings)."""
    from moekit.bench.hf_models import use_impl

    use_impl(model, impl)
    return run_generate(model, prompt, tokens, config, marks, logits)


def profile_steps(model, impl: str, prompt, config) -> trace.StepTable:
    """The profiled generate's decode steps ``FIRST_STEP``.. (``trace.step_table``)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([] if SMOKE else [torch.profiler.ProfilerActivity.CUDA])
    marks = StepMarks()
    with torch.profiler.profile(activities=acts) as prof:
        generate(model, impl, prompt, PROF_TOKENS, config, marks)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        got = trace.read_trace(path, cpu_ops=SMOKE)
    RUN.log(f"{impl}: {got.counts['kernels']} kernels in the trace, {got.counts['launch_matched']} matched to their "
            f"launch, {len(got.marks)} step marks, {len(got.host)} host ranges")
    return trace.step_table(got, FIRST_STEP)


def decoded(model, impl: str, prompt, config):
    """An 8-token generate's ``hf_measure.Decode`` (tokens, step logits) through ``impl`` (eager: ``config`` None)."""
    from moekit.bench.hf_measure import Decode

    got = generate(model, impl, prompt, 8, config, logits=True)
    return Decode(got.sequences[0, prompt.shape[1]:], torch.stack([s[0].float() for s in got.logits]), 0.0)


def one_impl(model, impl: str, prompt, config, out: dict, logits: dict) -> trace.StepTable:
    """Warm (compile, capture), the unprofiled step wall, the profiled steps; ``out[impl]`` filled."""
    logits[impl] = decoded(model, impl, prompt, config)
    generate(model, impl, prompt, PROF_TOKENS, config)  # a second pass: the graphs recorded, replayed
    RUN.log(f"warm {impl}")
    marks = StepMarks()
    generate(model, impl, prompt, WALL_TOKENS, config, marks)
    wall_ms = statistics.median(marks.steps_ms())
    table = profile_steps(model, impl, prompt, config)
    out[impl] = {"wall_ms_unprofiled": round(wall_ms, 4), "summary": table.summary(), "by_name": table.by_name,
                 "host": table.host, "wall_us_steps": table.wall_us, "busy_us_steps": table.busy_us}
    RUN.log(f"{impl}: unprofiled step {wall_ms * 1e3:.1f} µs; profiled {table.summary()}")
    return table


def one_mode(model, prompt, dev, mode: str, ref) -> None:
    """Every implementation in ``mode`` (those starting before the deadline), the correctness check, the diffs."""
    from moekit.bench.hf_measure import decode_rel_err
    from moekit.bench.hf_run import RECOMPILE_LIMIT, _recompile_limit

    out = RESULT["modes"][mode] = {"impls": {}, "diffs": {}, "rel_l2_vs_eager_grouped_mm": {}}
    tables, logits = {}, {}
    config = compile_config(dev, mode)
    with _recompile_limit(RECOMPILE_LIMIT):
        for impl in ARGS.impls:
            if RUN.elapsed() > ARGS.deadline - COMPILE_S:
                RUN.log(f"{mode}: deadline before {impl}")
                RUN.summary.append(f"{mode} {impl}: not reached")
                continue
            try:
                tables[impl] = one_impl(model, impl, prompt, config, out["impls"], logits)
            except Exception as exc:  # noqa: BLE001 (one implementation's failure is reported, the others run)
                RUN.log(f"FAIL {mode} {impl}: {type(exc).__name__}: {str(exc)[-800:]}")
                RUN.failed.append(f"{mode} {impl}")
            dump()
    torch._dynamo.reset()
    for impl in [n for n in CHECKED if n in logits]:
        err = out["rel_l2_vs_eager_grouped_mm"][impl] = decode_rel_err(logits[impl], ref)
        RUN.check(f"{mode}: {impl} step logits vs eager grouped_mm", err < TOL, f"rel_l2={err:.2e}")
    pairs = [(n, BASE) for n in tables if n not in (BASE, NO_ROUTER)] + [(BASE, NO_ROUTER)]
    for new, old in [(a, b) for a, b in pairs if a in tables and b in tables]:
        out["diffs"][f"{new} - {old}"] = trace.diff_rows(tables[new], tables[old], LAYERS)
    summarise(mode, out)


def summarise(mode: str, out: dict) -> None:
    base = out["impls"].get(BASE)
    for impl, v in out["impls"].items():
        s = v["summary"]
        extra = ""
        if base is not None and impl not in (BASE, NO_ROUTER):
            d = s["busy_us"] - base["summary"]["busy_us"]
            dw = (v["wall_ms_unprofiled"] - base["wall_ms_unprofiled"]) * 1e3
            extra = f"; over {BASE}: step {dw:.1f} µs ({dw / LAYERS:.1f} a layer), busy {d:.1f} ({d / LAYERS:.1f})"
        wall = v["wall_ms_unprofiled"] * 1e3
        RUN.summary.append(f"{mode} {impl:<13} step {wall:7.1f} µs unprofiled ({s['wall_us']:.1f} profiled): busy "
                           f"{s['busy_us']:.1f}, kernels {s['kernel_us']:.1f} ({s['kernels']:.0f}), gap "
                           f"{wall - s['busy_us']:.1f} ({s['gap_us']:.1f} profiled){extra}")
        RUN.summary.append(f"    by part: {s['by_part_us']}")
        RUN.summary.append(f"    host: {s['host_us']}")
    if "moekit" in out["impls"]:
        RUN.summary.append(f"{mode} moekit's kernels a step (count, µs; the first 15 by µs):")
        for name, v in list(out["impls"]["moekit"]["by_name"].items())[:15]:
            RUN.summary.append(f"    {v['part']:<9} {v['count']:6.2f} {v['us']:8.2f}  {name[:90]}")
    for pair, rows in out["diffs"].items():
        RUN.summary.append(f"{mode} {pair} (count a step, µs a step, µs a layer):")
        for r in rows[:12]:
            RUN.summary.append(f"    {r['part']:<9} {r['count_step']:+6.2f} {r['us_step']:+8.2f} {r['us_layer']:+7.2f}"
                               f"  {r['name'][:90]}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--deadline", type=float, default=66.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--impls", type=lambda v: tuple(v.split(",")), default=IMPLS, help=f"among {','.join(IMPLS)}")
    p.add_argument("--modes", type=lambda v: tuple(v.split(",")), default=("reduce-overhead",),
                   help="CompileConfig modes: reduce-overhead (CUDA graphs), default")
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()  # a hang: the table so far, then exit 3
    RESULT["run"].update(run_info() | {"smoke": SMOKE, "layers": LAYERS, "impls": ARGS.impls, "modes": ARGS.modes})
    model, prompt, dev = build()
    RUN.log(f"model built ({RESULT['run']})")
    ref = decoded(model, "grouped_mm", prompt, None)  # the correctness reference: transformers' own, eager
    RUN.log("reference: eager grouped_mm decoded")
    for mode in ARGS.modes:
        try:
            one_mode(model, prompt, dev, mode, ref)
        except Exception as exc:  # noqa: BLE001 (a mode's failure is reported; the table still prints)
            RUN.log(f"FAIL {mode}: {type(exc).__name__}: {str(exc)[-800:]}")
            RUN.failed.append(mode)
        dump()
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
