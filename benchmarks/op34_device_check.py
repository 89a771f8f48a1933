"""op34: the host cost of a custom op's dispatch on the GPU's host, per call (session 34, the CPU side merged:
``moekit.experts.op_library``). Nothing here changes a GPU default; the figures say what registering the GPU ops
the same way would save per layer of a compiled decode (moekit::triton_experts is still a ``custom_op``).

    PYTHONPATH=$PWD timeout 70 python3 benchmarks/op34_device_check.py --out $OUT/op34 --deadline 55   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/op34_device_check.py --smoke       # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/op34.json rewritten after each):
  dispatch  a kernel that only returns zeros [M, K], on the device's tensors, under ``no_grad``, registered
            four ways: triton_experts' 33-argument schema as a ``custom_op`` with ``register_autograd`` (how
            moekit::triton_experts is registered), through ``torch.library.Library`` with ``register_autograd``,
            and without an autograd kernel (``op_library.define_inference_op``); cpu_experts' 19 arguments as a
            custom_op (before) and through op_library (now). ``torch.library.opcheck`` on each (PASS/FAIL); host
            µs a call, 5 interleaved rounds (medians; each call queued behind ~1 ms of GPU work).
  op        the Qwen3-30B-A3B decode call (M = 1, k = 8, E = 128, bf16, the default LaunchOptions):
            ``torch.ops.moekit.triton_experts`` (what a compiled graph calls), its kernel called directly (no
            dispatch), a ``torch.compile``d function around the op; each against grouped_mm's twin (rel-L2 PASS
            < 1e-2) and bit-equal to the kernel; host µs (queued) and wall µs a call, 5 interleaved rounds.
The table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, host_and_wall_us, rel_l2, run_info, write_json  # noqa: E402

ROUNDS = 2 if SMOKE else 5
E, N, K, TOP_K = (8, 32, 64, 2) if SMOKE else (128, 768, 2048, 8)
RUN = RunLog("op34: custom op dispatch on the device's host (µs a call, medians of interleaved rounds)", stall_s=40)
RESULT: dict = {"run": {}, "failed": RUN.failed}



def host_us(fns: dict, dev, calls: int) -> dict:
    """``bench_run.host_and_wall_us`` over this check's rounds."""
    return host_and_wall_us(fns, dev, calls, ROUNDS)


def report(label: str, samples: dict) -> None:
    """Medians into the table and the JSON."""
    RESULT[label] = samples
    for name, (host, wall) in samples.items():
        RUN.summary.append(f"| {label} | {name} | {statistics.median(host):.1f} | {statistics.median(wall):.1f} | "
                           + " ".join(f"{v:.1f}" for v in host) + " |")


def dispatch_phase(dev) -> None:
    import op34_registrations as regs

    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    ops = regs.registered()
    args = {name: regs.args_for(name, x) for name in ops}
    for name, op in ops.items():
        failed = torch.library.opcheck(op, args[name], raise_exception=False)
        RUN.check(f"opcheck {name}", all(v == "SUCCESS" for v in failed.values()), str(failed))
    with torch.no_grad():
        fns = {name: (lambda op=op, a=args[name]: op(*a)) for name, op in ops.items()}
        report("dispatch", host_us(fns, dev, 200 if SMOKE else 2000))


def op_phase(dev) -> None:
    from moekit.activations import ActivationSpec, spec_fields
    from moekit.experts.grouped_mm import experts_grouped_mm
    from moekit.experts.triton_op import _DEFAULT_OP_ARGS, _experts_op

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=g).to(dev, torch.bfloat16)  # [M, K]
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dev, torch.bfloat16)  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dev, torch.bfloat16)  # [E, K, N]
    ids = torch.randperm(E, generator=g)[:TOP_K].view(1, TOP_K).to(dev)  # [M, k]
    weights = torch.softmax(torch.randn(1, TOP_K, generator=g), dim=1).to(dev)  # [M, k]
    args = (x, w13, w2, ids, weights, None, None, None, *spec_fields(ActivationSpec()), *_DEFAULT_OP_ARGS)
    op = torch.ops.moekit.triton_experts.default
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    fns = {"op": lambda: op(*args), "kernel": lambda: _experts_op._init_fn(*args),
           "compiled op": lambda: compiled(*args)}
    with torch.no_grad():
        twin = experts_grouped_mm(x, w13, w2, ids, weights)
        outs = {name: fn() for name, fn in fns.items()}
        for name, out in outs.items():
            err = rel_l2(out, twin)
            RUN.check(f"{name} vs grouped_mm", err < 1e-2 and torch.equal(out, outs["kernel"]),
                      f"rel_l2={err:.2e}, bit-equal to the kernel: {torch.equal(out, outs['kernel'])}")
        report("op", host_us(fns, dev, 20 if SMOKE else 500))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=55.0)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K]}
    RUN.summary.append("| phase | variant | host µs | wall µs | host µs per round |\n|---|---|---|---|---|")
    for name, phase in (("dispatch", dispatch_phase), ("op", op_phase)):
        RUN.each_cell([name], lambda _, phase=phase: phase(dev), a.deadline)
        RUN.log(f"{name} done")
        if a.out:
            write_json(os.path.join(a.out, "op34.json"), RESULT)
    RUN.print_table()


if __name__ == "__main__":
    main()
