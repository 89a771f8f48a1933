"""Why compiled transformers decode costs more per step than its kernels (issue 13): for each experts
implementation, a Qwen3-MoE model at Qwen3-30B-A3B widths (1 and 8 layers, random weights, bf16) decodes
through ``generate`` with the static cache and transformers' compile config ("reduce-overhead": CUDA
graphs), and this prints the wall ms per decode step, what torch.compile counted (graph breaks, CUDA
graph skips and re-recordings) and the CPU ops that take the host time of one step.

    PYTHONPATH=$PWD python benchmarks/hf_compiled_check.py [--layers 1 8] [--impls moekit grouped_mm no_experts]

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


def child(impl: str, layers: int, top: int) -> dict:
    from torch._dynamo.utils import counters

    import moekit.hf  # noqa: F401  (registers "moekit")
    from moekit.bench.hf_measure import compile_config, decode
    from moekit.bench.hf_models import build_model, hf_config, register_no_experts

    register_no_experts()
    model = build_model(hf_config("qwen3", layers), torch.bfloat16, DEV)
    model.set_experts_implementation(impl)
    prompt = torch.randint(1, 32000, (1, 8), device=DEV)
    config = compile_config(DEV)
    for _ in range(2):
        decode(model, prompt, 9, compiled=config)
    counters.clear()
    step = _step_ms(model, prompt, config)
    seen = {group: dict(values) for group, values in counters.items() if values}
    return dict(impl=impl, layers=layers, step_ms=round(step, 4), counters=seen,
                host_ops=_host_ops(model, prompt, config), gpu_kernels=_gpu_kernels(model, prompt, config, top))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--impls", nargs="+", default=["moekit", "grouped_mm", "no_experts"])
    parser.add_argument("--top", type=int, default=14, help="GPU kernels listed per implementation")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "LAYERS"))
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], int(args.child[1]), args.top)), flush=True)
        return
    results = []
    for layers in args.layers:
        for impl in args.impls:
            env = dict(os.environ, TORCH_LOGS="perf_hints,graph_breaks,recompiles")
            run = subprocess.run([sys.executable, __file__, "--child", impl, str(layers), "--top", str(args.top)], env=env,
                                 capture_output=True, text=True, timeout=150)
            lines = run.stdout.splitlines()
            found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
            logs = [line for line in run.stderr.splitlines() if "cudagraph" in line.lower()
                    or "graph break" in line.lower() or "recompil" in line.lower()]
            res = found[0] if found else dict(impl=impl, layers=layers, error=run.stderr[-1500:])
            res["logs"] = logs[:20]
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != 'gpu_kernels'}, indent=1)[:3000], flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hf_compiled_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\nimpl         layers  step ms  GPU µs/step")
    for res in results:
        gpu = res.get("gpu_kernels", {}).get("total_us", "-")
        print(f"{res['impl']:12s} {res['layers']:6d}  {res.get('step_ms', 'error')}  {gpu}")
        for name, us, count in res.get("gpu_kernels", {}).get("top", []):
            print(f"    {us:8.1f} µs  x{count:<6} {name}")


if __name__ == "__main__":
    main()
