"""Why compiled transformers decode costs more per step than its kernels, and A/B of moekit's compiled path
(issue 13): one process builds a transformers model (Qwen3-MoE at Qwen3-30B-A3B widths, 8 layers; Mixtral
at Mixtral-8x7B widths, 2 layers; random weights, bf16), and each experts implementation decodes through
``generate`` with the static cache and transformers' compile config ("reduce-overhead": CUDA graphs),
compiled in turn (each is its own cache entry: dynamo guards on the config's choice), then timed in
interleaved rounds (the order rotates): wall ms per decode step, median over rounds.

    PYTHONPATH=$PWD python benchmarks/hf_compiled_check.py [--models qwen3 mixtral] [--layers N]
        [--impls moekit ab_prev grouped_mm] [--rounds 5] [--deadline SECONDS] [--out-dir DIR]

Per implementation also: ``guard_us``, dynamo's guard evaluation of its compiled decode step
(``profile_guard_manager`` on the frame's compile-time locals, 100 evaluations); ``gpu``, the GPU
kernels of one decode step from a profiled 9-token generate (``busy_us``: the kernels' summed time per step;
``span_us``: first kernel start to last kernel end of the step's graph replay, so span - busy is the idle
time between the graph's nodes; ``kernels``: per step); ``logits``: the compiled decode's step logits
against the first implementation's (bit-equal expected between moekit variants: the same kernels).

A/B variants (registered here as experts implementations, benchmark only): ``ab_prev`` is the "moekit"
forward before its traced entry (``call_backend`` and the triton backend's eager path traced, guarded on
every call), ``ab_op`` calls the custom op straight from the forward, ``ab_nopdl`` the same with
programmatic dependent launch off. JSON to --out-dir (default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

DEV = torch.device("cuda")


def _step_ms(model, prompt, config, steps: int = 8) -> float:
    """Wall ms per decode step: a (steps + 1)-token generate less a 1-token one (median of 3 each)."""
    from moekit.bench.hf_measure import decode

    wall = {n: statistics.median(decode(model, prompt, n, compiled=config).seconds for _ in range(3))
            for n in (1, steps + 1)}
    return (wall[steps + 1] - wall[1]) * 1e3 / steps


def _gpu(model, prompt, config, steps: int = 8) -> dict:
    """The GPU kernels of the decode steps of a profiled (steps + 1)-token generate. Kernels are split into
    bursts at host gaps (> 30 µs idle); the ``steps`` longest bursts are the steps' graph replays: per step the
    median summed kernel µs (busy), first-start to last-end µs (span) and kernel count."""
    from moekit.bench.hf_measure import decode

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        decode(model, prompt, steps + 1, compiled=config)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:  # no CUDA activity (a CPU smoke run)
        return dict(busy_us=None, span_us=None, kernels=0)
    bursts, current = [], []
    for start, end in kernels:
        if current and start - current[-1][1] > 30:
            bursts.append(current)
            current = []
        current.append((start, end))
    bursts.append(current)
    bursts = sorted(bursts, key=lambda b: -sum(e - s for s, e in b))[:steps]
    busy = statistics.median(sum(e - s for s, e in b) for b in bursts)
    span = statistics.median(b[-1][1] - b[0][0] for b in bursts)
    count = statistics.median(len(b) for b in bursts)
    return dict(busy_us=round(busy, 1), span_us=round(span, 1), kernels=count)


def _register_ab() -> None:
    """The A/B experts implementations (see the module docstring)."""
    from transformers.integrations.moe import ExpertsInterface

    import moekit.experts.triton  # noqa: F401  (defines torch.ops.moekit.triton_experts)
    import moekit.hf
    from moekit.activations import spec_fields
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.hf.variants import PLAN_ATTR

    def make(options: tuple):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            plan = self.__dict__[PLAN_ATTR]
            return torch.ops.moekit.triton_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index,
                                                   top_k_weights, None, None, None, *spec_fields(plan.activation),
                                                   *options)
        return forward

    def previous(self, hidden_states, top_k_index, top_k_weights):  # before the traced entry: call_backend traced
        from moekit.experts import backend_fn, call_backend

        plan = self.__dict__[PLAN_ATTR]
        return call_backend(backend_fn(moekit.hf.HF_BACKEND, hidden_states.device), hidden_states, self.gate_up_proj,
                            self.down_proj, top_k_index, top_k_weights, activation=plan.activation)

    ExpertsInterface.register("ab_prev", previous)
    ExpertsInterface.register("ab_op", make(LaunchOptions().as_op_args()))
    ExpertsInterface.register("ab_nopdl", make(LaunchOptions(dependent_launch=False).as_op_args()))


def _guard_us(kept: list) -> list:
    """µs per evaluation of each compiled frame's guards (``profile_guard_manager``: 100 evaluations, each after a
    cache flush, so an upper bound of a hot step's), on its compile-time locals."""
    from torch._dynamo.guards import profile_guard_manager

    torch.set_grad_enabled(False)  # generate's mode: the guards check it
    out = []
    for manager, scope in kept:
        ok = bool(manager.check(scope))
        out.append(dict(passes=ok, us=round(profile_guard_manager(manager.root, scope, 100), 2)))
    torch.set_grad_enabled(True)
    return out


def _compile_all(model, model_name: str, layers: int, impls: list, prompt, config, deadline: float, current: list,
                 log, save) -> dict:
    """Each implementation compiled and warmed in turn (two 9-token generates); its row, with its step logits against
    the first implementation's. ``current[0]``: the implementation being compiled (the guard hook's label)."""
    import moekit.hf
    from moekit.bench.hf_measure import decode, rel_err

    rows, first = {}, None
    for impl in impls:
        if time.monotonic() > deadline:
            log(f"deadline: {model_name} {impl} not compiled")
            continue
        current[0] = impl
        model.set_experts_implementation(impl)
        moekit.hf.prepare(model)
        try:
            for _ in range(2):
                dec = decode(model, prompt, 9, compiled=config, keep_logits=True)
        except Exception as err:  # noqa: BLE001 (recorded: the row says why)
            rows[impl] = dict(impl=impl, model=model_name, layers=layers, error=f"{type(err).__name__}: {err}"[:800])
            log(f"{model_name} {impl}: {rows[impl]['error']}")
            continue
        row = rows[impl] = dict(impl=impl, model=model_name, layers=layers, steps_ms=[])
        logits, tokens = dec.logits.float(), dec.tokens
        if first is None:
            first = (impl, logits, tokens)
        else:
            row["logits"] = dict(vs=first[0], rel_err=rel_err(logits, first[1].to(logits.device)),
                                 bit_equal=bool(torch.equal(logits, first[1].to(logits.device))),
                                 same_tokens=bool(torch.equal(tokens, first[2].to(tokens.device))))
        log(f"{model_name} {impl}: compiled and warm, logits {row.get('logits', 'first')}")
        save(list(rows.values()))
    return rows


def measure(model_name: str, layers: int, impls: list, rounds: int, deadline: float, log, save) -> list:
    """Every implementation of ``impls`` compiled in turn on one model, then ``rounds`` interleaved timing rounds;
    an implementation whose compile would start past ``deadline`` (time.monotonic) is skipped. ``save(rows)``
    after each phase: a run killed midway keeps what it measured."""
    import torch._dynamo.guards as dynamo_guards

    from moekit.bench.hf_measure import compile_config
    from moekit.bench.hf_models import build_model, hf_config, register_no_experts

    kept = {}  # impl -> [(guard manager, a copy of the frame's locals)] of its compiled frames
    current = [None]
    dynamo_guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: kept.setdefault(
        current[0], []).append((manager, {k: dict(v) if isinstance(v, dict) else v for k, v in scope.items()}))
    register_no_experts()
    _register_ab()
    torch._dynamo.reset()
    model = build_model(hf_config(model_name, layers), torch.bfloat16, DEV)
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(1, 32000, (1, 8), generator=gen).to(DEV)
    config = compile_config(DEV)
    rows = _compile_all(model, model_name, layers, impls, prompt, config, deadline, current, log, save)
    timed = [impl for impl in impls if "steps_ms" in rows.get(impl, {})]
    for rnd in range(rounds):
        for impl in timed[rnd % len(timed):] + timed[:rnd % len(timed)]:
            model.set_experts_implementation(impl)
            rows[impl]["steps_ms"].append(round(_step_ms(model, prompt, config), 4))
        log(f"{model_name} round {rnd + 1}: " + ", ".join(f"{i} {rows[i]['steps_ms'][-1]}" for i in timed))
        save(list(rows.values()))
    for impl in timed:
        row = rows[impl]
        row["step_ms"] = round(statistics.median(row["steps_ms"]), 4)
        model.set_experts_implementation(impl)
        row["gpu"] = _gpu(model, prompt, config)
        row["guard_us"] = _guard_us(kept.get(impl, []))
        log(f"{model_name} {impl}: step {row['step_ms']} ms, GPU {row['gpu']}, guards {row['guard_us']}")
        save(list(rows.values()))
    del model
    torch.cuda.empty_cache()
    return [rows[impl] for impl in impls if impl in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3", "mixtral"])
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the bench's, Qwen3 8, Mixtral 2)")
    parser.add_argument("--impls", nargs="+", default=["moekit", "ab_prev", "grouped_mm"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=100, help="seconds: compile nothing past it")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", ""))
    args = parser.parse_args()
    from moekit.bench.hf_models import MODELS

    start, results = time.monotonic(), []
    log = lambda msg: print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)  # noqa: E731

    def save(rows: list) -> None:
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "hf_compiled_check.json"), "w") as f:
                json.dump(results + rows, f, indent=1)

    for model_name in args.models:
        layers = args.layers or MODELS[model_name].default_layers
        results += measure(model_name, layers, args.impls, args.rounds, start + args.deadline, log, save)
        save([])
    print("\nmodel    impl         layers  step ms (rounds)                      GPU busy/span µs (kernels)  guard µs  "
          "logits")
    for row in results:
        gpu = row.get("gpu")
        gpu = "-" if gpu is None else f"{gpu['busy_us']}/{gpu['span_us']} ({gpu['kernels']})"
        guard = "/".join(f"{g['us']}" + ("" if g["passes"] else "!") for g in row.get("guard_us", []))
        lg = row.get("logits")
        lg = "-" if lg is None else f"vs {lg['vs']} {lg['rel_err']:.2e} bit={lg['bit_equal']} tok={lg['same_tokens']}"
        steps = row.get("error") or f"{row.get('step_ms')} {row.get('steps_ms')}"
        print(f"{row['model']:8s} {row['impl']:12s} {row['layers']:6d}  {steps:36s}  {gpu:26s}  {guard:8s}  {lg}")


if __name__ == "__main__":
    main()
