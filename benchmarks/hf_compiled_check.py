"""Why compiled transformers decode costs more per step than its kernels (issue 13): for each experts
implementation, a Qwen3-MoE model at Qwen3-30B-A3B widths (1 and 8 layers, random weights, bf16) decodes
through ``generate`` with the static cache and transformers' compile config ("reduce-overhead": CUDA
graphs), and this prints the wall ms per decode step, what torch.compile counted (graph breaks, CUDA
graph skips and re-recordings) and the CPU ops that take the host time of one step.

    PYTHONPATH=$PWD python benchmarks/hf_compiled_check.py [--models qwen3 mixtral] [--layers 8]
        [--impls moekit grouped_mm no_experts ab_op ab_nopdl] [--deadline SECONDS]

A/B variants of moekit's compiled path (registered here as experts implementations, benchmark only):
``ab_op`` calls the custom op straight from the experts forward (none of moekit's Python traced: no
guards on it), ``ab_nopdl`` does the same with programmatic dependent launch off, ``ab_prev`` is the
"moekit" forward before its traced entry (``call_backend`` and the backend's eager path traced). ``guard_us``: dynamo's
guard evaluation of the compiled decode step (``profile_guard_manager``, 200 rounds, warm caches).
``logits``: the compiled decode's step logits against the first implementation's in the same model
(rel. error and bit-equality; every moekit variant runs the same kernels, so bit-equal is expected).

``gpu_kernels`` in each result: the GPU kernels of one compiled decode step (CUDA activity of a 9-token
generate less a 1-token one, per step), by total µs: what the step's CUDA-graph replay spends, experts included.

Each implementation runs in its own process (a fresh torch.compile state); JSON to $OUT if set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

DEV = torch.device("cuda")


def _step_ms(model, prompt, config, steps: int = 8) -> float:
    from moekit.bench.hf_measure import decode

    wall = {n: statistics.median(decode(model, prompt, n, compiled=config).seconds for _ in range(3))
            for n in (1, steps + 1)}
    return (wall[steps + 1] - wall[1]) * 1e3 / steps


def _host_ops(model, prompt, config, top: int = 12) -> list:
    """The CPU-side ops of a 9-token generate, by self CPU time, per decode step."""
    from moekit.bench.hf_measure import decode

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(model, prompt, 9, compiled=config)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key[:90], round(e.self_cpu_time_total / 8, 1), round(e.count / 8, 2)) for e in rows]


def _kernel_us(model, prompt, config, tokens: int) -> dict[str, tuple[float, int]]:
    """GPU kernels of a ``tokens``-token generate (CUDA activity): name -> (total µs, count)."""
    from moekit.bench.hf_measure import decode

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        decode(model, prompt, tokens, compiled=config)
    return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def _gpu_kernels(model, prompt, config, top: int) -> dict:
    """GPU µs per decode step: a 9-token generate's kernels less a 1-token one's (the prompt's prefill and
    the first step cancel), over the 8 steps between; all kernels, and the ``top`` by time (name, µs, count)."""
    nine, one = _kernel_us(model, prompt, config, 9), _kernel_us(model, prompt, config, 1)
    steps = {name: ((us - one.get(name, (0.0, 0))[0]) / 8, (n - one.get(name, (0.0, 0))[1]) / 8)
             for name, (us, n) in nine.items()}
    rows = sorted(steps.items(), key=lambda kv: -kv[1][0])
    return dict(total_us=round(sum(us for us, _ in steps.values()), 1),
                top=[(name[:80], round(us, 1), round(n, 2)) for name, (us, n) in rows[:top]])


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
    """µs per evaluation of each compiled frame's guards (200 rounds, median of 5), on its compile-time locals."""
    from torch._dynamo.guards import profile_guard_manager

    torch.set_grad_enabled(False)  # generate's mode: the guards check it
    out = []
    for manager, scope in kept:
        ok = bool(manager.check(scope))
        times = sorted(profile_guard_manager(manager.root, scope, 200) for _ in range(5))
        out.append(dict(passes=ok, us=round(times[2], 2)))
    torch.set_grad_enabled(True)
    return out


def child(impl: str, model_name: str, layers: int, top: int, out_dir: str) -> dict:
    import torch._dynamo.guards as dynamo_guards
    from torch._dynamo.utils import counters

    import moekit.hf  # noqa: F401  (registers "moekit")
    from moekit.bench.hf_measure import compile_config, decode, rel_err
    from moekit.bench.hf_models import build_model, hf_config, register_no_experts

    kept = []  # (guard manager, a copy of the frame's locals) of each compiled frame
    dynamo_guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: kept.append(
        (manager, {k: dict(v) if isinstance(v, dict) else v for k, v in scope.items()}))
    register_no_experts()
    _register_ab()
    model = build_model(hf_config(model_name, layers), torch.bfloat16, DEV)
    model.set_experts_implementation(impl)
    if impl.startswith("ab_"):
        moekit.hf.prepare(model)
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(1, 32000, (1, 8), generator=gen).to(DEV)
    config = compile_config(DEV)
    for _ in range(2):
        dec = decode(model, prompt, 9, compiled=config, keep_logits=True)
    res = dict(impl=impl, model=model_name, layers=layers)
    ref_path = os.path.join(out_dir, f"ref_{model_name}_{layers}.pt") if out_dir else None
    if ref_path and os.path.exists(ref_path):
        ref = torch.load(ref_path)
        res["logits"] = dict(rel_err_vs_first=rel_err(dec.logits, ref["logits"]),
                             bit_equal=bool(torch.equal(dec.logits, ref["logits"])),
                             same_tokens=bool(torch.equal(dec.tokens.cpu(), ref["tokens"])))
    elif ref_path:
        torch.save(dict(logits=dec.logits.cpu(), tokens=dec.tokens.cpu(), impl=impl), ref_path)
    counters.clear()
    res["step_ms"] = round(_step_ms(model, prompt, config), 4)
    res["counters"] = {group: dict(values) for group, values in counters.items() if values}
    res["guard_us"] = _guard_us(kept)
    res["host_ops"] = _host_ops(model, prompt, config)
    res["gpu_kernels"] = _gpu_kernels(model, prompt, config, top)
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3", "mixtral"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the bench's, Qwen3 8, Mixtral 2)")
    parser.add_argument("--impls", nargs="+", default=["moekit", "grouped_mm", "no_experts", "ab_op", "ab_nopdl"])
    parser.add_argument("--top", type=int, default=14, help="GPU kernels listed per implementation")
    parser.add_argument("--deadline", type=float, default=270, help="seconds: start no child past it")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODEL", "LAYERS"))
    parser.add_argument("--out-dir", default=os.environ.get("OUT", ""))
    args = parser.parse_args()
    if args.child:
        res = child(args.child[0], args.child[1], int(args.child[2]), args.top, args.out_dir)
        print("RESULT " + json.dumps(res), flush=True)
        return
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    start, results = time.monotonic(), []
    from moekit.bench.hf_models import MODELS

    for model_name in args.models:
        layers = args.layers or MODELS[model_name].default_layers
        for impl in args.impls:
            left = args.deadline - (time.monotonic() - start)
            if left < 25:
                print(f"deadline: {model_name} {impl} not run", flush=True)
                continue
            env = dict(os.environ, TORCH_LOGS="perf_hints,graph_breaks,recompiles")
            cmd = [sys.executable, __file__, "--child", impl, model_name, str(layers), "--top", str(args.top),
                   "--out-dir", args.out_dir]
            try:
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
                stdout, stderr = run.stdout, run.stderr
            except subprocess.TimeoutExpired as err:
                stdout, stderr = err.stdout or "", f"timeout after {left:.0f} s"
                stdout = stdout if isinstance(stdout, str) else stdout.decode()
            found = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
            logs = [line for line in stderr.splitlines() if "cudagraph" in line.lower()
                    or "graph break" in line.lower() or "recompil" in line.lower()]
            res = found[0] if found else dict(impl=impl, model=model_name, layers=layers, error=stderr[-1500:])
            res["logs"] = logs[:20]
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k not in ("gpu_kernels", "host_ops")}, indent=1)[:2500],
                  flush=True)
            if args.out_dir:
                with open(os.path.join(args.out_dir, "hf_compiled_check.json"), "w") as f:
                    json.dump(results, f, indent=1)
    for res in results:
        print(f"\n{res['model']} {res['impl']}: GPU kernels per step (µs, count)")
        for name, us, count in res.get("gpu_kernels", {}).get("top", []):
            print(f"    {us:8.1f} µs  x{count:<6} {name}")
    print("\nmodel    impl         layers  step ms   GPU µs/step  guard µs  logits vs first")
    for res in results:
        gpu = res.get("gpu_kernels", {}).get("total_us", "-")
        guard = "/".join(str(g["us"]) + ("" if g["passes"] else "!") for g in res.get("guard_us", []))
        lg = res.get("logits")
        lg = "-" if lg is None else f"{lg['rel_err_vs_first']:.2e} bit={lg['bit_equal']} tok={lg['same_tokens']}"
        print(f"{res['model']:8s} {res['impl']:12s} {res['layers']:6d}  {res.get('step_ms', 'error')!s:8s}  "
              f"{gpu!s:11s}  {guard:8s}  {lg}")


if __name__ == "__main__":
    main()
