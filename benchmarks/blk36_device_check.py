"""blk36: ``use_moekit_blocks`` under torch.compile with fewer dynamo guards a layer and the fused router's
nonfinite="raise" in its kernel (no flag fill, no ``_assert_async``), against main's (``blk36_before``), on the GPU.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/blk36_device_check.py --out $OUT/blk36 --deadline 70   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/blk36_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted
    PYTHONPATH=$PWD flock /work/wt/cpubench.lock python3 benchmarks/blk36_device_check.py --cpu --deadline 900
        # the CPU measurement: 8 tiny layers, fp32, inductor "default" (the CPU's router and experts), 7 rounds;
        # its JSON named for this CPU as benchmarks/results/ files it (``_json_name``)

The model: transformers' Qwen3-MoE as ``moekit bench --hf`` builds it (8 layers at Qwen3-30B-A3B widths, random
weights, bf16), every block swapped (``use_moekit_blocks``), each block also given main's forward, swap checks and
fused router over the same Parameters (``blk36_before.prepare``); ``install`` switches them, dynamo keeps a compiled
entry for each. generate compiled as transformers does by default (static cache, "reduce-overhead": CUDA graphs).
Phases (``--phases``, in this order by default; each skipped past the deadline; <out>/blk36.json (``_json_name``)
rewritten after each):
  correct   the compiled route op asked to assert in its kernel returns an empty flag (nothing filled); after /
            before compiled step logits bit-equal (PASS within 1e-3 rel-L2), after against the eager unswapped model
            with the "moekit" experts (PASS < 2e-2).
  compiled  ms a decode step (median of a 33-token generate's steps), after / before interleaved, 5 rounds.
  guards    dynamo's guard evaluation of each compiled step (µs, ``manager.check`` on the step's last locals, 1000 in
            a row, the variants interleaved: what "TorchDynamo Cache Lookup" pays a step) and its leaf guard count.
  kernels   (CUDA) one compiled generate per variant under ``torch.profiler``: kernels a decode step, the
            ``_assert_async`` and int-fill ones among them (PASS: none after, some before).
Beside them, from the start, a child process sends a NaN logit through the compiled ("reduce-overhead") router and
must end in a device-side assert (nonfinite="raise" still raises; that child's CUDA context is lost, not this one's).
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import threading
import time

SMOKE = "--smoke" in sys.argv
CPU = "--cpu" in sys.argv  # the CPU's own path timed: tiny widths, 8 layers, no Triton
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blk36_before as before  # noqa: E402
from bench_rounds import faster_rounds  # noqa: E402
from bench_run import RunLog, rel_l2, run_generate, run_info, write_json  # noqa: E402
from moekit.bench.cpu_measure import cpu_name  # noqa: E402
from opg35_client import StepClock  # noqa: E402

ROUNDS, TOKENS = (2, 4) if SMOKE else (7, 17) if CPU else (5, 33)
GUARD_CALLS = 1000  # guard evaluations a round
VARIANTS = ("after", "before")
RUN = RunLog("blk36: use_moekit_blocks compiled, after / before (guard µs a step, ms a decode step; medians)",
             stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
KEPT: dict = {v: [] for v in VARIANTS}  # variant -> [guard manager] of its compiled frames
CALLS: dict = {v: [] for v in VARIANTS}  # variant -> [(args, kwargs)] of its compiled calls
CURRENT = ["after"]


def _hook_guards() -> None:
    import torch._dynamo.guards as dynamo_guards

    dynamo_guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: KEPT[CURRENT[0]].append(
        (manager, scope))


def _record_calls(model) -> None:
    """Keep each compiled call's arguments (the frame's locals for the guard timing: the compile-time ones are
    mutated by generate afterwards)."""
    get = type(model).get_compiled_call

    def get_compiled_call(self, config):
        fn = get(self, config)

        def call(*args, **kwargs):
            CALLS[CURRENT[0]][:] = [(args, dict(kwargs))]
            return fn(*args, **kwargs)
        return call
    type(model).get_compiled_call = get_compiled_call


def _compile_config(dev):
    from transformers import CompileConfig

    # "reduce-overhead" on the GPU (CUDA graphs); inductor without them on the CPU
    config = CompileConfig(backend="eager") if SMOKE else CompileConfig(mode="default") if CPU else CompileConfig()
    if dev.type != "cuda":
        config._compile_all_devices = True
    return config


def build(dev):
    from moekit.bench.hf_models import build_model, hf_config
    from moekit.hf import use_moekit_blocks

    config = hf_config("qwen3", 1 if SMOKE else 8, tiny=SMOKE or CPU)
    model = build_model(config, torch.float32 if SMOKE or CPU else torch.bfloat16, dev)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=g).to(dev)
    twin_logits = _steps(model, prompt, None, "moekit")  # the eager unswapped model, moekit's experts
    model.set_experts_implementation("moekit")
    report = use_moekit_blocks(model)
    # the smoke runs the GPU's path interpreted: the fused router and the triton backend ("auto" on CUDA)
    count = before.prepare(model, router="fused" if SMOKE else "auto", backend="triton" if SMOKE else None)
    RUN.log(f"model: {len(report.swapped)} blocks swapped, {count} given main's forward; {dev}")
    return model, prompt, twin_logits


def _steps(model, prompt, config, impl=None) -> torch.Tensor:
    """[T, V] float logits of each step of a TOKENS-token greedy generate."""
    if impl is not None:
        model.set_experts_implementation(impl)
    out = run_generate(model, prompt, TOKENS, config, logits=True)
    return torch.stack([s[0].float() for s in out.logits])


def _generate(model, variant: str, prompt, config, clock=None):
    CURRENT[0] = variant
    before.install(model, variant)
    return run_generate(model, prompt, TOKENS, config, clock)


def _same_input_steps(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, V] step logits -> the leading steps both read the same tokens for: up to and including the first
    step whose greedy tokens differ."""
    differ = (a.argmax(-1) != b.argmax(-1)).nonzero()
    n = int(differ[0]) + 1 if differ.numel() else a.shape[0]
    return a[:n], b[:n]


def correct_phase(model, prompt, config, twin_logits, dev) -> None:
    from moekit import MoEConfig

    res = RESULT["correct"] = {}
    if not CPU:  # the CPU's own path has no fused router
        cfg = MoEConfig.from_hf_config(model.config)
        logits = torch.randn(1, cfg.num_experts, device=dev)
        ok = torch.ops.moekit.route_fused(logits, None, None, cfg.top_k, 1, 1, False, cfg.renormalize, 1.0, True, 0,
                                          128, 0.0, False, "max", False, 1.0, True)[2]
        flag = res["assert_in_kernel_flag_shape"] = tuple(ok.shape)
        RUN.check("compiled route op asserting in its kernel returns no flag", flag == ((1,) if SMOKE else (0,)),
                  f"flag {flag} (the interpreter keeps the flag)")
    steps = {}
    for variant in VARIANTS:
        CURRENT[0] = variant
        before.install(model, variant)
        steps[variant] = _steps(model, prompt, config)
    err = rel_l2(steps["after"], steps["before"])
    res.update(after_vs_before=err, bit_equal=bool(torch.equal(steps["after"], steps["before"])),
               after_vs_eager=rel_l2(*_same_input_steps(steps["after"], twin_logits)),
               after_vs_eager_all_steps=rel_l2(steps["after"], twin_logits),
               steps_same_input=len(_same_input_steps(steps["after"], twin_logits)[0]))
    RUN.check("after vs before compiled step logits", err < 1e-3, f"rel-L2 {err:.2e}, bit-equal {res['bit_equal']}")
    # Greedy decode in bf16 may pick another token at some step (session 37, H100: all 33 steps 1.19e-1 with main's
    # "before" bit-equal to "after"), and every step after it reads other tokens: those are not compared.
    RUN.check("after compiled vs the eager unswapped model, steps of the same tokens", res["after_vs_eager"] < 2e-2,
              f"rel-L2 {res['after_vs_eager']:.2e} over {res['steps_same_input']} of {TOKENS} steps "
              f"(all steps {res['after_vs_eager_all_steps']:.2e})")


_CHILD = """
import torch
from moekit import MoEConfig
from moekit.routing.fused import FusedRouter
router = FusedRouter(MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=128, top_k=8))
step = torch.compile(lambda x: router(x).topk_ids, fullgraph=True, mode="reduce-overhead")
good = torch.randn(1, 128, device="cuda")
for _ in range(3):
    step(good)
torch.cuda.synchronize()
print("finite ok", flush=True)
bad = good.clone()
bad[0, 5] = float("nan")
step(bad)
torch.cuda.synchronize()
print("NOT RAISED", flush=True)
"""


def _nonfinite_child(child: subprocess.Popen) -> dict:
    """A NaN logit through the compiled (CUDA-graph) router in a child (started first, run beside the phases): a
    device-side assert ends it."""
    try:
        out, _ = child.communicate(timeout=max(5.0, ARGS.deadline + 8 - RUN.elapsed()))
        done = child.returncode
    except subprocess.TimeoutExpired:
        child.kill()
        out, done = "timeout", None
    text = out or ""
    raised = (done not in (None, 0) and "finite ok" in text and "NOT RAISED" not in text
              and ("device-side assert" in text or "assert" in text.lower()))
    RUN.check("compiled router: a NaN logit still raises (device-side assert)", raised,
              text.strip().splitlines()[-1][:200] if text.strip() else "no output")
    return {"raised": raised, "returncode": done, "tail": text[-600:]}


def guards_phase(model) -> None:
    """Each variant's compiled frames' guards on the locals of its last compiled call: leaf count, passes, µs an
    evaluation (GUARD_CALLS in a row), the variants interleaved in ROUNDS rounds (the classes installed first: the
    other variant's fail these guards at once)."""
    res = RESULT["guards"] = {}
    torch.set_grad_enabled(False)  # generate's mode: the guards check it
    frames = {}
    for variant in VARIANTS:
        if CALLS[variant] and KEPT[variant]:
            args, kwargs = CALLS[variant][0]
            before.install(model, variant)
            frames[variant] = [(m, dict(scope, args=args, kwargs=kwargs)) for m, scope in KEPT[variant]]
            res[variant] = [dict(passes=bool(m.check(scope)), us=[], leaf_guards=sum(
                "+-" in line and "GuardManager:" not in line for line in str(m).splitlines())) for m, scope in
                frames[variant]]
    for r in range(ROUNDS):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            before.install(model, variant)
            for (manager, scope), row in zip(frames.get(variant, []), res.get(variant, [])):
                start = time.perf_counter()
                for _ in range(GUARD_CALLS):
                    manager.check(scope)
                row["us"].append((time.perf_counter() - start) / GUARD_CALLS * 1e6)
    torch.set_grad_enabled(True)
    for variant, rows in res.items():
        RUN.log(f"guards {variant}: " + "; ".join(
            f"{r['leaf_guards']} leaf, {statistics.median(r['us']):.1f} µs, passes {r['passes']}" for r in rows))
    passing = {v: [r for r in res.get(v, []) if r["passes"]] for v in VARIANTS}
    if all(passing.values()):
        after, prior = passing["after"][0], passing["before"][0]
        ratios = [a / b for a, b in zip(after["us"], prior["us"])]
        RUN.summary.append(f"guards a step  after {statistics.median(after['us']):7.1f} µs ({after['leaf_guards']} "
                           f"leaf)  before {statistics.median(prior['us']):7.1f} µs ({prior['leaf_guards']} leaf)  "
                           f"after/before {' '.join(f'{r:.3f}' for r in ratios)}  >= 3% faster "
                           f"{faster_rounds(after['us'], prior['us'])}/{len(ratios)}")


def compiled_phase(model, prompt, config) -> None:
    for variant in VARIANTS:  # one untimed generate each: the first steps after a switch settle
        _generate(model, variant, prompt, config)
    per = {v: [] for v in VARIANTS}
    for r in range(ROUNDS):
        if r and RUN.elapsed() > ARGS.deadline:
            RUN.log(f"compiled: deadline, {r} rounds")
            break
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            clock = StepClock()
            _generate(model, variant, prompt, config, clock)
            per[variant].append(clock.median_ms())
        RUN.log(f"compiled round {r}: " + ", ".join(f"{v} {t[-1]:.3f} ms" for v, t in per.items()))
    RESULT["compiled"] = per
    ratios = [a / b for a, b in zip(per["after"], per["before"])]
    faster, slower = faster_rounds(per["after"], per["before"]), faster_rounds(per["before"], per["after"])
    RUN.summary.append(f"decode step    after {statistics.median(per['after']):7.3f} ms  before "
                       f"{statistics.median(per['before']):7.3f} ms  after/before "
                       f"{' '.join(f'{x:.3f}' for x in ratios)}  >= 3% faster {faster}/{len(ratios)}, slower {slower}")


def kernels_phase(model, prompt, config) -> None:
    """Each variant's kernels over one compiled generate under ``torch.profiler`` (CUDA graph nodes included: the
    profiler ran once before any graph was made), per decode step: all, ``_assert_async``'s, the int fills."""
    res = RESULT["kernels"] = {}
    for variant in VARIANTS:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _generate(model, variant, prompt, config)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        steps = TOKENS - 1
        res[variant] = dict(all=len(names) / steps, assert_async=sum("assert_async" in n for n in names) / steps,
                            fill=sum("FillFunctor" in n for n in names) / steps)
        RUN.log(f"kernels {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in res[variant].items()) + " a step")
    after, prior = res["after"], res["before"]
    RUN.check("compiled step: no _assert_async kernel after (before has them)",
              after["assert_async"] == 0 < prior["assert_async"],
              f"a step after {after['assert_async']:.1f}, before {prior['assert_async']:.1f}")
    RUN.summary.append(f"kernels a step after {after['all']:.1f} (assert {after['assert_async']:.1f}, fill "
                       f"{after['fill']:.1f})  before {prior['all']:.1f} (assert {prior['assert_async']:.1f}, fill "
                       f"{prior['fill']:.1f})")


def _json_name() -> str:
    """The JSON's file name under --out: blk36.json on the GPU; with --cpu the name benchmarks/results/ files it
    under, from this machine's CPU model (/proc/cpuinfo, as ``moekit bench --cpu`` names its files):
    ``<model name>-cpu-blk36-<date>.json``, e.g. AMD_EPYC-cpu-blk36-2026-12-05.json."""
    if not CPU:
        return "blk36.json"
    return f"{cpu_name().replace(' ', '_').replace('/', '_')}-cpu-blk36-{datetime.date.today().isoformat()}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="blk36_out")
    parser.add_argument("--deadline", type=float, default=70.0, help="s from the start: no phase or round starts later")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--phases", default="correct,compiled,guards,kernels" if not (SMOKE or CPU) else
                        "correct,compiled,guards", help="comma-separated, in this order (kernels: CUDA only)")
    parser.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE or CPU else "cuda")
    if CPU:
        torch.set_num_threads(1)  # no OpenMP thread spinning against the other processes on this 2-core VM
    if dev.type == "cuda":  # the profiler started once before any CUDA graph is made, or it misses them (#100441)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            pass
    child = None if dev.type != "cuda" else subprocess.Popen(  # the NaN check beside the phases: a context of its own
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    RESULT["run"] = run_info() | ({"cpu": cpu_name()} if CPU else {})
    path = os.path.join(ARGS.out, _json_name())
    RUN.log(f"json: {path}")
    _hook_guards()
    model, prompt, twin_logits = build(dev)
    _record_calls(model)
    config = _compile_config(dev)
    phases = {"correct": lambda: correct_phase(model, prompt, config, twin_logits, dev),
              "guards": lambda: guards_phase(model), "compiled": lambda: compiled_phase(model, prompt, config),
              "kernels": lambda: kernels_phase(model, prompt, config)}
    for name in ARGS.phases.split(","):
        phase = phases[name]
        if RUN.elapsed() > ARGS.deadline:
            RUN.log(f"SKIP {name}: deadline")
            RUN.summary.append(f"{name}: not reached")
            continue
        try:
            phase()
        except Exception as exc:  # noqa: BLE001 (a phase's failure is reported, the others still run)
            RUN.log(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-800:]}")
            RUN.failed.append(name)
        write_json(path, RESULT)
    if child is not None:
        RESULT["nonfinite_child"] = _nonfinite_child(child)
        write_json(path, RESULT)
    RUN.print_table()


ARGS = argparse.Namespace()

if __name__ == "__main__":
    main()
