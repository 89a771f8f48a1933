"""opg35: ``moekit::triton_experts_infer``, the inference twin of ``moekit::triton_experts`` (``triton_op``: the same
kernel body and fake through ``op_library``, no Python autograd layer), on the GPU: correct, its dispatch, and the
real client before / after. One call decides whether the twin stays the path of calls that need no gradient.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/opg35_device_check.py --out $OUT/opg35 --deadline 72   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/opg35_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/opg35.json rewritten after each):
  correct   Qwen3-30B-A3B experts (E = 128, K = 2048, N = 768, k = 8, bf16, default LaunchOptions) at M = 1 and 64:
            the twin bit-equal to the custom op, both against grouped_mm's twin (rel-L2 PASS < 1e-2); the traced
            entry compiled fullgraph under no_grad holds the twin and not the custom op.
  op        host µs a call (queued behind ~1 ms of GPU work) and wall µs, 5 interleaved rounds, under no_grad: the
            33-argument schema with an empty body as a custom_op + autograd and through op_library
            (``op34_registrations``); the M = 1 call through the custom op and the twin, eagerly and from a
            ``torch.compile``d function (inductor, no CUDA graphs: its call runs the op each time), and the op's
            body alone (``_experts_kernel``, its options cached) and as main has it (``body_before``: the options
            built per call), main's op (``opg35_client.main_op``: the custom op around main's body); a cProfile of
            300 calls of each body and op (where the op's time goes).
  compiled  transformers' compiled decode (``opg35_client``: 8 Qwen3-MoE layers, random weights; static cache,
            CompileConfig "reduce-overhead": CUDA graphs, as ``moekit bench --hf --compile`` runs it), before /
            after: step logits bit-equal, ms a step (median of a 33-token generate's steps), 5 rounds.
  nograph   the same compiled with mode "default" (no CUDA graphs: the op's dispatch runs every step).
  eager     the eager decode, before / after: the eager path meets neither op (nothing should move).
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opg35_client as client  # noqa: E402
from opg35_body_cpu import body_before  # noqa: E402
from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, host_and_wall_us, raise_recompile_limit, rel_l2, run_info, run_phases  # noqa: E402

ROUNDS, TOKENS = (2, 4) if SMOKE else (5, 33)
E, N, K, TOP_K = (8, 32, 64, 2) if SMOKE else (128, 768, 2048, 8)
MS = (1, 5) if SMOKE else (1, 64)
RUN = RunLog("opg35: triton_experts' inference twin (µs a call / ms a decode step, medians of interleaved rounds)",
             stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"compiled": 30, "nograph": 20, "eager": 8}  # a phase starts only this long before the deadline (s)


def op_args(m: int, dev) -> tuple:
    """The op's 33 arguments for a Qwen3 call of M = m tokens: silu, no map or biases, the default options."""
    from moekit.activations import ActivationSpec, spec_fields
    from moekit.experts.triton_op import _DEFAULT_OP_ARGS

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=g).to(dev, torch.bfloat16)  # [M, K]
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dev, torch.bfloat16)  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dev, torch.bfloat16)  # [E, K, N]
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).to(dev)  # [M, k]
    weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).to(dev)  # [M, k]
    return (x, w13, w2, ids, weights, None, None, None, *spec_fields(ActivationSpec()), *_DEFAULT_OP_ARGS)


def correct_phase(dev) -> None:
    from moekit.experts.grouped_mm import experts_grouped_mm
    from moekit.experts.triton_op import traced_triton_experts

    res = RESULT["correct"] = {}
    with torch.no_grad():
        for m in MS:
            args = op_args(m, dev)
            twin, custom = torch.ops.moekit.triton_experts_infer(*args), torch.ops.moekit.triton_experts(*args)
            ref = experts_grouped_mm(*args[:5])
            res[m] = {"bit_equal": torch.equal(twin, custom), "twin_vs_grouped_mm": rel_l2(twin, ref),
                      "custom_vs_grouped_mm": rel_l2(custom, ref)}
            RUN.check(f"M={m} twin bit-equal to the custom op", res[m]["bit_equal"])
            RUN.check(f"M={m} twin vs grouped_mm", res[m]["twin_vs_grouped_mm"] < 1e-2,
                      f"rel_l2={res[m]['twin_vs_grouped_mm']:.2e} (custom op {res[m]['custom_vs_grouped_mm']:.2e})")
        seen = []

        def recorder(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if "moekit" in str(n.target))
            return gm.forward

        args = op_args(1, dev)
        torch.compile(lambda *a: traced_triton_experts(*a[:5], "silu"), fullgraph=True, backend=recorder)(*args)
    RUN.check("compiled under no_grad holds the twin only", seen == ["moekit.triton_experts_infer"], str(seen))



def host_us(fns: dict, dev, calls: int) -> dict:
    """``bench_run.host_and_wall_us`` over this check's rounds."""
    return host_and_wall_us(fns, dev, calls, ROUNDS)


def profiled(fn, calls: int, top: int = 14) -> list:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time, [name, own µs a call, cumulative µs
    a call, calls a call] (where the op's time goes beyond its body: the lead's question from op34)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = [[f"{os.path.basename(f)}:{line}:{name}", round(own * 1e6 / calls, 2), round(cum * 1e6 / calls, 2),
            round(n / calls, 2)] for (f, line, name), (n, _, own, cum, _) in rows]
    RUN.log("profile: " + "; ".join(f"{r[0]} {r[1]}" for r in out[:8]))
    return out


def op_phase(dev) -> None:
    import op34_registrations as regs
    from moekit.experts.triton_op import _experts_kernel

    ops = regs.registered()
    empty = {"empty custom_op": ops["triton schema: custom_op + autograd"],
             "empty twin": ops["triton schema: library, no autograd"]}
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    empty_args = regs.args_for("triton", x)
    args = op_args(1, dev)
    custom, twin = torch.ops.moekit.triton_experts.default, torch.ops.moekit.triton_experts_infer.default
    main = client.main_op()  # main's op: custom_op around main's body
    backend = "eager" if SMOKE else "inductor"  # the smoke: the logic, not inductor's CPU build
    compiled_custom = torch.compile(lambda *a: custom(*a), fullgraph=True, backend=backend)
    compiled_twin = torch.compile(lambda *a: twin(*a), fullgraph=True, backend=backend)
    fns = {**{name: (lambda op=op: op(*empty_args)) for name, op in empty.items()},
           "body": lambda: _experts_kernel(*args), "body before": lambda: body_before(*args),
           "custom_op": lambda: custom(*args), "twin": lambda: twin(*args), "main op": lambda: main(*args),
           "compiled custom_op": lambda: compiled_custom(*args), "compiled twin": lambda: compiled_twin(*args)}
    with torch.no_grad():
        for fn in fns.values():
            fn()
        RUN.log("op: compiled and warm")
        got = RESULT["op_us"] = host_us(fns, dev, 3 if SMOKE else 300)
        RESULT["op_profile"] = {n: profiled(fns[n], 3 if SMOKE else 300)
                                for n in ("body", "body before", "custom_op", "twin", "main op")}
        same = torch.equal(body_before(*args), _experts_kernel(*args))
    RUN.check("the body before bit-equal to the body", same)
    for new, old in (("empty twin", "empty custom_op"), ("twin", "custom_op"), ("twin", "main op"),
                     ("compiled twin", "compiled custom_op"),
                     ("body", "custom_op"), ("body", "twin"), ("body", "body before")):
        host_new, host_old = got[new][0], got[old][0]
        med = statistics.median
        RUN.summary.append(f"| op | {new} vs {old} | {med(host_new):.1f} / {med(host_old):.1f}"
                           f" | {med(got[new][1]):.1f} / {med(got[old][1]):.1f} | "
                           + " ".join(f"{a / b:.2f}" for a, b in zip(host_new, host_old))
                           + f" | {wins(host_new, host_old)} / {wins(host_old, host_new)} |")


def client_phase(name: str, model, prompt, dev) -> None:
    """``name``: eager, compiled (reduce-overhead) or nograph (compiled, mode "default")."""
    config = None if name == "eager" else client.compile_config(dev, "default" if name == "nograph" else
                                                                "reduce-overhead", SMOKE)
    if config is not None:
        logits = {}
        for impl in client.IMPLS:  # compiled at the rounds' cache length; CUDA-graph trees record on a later run
            logits[impl] = client.step_logits(model, impl, prompt, config, TOKENS)
            RUN.log(f"{name}: {impl} compiled")
            client.generate(model, impl, prompt, TOKENS, config)
        same = torch.equal(logits["moekit"], logits[client.BEFORE])
        err = rel_l2(logits["moekit"], logits[client.BEFORE])
        RUN.check(f"{name}: step logits after bit-equal to before", same, f"rel_l2={err:.2e}")
        if SMOKE:  # after's graph holds the twin, before's the custom op
            RUN.check(f"{name}: the graphs' ops", sorted({tuple(s) for s in client.SEEN if s}) == [
                ("moekit.triton_experts_infer",), ("opg35.triton_experts_main",)], str(client.SEEN))
    else:
        for impl in client.IMPLS:
            client.generate(model, impl, prompt, 4)
    RUN.log(f"{name}: warm")
    per = client.decode_rounds(model, prompt, TOKENS, config, ARGS.rounds, lambda: RUN.elapsed() > ARGS.deadline - 3,
                               RUN.log, name)
    RESULT[f"{name}_ms_per_step"] = per
    after, before = per["moekit"], per[client.BEFORE]
    if after and before:
        RUN.summary.append(f"| {name} decode | after vs before (ms a step; tok/s) | {statistics.median(after):.3f} / "
                           f"{statistics.median(before):.3f} ({1e3 / statistics.median(after):.1f} / "
                           f"{1e3 / statistics.median(before):.1f}) | | "
                           + " ".join(f"{a / b:.3f}" for a, b in zip(after, before))
                           + f" | {wins(after, before)} / {wins(before, after)} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=72.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="decode rounds (the op phase keeps ROUNDS)")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x),
                   default=("correct", "op", "compiled", "nograph", "eager"))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K], "phases": ARGS.phases}
    RUN.summary.append("| phase | variant | host µs (or ms) new / old | wall µs new / old | new / old per round | "
                       "rounds >= 3% faster / slower |\n|---|---|---|---|---|---|")
    raise_recompile_limit()  # two implementations (and modes): never fall back to eager
    built = []  # [(model, prompt)] once a client phase needs it

    def client_run(name: str) -> None:
        if not built:
            built.append(client.build(SMOKE, dev))
        client_phase(name, *built[0], dev)

    phases = {"correct": lambda: correct_phase(dev), "op": lambda: op_phase(dev),
              **{name: (lambda name=name: client_run(name)) for name in ("compiled", "nograph", "eager")}}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, NEEDS_S,
                      ARGS.out and os.path.join(ARGS.out, "opg35.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
