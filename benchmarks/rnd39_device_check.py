"""rnd39: the grouped GEMM path (``backend="grouped_mm"``, CUDA without Triton) after session 39 against main
38ead07c's arithmetic (``before``). On the CPU (``FLOAT32_GLU_DEVICES``) it rounds only where its bf16 GEMMs force it
(both biases and the activation in float32); on CUDA, where those float32 passes cost twice the bytes (this check's
first run, H100: the activation alone 1.9x, Mixtral / gpt-oss M = 4096 1.22x / 1.25x), it keeps h + b13 and the
activation in bf16 and adds b2 in float32 only (the combine upcast y anyway). Decides whether that lands: every check
PASS and no measured cell slower by more than 3%.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/rnd39_device_check.py --out $OUT/rnd39 --deadline 70   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/rnd39_device_check.py --smoke     # CPU: tiny shapes (cpu_gemm="grouped_mm")
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /work/wt/cpubench.lock python3 benchmarks/rnd39_device_check.py --cpu \
        --phases forward backward --deadline 1500 [--cpu-gemm auto] [--rounds 11]   # CPU timings at CPU shapes

``before`` is 38ead07c's code for the changed functions (``_glu_before``, ``_bias_rows_before``, the CPU loops'
``_glu_loop_before``, no float32 bytes in the plan's row model), patched in around a call; delete this script once
the A/B is settled.

Phases, in this order (each skipped past the deadline; <out>/rnd39.json rewritten after each):
  forward   Qwen3-30B-A3B (E 128, K 2048, N 768, k 8) and Mixtral-8x7B (E 8, K 4096, N 14336, k 2) experts, bf16,
            no biases, and gpt-oss-20b's (E 32, K = N = 2880, k 4, its clamped SwiGLU and biases), default budget,
            at M = 1, 64, 1024, 4096: rel L2 against the float64 reference (PASS < 1e-2 and after <= before x 1.02),
            then µs a call (``time_calls``: CUDA events, four token sets in turn), before / after interleaved in 5
            rounds, the order swapped every round. On CUDA only gpt-oss's arithmetic changed (+ b2 in float32).
  tail      one token of K = 8 (``tests/test_bf16_rounding.draw``, with biases), 1500 seeded draws on the device:
            rel L2 against the float64 experts, before / after (the contiguous layout; the masked one on the CPU
            only: its cap syncs); PASS where after passes 1e-2 in fewer draws than before and equals the emulation of
            the device's rounding points (``GROUPED`` on the CPU, ``CUDA`` elsewhere) in >= 99% of the draws.
  backward  Qwen3 at M = 1024, Mixtral at 256: forward + backward of sum(out * probe) into x, w13, w2; the
            gradients' rel L2 after vs before (PASS < 2e-2), µs in 5 interleaved rounds.
The table is printed last: medians, after / before, rounds in which after was >= 3% slower / faster.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench_run import RunLog, rel_l2, run_info, run_phases, write_json  # noqa: E402
from moekit.activations import ActivationSpec, apply_glu, get_activation  # noqa: E402
from moekit.bench.timing import time_calls  # noqa: E402
from moekit.experts import cpu_packed, cpu_phased  # noqa: E402
from moekit.experts import grouped_mm as gm  # noqa: E402
from moekit.experts import grouped_mm_plan as plan  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402

SMOKE, CPU = "--smoke" in sys.argv, "--cpu" in sys.argv
ROUNDS = 2 if SMOKE else int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
DRAWS = 40 if SMOKE else 1500
SHAPES = ({"qwen3": (8, 64, 32, 2), "mixtral": (4, 128, 256, 2), "gpt_oss": (4, 64, 64, 2)} if SMOKE else
          {"small": (8, 1024, 512, 2), "mid": (16, 2048, 768, 4), "small_gpt_oss": (8, 1024, 512, 2)} if CPU else
          {"qwen3": (128, 2048, 768, 8), "mixtral": (8, 4096, 14336, 2),
           "gpt_oss": (32, 2880, 2880, 4)})  # name -> (E, K, N, k)
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)  # with biases
MS = (1, 8) if SMOKE else (1, 16, 256) if CPU else (1, 64, 1024, 4096)
BACKWARD_M = ({"qwen3": 8, "mixtral": 8} if SMOKE else {"small": 256, "mid": 256} if CPU else
              {"qwen3": 1024, "mixtral": 256})
ARMS = ("before", "after")
RUN = RunLog("rnd39: grouped_mm's bf16 roundings, before (38ead07c) / after (µs a call, medians of interleaved "
             "rounds)", stall_s=900 if CPU else 60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"tail": 10, "forward": 25, "backward": 10}  # a phase starts only this long before the deadline (s)


def _glu_before(h, spec, bias=None):
    """38ead07c: h + b13 in h's dtype (rounded), the activation and its product in h's dtype (each rounded)."""
    return apply_glu(h if bias is None else h + bias, spec)


def _bias_rows_before(bias, rows_expert, dtype=None):
    """38ead07c: the gathered bias in its own dtype (y + b2 rounded to bf16 before the combine)."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])])[rows_expert]


def _glu_loop_before(h, spec, acc):
    """38ead07c's CPU loops (``cpu_packed._expert``, ``cpu_phased.glu_rows``, ``_expert_mlp_cpu_loop``): the
    activation in h's dtype, act(gate) rounded, then its product in place."""
    if not spec.plain:
        return apply_glu(h, spec)
    n_dim = h.shape[1] // 2
    return get_activation(spec.name).fn(h[:, :n_dim]).mul_(h[:, n_dim:])


# (module, name, 38ead07c's version): the CPU loops' bytes (``fused_loop_peak_bytes``' acc term) are not patched,
# which moves no plan at these sizes
BEFORE = ((gm, "glu_operand", _glu_before), (gm, "_bias_rows", _bias_rows_before),
          (plan, "glu_float_bytes", lambda n, d, device: 0), (cpu_packed, "glu_rounded_once", _glu_loop_before),
          (cpu_phased, "glu_rounded_once", _glu_loop_before), (gm, "glu_rounded_once", _glu_loop_before))


@contextlib.contextmanager
def arithmetic(arm: str):
    """The experts as ``arm`` computes them (plans recomputed on entry and exit: the row model differs)."""
    if arm == "after":
        yield
        return
    saved = [getattr(module, name) for module, name, _ in BEFORE]
    for module, name, before in BEFORE:
        setattr(module, name, before)
    plan._PLANS.clear()
    try:
        yield
    finally:
        for (module, name, _), now in zip(BEFORE, saved):
            setattr(module, name, now)
        plan._PLANS.clear()


def grouped(x, w13, w2, ids, weights, b13=None, b2=None, layout="auto", activation="silu"):
    """The experts through ``ARGS.cpu_gemm`` ("grouped_mm": the grouped GEMM path on the CPU too)."""
    return gm.experts_grouped_mm(x, w13, w2, ids, weights, b13=b13, b2=b2, layout=layout, cpu_gemm=ARGS.cpu_gemm,
                                 activation=activation)


def tail_phase(dev) -> None:
    from test_bf16_rounding import CUDA, GROUPED, MASKED, draw, emulate

    res = RESULT["tail"] = {}
    points = [("contiguous", GROUPED if dev.type in gm.FLOAT32_GLU_DEVICES else CUDA)]
    for layout, rounds in points + ([("masked_measured_cap", MASKED)] if dev.type == "cpu" else []):
        over, worst, emulated = {}, {}, 0
        for arm in ARMS:
            g = torch.Generator().manual_seed(2)
            errs = []
            with arithmetic(arm), torch.no_grad():
                for _ in range(DRAWS):
                    x, w13, w2, b13, b2, ids, weights = draw(g, 1)
                    exact = emulate(x, w13, w2, b13, b2, ids, weights)
                    args = [t.to(dev) for t in (x, w13, w2, ids, weights, b13, b2)]
                    got = grouped(*args, layout=layout).double().cpu()
                    errs.append(((got - exact).norm() / exact.norm()).item())
                    if arm == "after":
                        emulated += torch.equal(got, emulate(x, w13, w2, b13, b2, ids, weights, rounds=rounds))
            over[arm], worst[arm] = sum(e > 1e-2 for e in errs), max(errs)
        res[layout] = {"over_1e-2": over, "max": worst, "after_is_emulation": emulated, "draws": DRAWS}
        RUN.check(f"tail {layout}: one token of 8 over 1e-2 less often, the emulation's points",
                  over["after"] < max(over["before"], 1) and emulated >= DRAWS - DRAWS // 100,
                  f"before {over['before']} (max {worst['before']:.3g}), after {over['after']} "
                  f"(max {worst['after']:.3g}) of {DRAWS}; after = the emulation in {emulated}")
        RUN.summary.append(f"tail {layout:20s} over 1e-2: before {over['before']:4d}, after {over['after']:4d} of "
                           f"{DRAWS}; max {worst['before']:.3g} -> {worst['after']:.3g}; emulation {emulated}")


def experts(name: str, dev, seed: int = 0) -> dict:
    """bf16 w13 [E, 2N, K], w2 [E, K, N] at 1/sqrt(fan_in); gpt-oss's: its activation and biases b13 [E, 2N],
    b2 [E, K] at 0.3."""
    e, k, n, _ = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (torch.randn(e, 2 * n, k, generator=g, device=dev) * k**-0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g, device=dev) * n**-0.5).bfloat16()
    if "gpt_oss" not in name:
        return dict(w13=w13, w2=w2)
    b13 = (torch.randn(e, 2 * n, generator=g, device=dev) * 0.3).bfloat16()
    b2 = (torch.randn(e, k, generator=g, device=dev) * 0.3).bfloat16()
    return dict(w13=w13, w2=w2, b13=b13, b2=b2, activation=GPT_OSS)


def tokens(name: str, m: int, dev, seed: int):
    """x [M, K] bf16, distinct ids [M, k], float32 softmax weights [M, k]."""
    e, k, _, top_k = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=dev).bfloat16()
    ids = torch.rand(m, e, generator=g, device=dev).argsort(dim=1)[:, :top_k].int()
    weights = torch.softmax(torch.randn(m, top_k, generator=g, device=dev), dim=1)
    return x, ids, weights


def timed_rounds(fns: dict, dev) -> dict:
    """arm -> [µs a call, each round]; the arms' order swapped every round."""
    samples = {arm: [] for arm in fns}
    for r in range(ROUNDS):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            with arithmetic(arm):
                samples[arm].append(time_calls(fns[arm], dev, budget_s=0.05 if SMOKE else 0.1))
    return samples


def summarize(label: str, samples: dict) -> dict:
    before, after = samples["before"], samples["after"]
    ratio = statistics.median(after) / statistics.median(before)
    slower = sum(a >= 1.03 * b for a, b in zip(after, before))
    faster = sum(b >= 1.03 * a for a, b in zip(after, before))
    RUN.summary.append(f"{label:28s} before {statistics.median(before):10.1f}  after {statistics.median(after):10.1f}"
                       f"  after/before {ratio:5.3f}  >=3% slower {slower}/{len(after)}, faster {faster}/{len(after)}")
    RUN.log(f"{label}: " + ", ".join(f"{arm} {[round(v, 1) for v in v]}" for arm, v in samples.items()))
    return {"us": samples, "ratio": ratio, "slower_rounds": slower, "faster_rounds": faster}


def forward_phase(dev) -> None:
    res = RESULT["forward"] = {}
    held: dict = {}  # the current shape's experts (one shape's weights on the device at a time)

    def cell(spec: str) -> None:
        name, m = spec.split(" M=")[0], int(spec.split(" M=")[1])
        if name not in held:
            held.clear()
            held[name] = experts(name, dev)
        ex = held[name]
        calls = [tokens(name, m, dev, seed) for seed in range(4)]
        x, ids, weights = calls[0]
        with torch.no_grad():
            exact = experts_reference(x.double(), topk_ids=ids, topk_weights=weights, **ex)
            errs = {}
            for arm in ARMS:
                with arithmetic(arm):
                    errs[arm] = rel_l2(grouped(x, ids=ids, weights=weights, **ex), exact)
            RUN.check(f"forward {spec}", errs["after"] < 1e-2 and errs["after"] <= 1.02 * errs["before"],
                      f"rel_l2 before {errs['before']:.3e}, after {errs['after']:.3e}")
            fns = {arm: [lambda c=c: grouped(c[0], ids=c[1], weights=c[2], **ex) for c in calls] for arm in ARMS}
            res[spec] = {"rel_l2": errs, **summarize(f"forward {spec}", timed_rounds(fns, dev))}

    write = (lambda: write_json(os.path.join(ARGS.out, "rnd39.json"), RESULT)) if ARGS.out else (lambda: None)
    RUN.each_cell([f"{name} M={m}" for name in SHAPES for m in MS], cell, ARGS.deadline - 4, write)
    held.clear()


def backward_phase(dev) -> None:
    res = RESULT["backward"] = {}
    for name, m in BACKWARD_M.items():
        ex = experts(name, dev)
        w13, w2 = ex["w13"], ex["w2"]
        calls = [tokens(name, m, dev, seed) for seed in range(2)]
        probe = torch.randn(m, SHAPES[name][1], generator=torch.Generator(device=dev).manual_seed(9), device=dev)

        def step(c):
            xs, w13_, w2_ = (t.detach().requires_grad_(True) for t in (c[0], w13, w2))
            out = grouped(xs, w13_, w2_, c[1], c[2])
            return torch.autograd.grad((out.float() * probe).sum(), (xs, w13_, w2_))

        got = {}
        for arm in ARMS:
            with arithmetic(arm):
                got[arm] = step(calls[0])
        errs = [rel_l2(a, b) for a, b in zip(got["after"], got["before"])]
        RUN.check(f"backward {name} M={m} gradients after vs before", max(errs) < 2e-2,
                  "rel_l2 x, w13, w2: " + ", ".join(f"{e:.2e}" for e in errs))
        fns = {arm: [lambda c=c: step(c) for c in calls] for arm in ARMS}
        res[f"{name} M={m}"] = {"grad_rel_l2": errs, **summarize(f"fwd+bwd {name} M={m}", timed_rounds(fns, dev))}
        del ex, w13, w2, calls, fns, got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=72.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu", action="store_true", help="time on the CPU at CPU shapes (small, mid; M = 1, 16, 256)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (2 under --smoke)")
    p.add_argument("--cpu-gemm", default="grouped_mm", help="experts_grouped_mm's cpu_gemm (\"auto\": the CPU loop)")
    p.add_argument("--phases", nargs="*", default=["forward", "tail", "backward"])
    args = p.parse_args(namespace=ARGS)
    dev = torch.device("cpu" if args.smoke or args.cpu or not torch.cuda.is_available() else "cuda")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = run_info() | {"smoke": args.smoke, "cpu": args.cpu, "cpu_gemm": args.cpu_gemm, "rounds": ROUNDS}
    RUN.log(f"{RESULT['run']}")
    phases = {"forward": lambda: forward_phase(dev), "tail": lambda: tail_phase(dev),
              "backward": lambda: backward_phase(dev)}
    path = os.path.join(args.out, "rnd39.json") if args.out else ""
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
