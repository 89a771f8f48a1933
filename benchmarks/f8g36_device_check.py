"""f8g36: moekit's fp8 experts under transformers' compiled CUDA-graph decode (CompileConfig "reduce-overhead":
cudagraph trees). Main failed there, "Detected 2 tensor(s) in the cudagraph pool not tracked as outputs": the fp8
op's body took its workspace from the reused pool, whose byte buffer and kept k-sum counters the trees' warm-up
allocated from the graph's pool and kept. The op body now takes fresh buffers (the bf16 and wo ops' rule).

    PYTHONPATH=$PWD timeout 90 python3 benchmarks/f8g36_device_check.py --out $OUT/f8g36 --deadline 80   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/f8g36_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/f8g36.json rewritten after each):
  op    Qwen3-30B-A3B fp8 experts (E = 128, K = 2048, N = 768, k = 8, 128 x 128 blocks) at M = 1: ``fused_experts_fp8``
        compiled fullgraph with inductor "reduce-overhead" (cudagraph trees), 4 calls: PASS if it runs, against the
        direct eager call (rel-L2 < 1e-3) and the torch twin (< 1e-2); an op call keeps no workspace buffer.
  fp8   ``moekit bench --hf --hf-quant fp8``'s model (Qwen3, real widths, 8 layers, bf16, transformers' FP8Experts):
        generate compiled with CompileConfig "reduce-overhead" through ``moekit`` and ``moekit_blocks``: PASS if it
        runs, step logits against eager moekit's (rel-L2 < 3e-2: bf16 rounding of the fused graph), then ms a decode
        step (median of a generate's steps), eager moekit and the compiled rows interleaved, 5 rounds.
  bf16  the same model in bf16 (no quantization), the same rows: nothing regressed there.
The table is printed last: ms a step per round, median, tok/s.
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

from bench_run import RunLog, raise_recompile_limit, rel_l2, run_generate, run_info, run_phases  # noqa: E402
from opg35_client import StepClock  # noqa: E402

ROUNDS, TOKENS = (2, 4) if SMOKE else (5, 33)
E, N, K, TOP_K = (4, 128, 128, 2) if SMOKE else (128, 768, 2048, 8)
BLOCK = (128, 128)
IMPLS = ("moekit", "moekit_blocks")  # compiled; eager moekit is the reference and timed beside them
RUN = RunLog("f8g36: fp8 experts under compiled CUDA-graph decode (ms a decode step, interleaved rounds)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"fp8": 35, "bf16": 30}  # a phase starts only this long before the deadline (s)


SEEN: list = []  # the smoke's compiled graphs: each one's moekit ops


def _recorder(gm, example_inputs, **kwargs):
    """The smoke's backend: records the graph's moekit ops, runs it as traced."""
    SEEN.append(sorted({str(n.target) for n in gm.graph.nodes if str(n.target).startswith("moekit.")}))
    return gm.forward


def _compile_mode() -> dict:
    """inductor with cudagraph trees; the smoke's backend records the graphs' moekit ops instead."""
    return {"backend": _recorder} if SMOKE else {"mode": "reduce-overhead"}


def op_phase(dev) -> None:
    from moekit.experts import triton_fp8
    from moekit.quant.fp8_block import quantize_fp8_block

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=g).to(dev, torch.bfloat16)  # [M, K]
    w13 = quantize_fp8_block((torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dev), BLOCK)  # [E, 2N, K]
    w2 = quantize_fp8_block((torch.randn(E, K, N, generator=g) * N**-0.5).to(dev), BLOCK)  # [E, K, N]
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K]]).to(dev)  # [M, k]
    weights = torch.softmax(torch.randn(1, TOP_K, generator=g), dim=1).to(dev)  # [M, k]
    args = (x, w13.q, w13.scale, w2.q, w2.scale, ids, weights)
    for w in args[1:5]:  # as a model's parameters are: cudagraph trees neither copy them nor own their memory
        torch._dynamo.mark_static_address(w)

    def fn(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights):
        return triton_fp8.fused_experts_fp8(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, block_shape=BLOCK)

    with torch.no_grad():
        eager = fn(*args)
        twin = triton_fp8.fused_experts_fp8_torch(*args, block_shape=BLOCK)
        triton_fp8._WORKSPACES.clear()  # as a new stream finds it (the trees' warm-up runs on a stream of their own)
        torch.ops.moekit.triton_experts_fp8(*args, None, *BLOCK, True, False, False)
        RUN.check("op: the op call keeps no workspace", len(triton_fp8._WORKSPACES) == 0,
                  f"{len(triton_fp8._WORKSPACES)} pool buffers")
        compiled = torch.compile(fn, fullgraph=True, **_compile_mode())
        try:
            outs = [compiled(*args).clone() for _ in range(4)]  # warm-up, record, replays
        except RuntimeError as err:
            RUN.check("op: compiled reduce-overhead runs", False, f"{type(err).__name__}: {str(err)[:200]}")
            return
    errs = [rel_l2(out, eager) for out in outs]
    RESULT["op"] = {"vs_eager": errs, "vs_twin": rel_l2(outs[-1], twin), "eager_vs_twin": rel_l2(eager, twin)}
    RUN.check("op: compiled reduce-overhead runs (4 calls)", True)
    RUN.check("op: compiled vs eager direct", max(errs) < 1e-3, f"rel_l2 max {max(errs):.2e}")
    RUN.check("op: compiled vs torch twin", RESULT["op"]["vs_twin"] < 1e-2,
              f"rel_l2={RESULT['op']['vs_twin']:.2e} (eager {RESULT['op']['eager_vs_twin']:.2e})")


def build(quant: bool, dev):
    """(model, prompt [1, 16]): the bench's Qwen3 (1 tiny layer, the triton backend interpreted, in the smoke)."""
    import moekit.experts as experts
    import moekit.hf as mh
    from moekit.bench.hf_models import build_model, hf_config
    from moekit.bench.hf_quant import FP8_TINY, quantize_experts_fp8

    if SMOKE:
        mh.HF_BACKEND = "triton"
        experts._RESOLVED.clear()
    config = hf_config("qwen3", 1 if SMOKE else 8, tiny=SMOKE)
    if SMOKE:
        config.update(FP8_TINY["qwen3"])
    model = build_model(config, torch.bfloat16, dev)
    if quant:
        quantize_experts_fp8(model)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=g).to(dev)
    return model, prompt


def generate(model, impl: str, prompt, config=None, clock=None, logits: bool = False):
    from moekit.bench.hf_models import use_impl

    use_impl(model, impl)
    return run_generate(model, prompt, TOKENS, config, clock, logits)


def step_logits(model, impl: str, prompt, config=None):
    """(tokens [T], logits [T, V] float32) of a generate through ``impl``, compiled under ``config``."""
    out = generate(model, impl, prompt, config, logits=True)
    return out.sequences[0, prompt.shape[1]:], torch.stack([s[0].float() for s in out.logits])


def agreeing_err(got: tuple, ref: tuple) -> float:
    """rel-L2 of the step logits over the steps whose inputs agree (the leading equal tokens, plus the next)."""
    same = (got[0] == ref[0]).int().cumprod(0)
    steps = min(int(same.sum()) + 1, len(same))
    return rel_l2(got[1][:steps], ref[1][:steps])


def model_phase(name: str, dev) -> None:
    """``name``: "fp8" or "bf16"; compiled rows checked, then eager moekit and the compiled rows timed in rounds."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model, prompt = build(name == "fp8", dev)
    config = CompileConfig(**_compile_mode())
    if dev.type != "cuda":
        config._compile_all_devices = True
    ref = step_logits(model, "moekit", prompt)
    res = RESULT[name] = {"err_vs_eager": {}, "ms_per_step": {}}
    ran = []
    for impl in IMPLS:
        try:
            got = step_logits(model, impl, prompt, config)
            generate(model, impl, prompt, config)  # the trees record on a later run
        except RuntimeError as err:
            RUN.check(f"{name}: {impl} compiled reduce-overhead runs", False, f"{type(err).__name__}: {str(err)[:200]}")
            continue
        err = res["err_vs_eager"][impl] = agreeing_err(got, ref)
        if SMOKE and name == "fp8" and impl == "moekit":  # the graph holds the fp8 op (the triton backend, smoke)
            RUN.check("fp8: moekit's graph holds moekit.triton_experts_fp8",
                      any("moekit.triton_experts_fp8" in ops for ops in SEEN), str(SEEN))
        RUN.check(f"{name}: {impl} compiled reduce-overhead runs", True)
        RUN.check(f"{name}: {impl} compiled step logits vs eager moekit", err < 3e-2, f"rel_l2={err:.2e}")
        ran.append(impl)
        RUN.log(f"{name}: {impl} compiled")
    rows = [("moekit eager", "moekit", None)] + [(f"{impl} compiled", impl, config) for impl in ran]
    per = res["ms_per_step"] = {label: [] for label, _, _ in rows}
    for r in range(ARGS.rounds):
        if r and RUN.elapsed() > ARGS.deadline - 3:
            RUN.log(f"{name}: deadline, {r} rounds")
            break
        for label, impl, cfg in (rows if r % 2 == 0 else rows[::-1]):
            clock = StepClock()
            generate(model, impl, prompt, cfg, clock)
            per[label].append(clock.median_ms())
        RUN.log(f"{name} round {r}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in per.items()))
    for label, samples in per.items():
        med = statistics.median(samples)
        RUN.summary.append(f"| {name} | {label} | " + " ".join(f"{s:.3f}" for s in samples)
                           + f" | {med:.3f} | {1e3 / med:.1f} |")
    del model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=80.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("op", "fp8", "bf16"))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K], "phases": ARGS.phases}
    RUN.summary.append("| model | row | ms a step, each round | median | tok/s |\n|---|---|---|---|---|")
    raise_recompile_limit()  # two implementations and two models: never fall back to eager
    phases = {"op": lambda: op_phase(dev), "fp8": lambda: model_phase("fp8", dev),
              "bf16": lambda: model_phase("bf16", dev)}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, NEEDS_S,
                      ARGS.out and os.path.join(ARGS.out, "f8g36.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
