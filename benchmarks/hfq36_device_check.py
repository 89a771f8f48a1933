"""hfq36: transformers' fine-grained fp8 experts (``moekit bench --hf --hf-quant fp8``'s model) on the GPU, correct
before they are timed: moekit's fp8 path on ``FP8Experts``' own tensors, and which of transformers' fp8
implementations run here at all (they need its hub kernels; this machine is offline).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/hfq36_device_check.py --out $OUT/hfq36check --deadline 70  # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/hfq36_device_check.py --smoke     # CPU: tiny widths (moekit's reference backend)

Phases (each skipped past the deadline; <out>/hfq36.json rewritten after each):
  model     Qwen3-30B-A3B widths (E = 128, K = 2048, N = 768, k = 8), 2 layers, bf16, quantized by
            ``moekit.bench.hf_quant.quantize_experts_fp8`` (transformers' replace_with_fp8_linear + Fp8Quantize):
            every experts module an FP8Experts with e4m3 weights and float32 128 x 128 scales.
  calls     one experts call at M = 1, 64 and 1024 (random bf16 x, random top-8): "moekit" through
            FP8ExpertsInterface against moekit's torch twin of the recipe in float64 on the same tensors (rel-L2
            PASS < 1e-2: bf16 output); each of transformers' fp8 implementations (eager, grouped_mm, batched_mm,
            deepgemm) the same where it runs (PASS < 3e-2), else "UNAVAILABLE" with its error (neither pass nor fail);
            µs a call (wall, median of 5 interleaved rounds) of each that ran.
  logits    the model's prefill logits (1 x 256) through "moekit" against the stored weights run in float64
            (``hf_fp64``, the bench's reference; no activation rounding): PASS < 3e-2.
The table is printed last. The timed comparison is ``moekit bench --hf --hf-quant fp8`` (the real client).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub kernel that is not cached fails here, it does not download

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, host_and_wall_us, rel_l2, run_info, run_phases  # noqa: E402

from moekit.bench.hf_fp64 import Float64Model  # noqa: E402
from moekit.bench.hf_models import build_model, hf_config, select_impls  # noqa: E402
from moekit.bench.hf_quant import FP8_TINY, quantize_experts_fp8  # noqa: E402

LAYERS, ROUNDS = 2, 5
MS = (1, 5) if SMOKE else (1, 64, 1024)
PREFILL = 16 if SMOKE else 256
TOL_MOEKIT, TOL_TRANSFORMERS, TOL_LOGITS = 1e-2, 3e-2, 3e-2
RUN = RunLog("hfq36: transformers' fp8 experts (rel-L2 vs moekit's float64 twin; wall µs a call, median of rounds)",
             stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed, "calls": {}, "logits": {}}
ARGS = argparse.Namespace()
NEEDS_S = {"calls": 20, "logits": 10}  # a phase starts only this long before the deadline (s)


def build(dev: torch.device):
    """The 2-layer fp8 Qwen3 (bf16 on CUDA; the smoke's tiny widths in float32 on the CPU)."""
    config = hf_config("qwen3", LAYERS, tiny=SMOKE)
    if SMOKE:
        config.update(FP8_TINY["qwen3"])
    model = build_model(config, torch.float32 if SMOKE else torch.bfloat16, dev)
    quantize_experts_fp8(model)
    return model


def model_phase(model) -> None:
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    ok = len(experts) == LAYERS and all(
        type(m).__name__ == "FP8Experts" and m.gate_up_proj.dtype == m.down_proj.dtype == torch.float8_e4m3fn
        and m.gate_up_proj_scale_inv.dtype == torch.float32 and tuple(m.block_size) == (128, 128) for m in experts)
    RUN.check("every experts module FP8Experts, e4m3, float32 128x128 scales", ok,
              f"{len(experts)} modules, {type(experts[0]).__name__}")


def _inputs(experts, m: int, dev: torch.device):
    """x [M, K], top_k_index [M, k] (distinct experts a token), top_k_weights [M, k] (softmax-like, sum 1)."""
    g = torch.Generator(device="cpu").manual_seed(m)
    e, k = experts.num_experts, experts.config.num_experts_per_tok
    dtype = torch.float32 if SMOKE else torch.bfloat16
    x = torch.randn(m, experts.hidden_dim, generator=g).to(dev, dtype)
    ids = torch.rand(m, e, generator=g).argsort(-1)[:, :k].to(dev)
    w = torch.rand(m, k, generator=g).softmax(-1).to(dev, dtype)
    return x, ids, w


def calls_phase(model, dev: torch.device) -> None:
    from moekit.quant import experts_fp8_block_reference
    from moekit.quant.hf import fp8_experts_weights

    experts = next(m for n, m in model.named_modules() if n.endswith(".experts"))
    w13, w2 = fp8_experts_weights(experts)
    impls = select_impls(None, "fp8")  # eager (FP8Experts' loop), moekit, grouped_mm, batched_mm, deepgemm
    for m in MS:
        x, ids, w = _inputs(experts, m, dev)
        ref = experts_fp8_block_reference(x.double(), w13, w2, ids, w.double())  # [M, K] float64
        ran = {}
        for impl in impls:
            call = functools.partial(_call, experts, impl, x, ids, w)
            try:
                with torch.no_grad():
                    out = call()
            except Exception as exc:  # noqa: BLE001 (a hub kernel this machine cannot fetch: recorded, not fatal)
                text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
                RUN.log(f"UNAVAILABLE M={m} {impl}: {text}")
                RESULT["calls"][f"{impl} M={m}"] = {"unavailable": text}
                continue
            err = rel_l2(out, ref)
            tol = TOL_MOEKIT if impl == "moekit" else TOL_TRANSFORMERS
            RUN.check(f"M={m} {impl} vs the float64 twin", err < tol, f"rel_l2={err:.2e}")
            RESULT["calls"][f"{impl} M={m}"] = {"rel_l2": err}
            ran[impl] = call
        _time(ran, m, dev)
    experts.config._experts_implementation = "moekit"


def _call(experts, impl: str, x, ids, w):
    """One experts call through ``impl`` (the module reads its config's choice at each call)."""
    experts.config._experts_implementation = impl
    return experts(x, ids, w)


def _time(ran: dict, m: int, dev: torch.device) -> None:
    if not ran:
        return
    with torch.no_grad():
        times = host_and_wall_us(ran, dev, calls=3 if SMOKE else 20, rounds=ROUNDS)
    for impl, (_, wall) in times.items():
        RESULT["calls"][f"{impl} M={m}"]["wall_us"] = wall
        RUN.summary.append(f"| M={m} | {impl} | {statistics.median(wall):.1f} | "
                           + " ".join(f"{v:.1f}" for v in wall) + " |")


def logits_phase(model, dev: torch.device) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(5)).to(dev)
    model.set_experts_implementation("moekit")
    with torch.no_grad():
        got = model(ids).logits
    ref = Float64Model(model).logits(ids)
    err = rel_l2(got, ref)
    RESULT["logits"] = {"moekit_vs_fp64": err}
    RUN.check("prefill logits through moekit vs the stored weights in float64", err < TOL_LOGITS, f"rel_l2={err:.2e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=70.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("model", "calls", "logits"))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "layers": LAYERS, "ms": list(MS), "phases": ARGS.phases}
    RUN.summary.append("| M | implementation | wall µs a call (median) | each round |\n|---|---|---|---|")
    model = build(dev)
    RUN.log("model built and quantized")
    phases = {"model": lambda: model_phase(model), "calls": lambda: calls_phase(model, dev),
              "logits": lambda: logits_phase(model, dev)}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, NEEDS_S,
                      ARGS.out and os.path.join(ARGS.out, "hfq36.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
