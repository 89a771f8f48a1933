"""usr44: a fused-shared layer quantized on the GPU (``quantize_`` un-fuses its shared expert), ``moekit train``'s
CUDA default, and the host cost of ``QuantizedWeight.dequantize``'s dtype check. No kernel changed.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/usr44_device_check.py --out $OUT/usr44 --deadline 60   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/usr44_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/usr44.json rewritten after each):
  correct   a DeepSeek-V3-routed layer (E = 64, K = 2048, N = 512, k = 8, one shared slot, bf16, backend "auto": the
            Triton kernels) built with ``fuse_shared=True`` and quantized with each scheme, against the same weights
            built ``fuse_shared=False`` and quantized alike (the workaround before: rel-L2 PASS < 1e-6, bit equality
            reported) and against the reference backend on the same quantized weights (PASS < 2e-2, bf16).
  train     ``python -m moekit train`` at tiny sizes (3 steps) with no ``--device``: its first line names cuda (the
            default with a GPU present), it exits 0; its seconds logged (a cold Triton cache compiles in them).
  layer     forward host / wall µs, fused-then-quantized vs built-unfused-and-quantized (fp8_block, int4_w4a16; M = 1
            and 64), 5 interleaved rounds: the same computation, so no difference is expected.
  dequant   ``dequantize(bf16)`` (the dtype check, then the scheme's body) vs the body alone (``_dequantize``: the
            call before), int4 and mxfp4 [64, 1024, 2048], host / wall µs, 5 interleaved rounds: grouped_mm's
            dequantizing path calls it once a weight a forward.
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, host_and_wall_us, rel_l2, run_info, run_phases  # noqa: E402

import moekit.quant as Q  # noqa: E402
from moekit import MoE, MoEConfig  # noqa: E402

ROUNDS = 2 if SMOKE else 5
E, K, N, TOP_K = (16, 64, 32, 4) if SMOKE else (64, 2048, 512, 8)
MS = (1, 5) if SMOKE else (1, 64)
CONFIG = MoEConfig.preset("deepseek-v3").replace(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K,
                                                 n_group=4, topk_group=2, shared_expert_intermediate_size=N)
RUN = RunLog("usr44: fused-shared layers quantized, train's device, dequantize's check (µs a call, medians of "
             "interleaved rounds)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"train": 25, "layer": 10, "dequant": 6}  # a phase starts only this long before the deadline (s)


def layers(scheme: str, dev) -> tuple[MoE, MoE]:
    """(built fused then quantized, built unfused with the same weights then quantized), bf16 on ``dev``."""
    torch.manual_seed(0)
    fused = MoE(CONFIG, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        fused.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
    twin = MoE(CONFIG, fuse_shared=False, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():  # one shared slot: its w13 row block is [gate N; up N] as shared_w13, w2 [K, N] as shared_w2
        twin.gate.weight.copy_(fused.gate.weight)
        twin.e_score_correction_bias.copy_(fused.e_score_correction_bias)
        twin.w13.copy_(fused.w13[:E])
        twin.w2.copy_(fused.w2[:E])
        twin.shared_w13.copy_(fused.w13[E])
        twin.shared_w2.copy_(fused.w2[E])
    return fused.quantize_(scheme), twin.quantize_(scheme)


def correct_phase(dev) -> None:
    res = RESULT["correct"] = {}
    for scheme in Q.SCHEMES:
        fused, twin = layers(scheme, dev)
        RUN.check(f"{scheme}: un-fused by quantize_", not fused.fuse_shared and fused.shared_w13 is not None)
        for m in MS:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dev, torch.bfloat16)
            with torch.no_grad():
                got, want = fused(x), twin(x)
                fused.backend = "reference"
                ref = fused(x)
                fused.backend = "auto"
            cell = res[f"{scheme} M={m}"] = {"bit_equal": torch.equal(got, want), "vs_twin": rel_l2(got, want),
                                             "vs_reference": rel_l2(got, ref), "backend": fused.resolved_backend()}
            RUN.check(f"{scheme} M={m} fused-then-quantized vs the unfused twin", cell["vs_twin"] < 1e-6,
                      f"rel_l2={cell['vs_twin']:.2e}, bit_equal={cell['bit_equal']}, backend={cell['backend']}")
            RUN.check(f"{scheme} M={m} vs the reference backend", cell["vs_reference"] < 2e-2,
                      f"rel_l2={cell['vs_reference']:.2e}")


def train_phase(dev) -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "moekit", "train", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                "--d-model", "16", "--layers", "1", "--expert-size", "8", "--no-plot", "--out", out]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - start
    first = (done.stdout.splitlines() or [""])[0]
    RESULT["train"] = {"first_line": first, "returncode": done.returncode, "s": round(took, 1),
                       "stderr_tail": done.stderr[-800:]}
    RUN.check("moekit train's first line names the default device", first == f"moekit train on {want}: 3 steps x 3 "
              "runs", repr(first))
    RUN.check("moekit train exits 0", done.returncode == 0,  # the time: a cold Triton cache compiles in it
              f"rc={done.returncode}, {took:.1f} s{'' if done.returncode == 0 else ': ' + done.stderr[-300:]}")


def table_row(phase: str, name: str, got: dict, new: str, old: str) -> None:
    med = statistics.median
    host_new, host_old = got[new][0], got[old][0]
    RUN.summary.append(f"| {phase} | {name} | {med(host_new):.1f} / {med(host_old):.1f} | {med(got[new][1]):.1f} / "
                       f"{med(got[old][1]):.1f} | " + " ".join(f"{a / b:.2f}" for a, b in zip(host_new, host_old))
                       + f" | {wins(host_new, host_old)} / {wins(host_old, host_new)} |")


def layer_phase(dev) -> None:
    res = RESULT["layer_us"] = {}
    for scheme in ("fp8_block", "int4_w4a16"):
        fused, twin = layers(scheme, dev)
        for m in MS:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dev, torch.bfloat16)
            fns = {"fused, quantized": lambda x=x: fused(x), "unfused, quantized": lambda x=x: twin(x)}
            with torch.no_grad():
                for fn in fns.values():
                    fn()
                got = host_and_wall_us(fns, dev, 2 if SMOKE else 50, ROUNDS)
            res[f"{scheme} M={m}"] = got
            table_row("layer", f"{scheme} M={m}: fused then quantized vs built unfused", got, "fused, quantized",
                      "unfused, quantized")
        RUN.log(f"layer: {scheme} timed")


def dequant_phase(dev) -> None:
    res = RESULT["dequant_us"] = {}
    shape = (4, 64, 128) if SMOKE else (64, 1024, 2048)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    for scheme in ("int4_w4a16", "mxfp4"):
        qw = Q.quantize(w, scheme)
        fns = {"dequantize": lambda qw=qw: qw.dequantize(torch.bfloat16),
               "_dequantize": lambda qw=qw: qw._dequantize(torch.bfloat16)}
        RUN.check(f"{scheme}: dequantize bit-equal to the body alone",
                  torch.equal(fns["dequantize"](), fns["_dequantize"]()))
        got = res[scheme] = host_and_wall_us(fns, dev, 2 if SMOKE else 20, ROUNDS)
        table_row("dequant", f"{scheme} {list(shape)}: with the check vs the body alone", got, "dequantize",
                  "_dequantize")


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"correct": lambda: correct_phase(dev), "train": lambda: train_phase(dev),
              "layer": lambda: layer_phase(dev), "dequant": lambda: dequant_phase(dev)}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="directory for usr44.json (none: no file)")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds; a phase past it is skipped")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreted")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=tuple(phases),
                   help="comma-separated, of " + ", ".join(phases))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, K, N, TOP_K], "phases": ARGS.phases}
    RUN.summary.append("| phase | cell | host µs new / old | wall µs new / old | new / old per round | "
                       "rounds >= 3% faster / slower |\n|---|---|---|---|---|---|")
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, NEEDS_S,
                      ARGS.out and os.path.join(ARGS.out, "usr44.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
