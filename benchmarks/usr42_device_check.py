"""usr42: what the second hour's fixes change on a GPU: a float32 ``MoE`` under bf16 autocast (its experts follow
autocast, on the Triton backend and through the decode fast path's misses), ``router_dtype`` inside autocast with the
fused router, ``return_stats=True`` under ``torch.compile``. (Its host phase, the experts call's dtype check
before / after in interleaved rounds, ran once on an H100 and was removed: ``git show
b35bf8b7:benchmarks/usr42_device_check.py``, results/raw/NVIDIA_H100-2026-12-06-b35bf8b-usr42.*.)

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/usr42_device_check.py --out $OUT/usr42 --deadline 72   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/usr42_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/usr42.json rewritten after each):
  correct   Qwen3-30B-A3B experts (E = 128, K = 2048, N = 768, k = 8), a float32 layer given a bf16 x under bf16
            autocast at M = 1, 64, 512: out bf16 and against the same layer cast to bf16 without autocast (rel-L2
            PASS < 1e-2), three repeated no_grad calls at M = 1 equal to the first (the fast path serves only x of the
            weights' dtype), backward reaches the float32 weights; a bf16 layer with router_dtype="float32" under
            autocast: float32 logits equal to the float32 GEMM (PASS < 1e-6); return_stats=True compiled (aot_eager):
            one graph break, aux_loss equal to eager's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, rel_l2, run_info, run_phases  # noqa: E402

from moekit import MoE, MoEConfig  # noqa: E402

E, N, K, TOP_K = (8, 32, 64, 2) if SMOKE else (128, 768, 2048, 8)
MS = (1, 5, 17) if SMOKE else (1, 64, 512)
RUN = RunLog("usr42: autocast, router_dtype, return_stats compiled", 60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()


def config(**changes) -> MoEConfig:
    return MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, **changes)


def autocast(dev):
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def correct_phase(dev) -> None:
    res = RESULT["correct"] = {}
    torch.manual_seed(0)
    moe = MoE(config(), device=dev)  # float32
    twin = copy.deepcopy(moe)  # its experts rounded to bf16 as autocast rounds them, its gate the same float32 one
    twin.w13, twin.w2 = (torch.nn.Parameter(w.detach().bfloat16()) for w in (moe.w13, moe.w2))
    for m in MS:
        x = torch.randn(m, K, device=dev).bfloat16()
        with torch.no_grad(), autocast(dev):
            got, want = moe(x), twin(x)  # the twin's x has its experts' dtype: no cast, the same routing
        err = res[f"autocast_M{m}"] = rel_l2(got, want)
        RUN.check(f"M={m} float32 layer, bf16 x, autocast: bf16 out vs the bf16-experts twin",
                  got.dtype == torch.bfloat16 and err < 1e-2, f"{got.dtype} rel_l2={err:.2e} "
                  f"bit-equal={torch.equal(got, want)}")
    x = torch.randn(1, K, device=dev).bfloat16()
    with torch.no_grad(), autocast(dev):
        outs = [moe(x) for _ in range(4)]
    RUN.check("M=1 repeated autocast calls equal the first", all(torch.equal(o, outs[0]) for o in outs[1:]))
    x = torch.randn(8, K, device=dev).bfloat16()
    with autocast(dev):
        moe(x).float().square().sum().backward()
    RUN.check("backward reaches the float32 weights", moe.w13.grad is not None and moe.w13.grad.dtype == torch.float32
              and bool(torch.isfinite(moe.w13.grad).all()))
    routed = MoE(config(router_dtype="float32", z_loss_coef=1e-3), dtype=torch.bfloat16, device=dev)
    x = torch.randn(8, K, device=dev).bfloat16()
    with torch.no_grad(), autocast(dev):
        stats = routed(x, return_stats=True)
    want = x.float() @ routed.gate.weight.float().t()
    err = res["router_dtype"] = rel_l2(stats.router_logits, want)
    RUN.check("router_dtype float32 inside autocast: float32 logits", stats.router_logits.dtype == torch.float32
              and err < 1e-6, f"{stats.router_logits.dtype} rel_l2={err:.2e}")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(routed)(x, return_stats=True)
    compiled = torch.compile(routed, backend="aot_eager")(x, return_stats=True)
    eager = routed(x, return_stats=True)
    same = abs(compiled.aux_loss.item() - eager.aux_loss.item()) <= 1e-6 * abs(eager.aux_loss.item())
    RUN.check("return_stats compiled: one graph break, aux_loss as eager", explained.graph_break_count == 1 and same,
              f"breaks={explained.graph_break_count} aux {compiled.aux_loss.item():.6g} / {eager.aux_loss.item():.6g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=72.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("correct",))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K], "phases": ARGS.phases}
    phases = {"correct": lambda: correct_phase(dev)}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, {},
                      ARGS.out and os.path.join(ARGS.out, "usr42.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
