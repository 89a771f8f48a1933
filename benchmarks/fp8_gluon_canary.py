"""Canaries of ``fp8_gluon_device_check.py``: a variant that could hang the GPU (a Gluon barrier that never
arrives) or crash the compiler (Triton's warp specialization of the fp8 K loop) runs once first, in a
subprocess of its own, while the check builds its weights; the check runs that variant only if its canary
finished in time and agreed with the torch twin.

    python benchmarks/fp8_gluon_canary.py gluon|loop-ws [--smoke]    # prints one CANARY line

Both run at Qwen3-30B-A3B, M = 1024 (~1100 tiles per GEMM: several per program, the SMEM rings wrapping);
their kernels land in Triton's disk cache, so the check's first calls of the same kernels do not compile.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

KINDS = ("gluon", "loop-ws")
TOLERANCE = 2e-2


def run(kind: str, smoke: bool) -> None:
    from fp8_device_check import quantize_blocks
    from moekit.bench.cells import Shape, make_weights, uniform_routing
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, experts_gluon_fp8_twin, gluon_fp8_supported

    dev = torch.device("cpu" if smoke else "cuda")
    if dev.type != "cuda" or (kind == "gluon" and not gluon_fp8_supported(dev)):
        print(f"CANARY skip: {kind} not run on {dev}", flush=True)
        return
    s = Shape.from_preset("qwen3-30b-a3b")
    w = make_weights(s, torch.bfloat16, dev)
    q = (*quantize_blocks(w.w13), *quantize_blocks(w.w2))
    r = uniform_routing(1024, s, dev, seed=7)
    x = torch.randn(1024, s.k, device=dev, dtype=torch.bfloat16)
    if kind == "gluon":
        outs = [experts_gluon_fp8(x, *q, r.topk_ids, r.topk_weights)]
    else:
        from fp8_gluon_device_check import TRITON_CONFIGS, triton_config

        p128 = triton_config(TRITON_CONFIGS["triton_fp8 p128 8w/3+8w/4"])
        outs = [fused_experts_fp8_launch(x, *q, r.topk_ids, r.topk_weights, loop_ws=True),
                fused_experts_fp8_launch(x, *q, r.topk_ids, r.topk_weights, config=p128, weight_tma=True,
                                         loop_ws=True)]
    torch.cuda.synchronize()
    twin = experts_gluon_fp8_twin(x, *q, r.topk_ids, r.topk_weights)
    errs = [((o.float() - twin.float()).norm() / twin.float().norm()).item() for o in outs]
    ok = all(e < TOLERANCE for e in errs)  # NaN fails too
    print(f"CANARY {'ok' if ok else 'wrong'} {kind} err {', '.join(f'{e:.2e}' for e in errs)}", flush=True)


def start(kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, kind] + (["--smoke"] if "--smoke" in sys.argv else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def verdict(kind: str, proc: subprocess.Popen, deadline: float) -> tuple[bool, str]:
    """(may the check run this kind's variants, a line for the log): a canary still running at
    ``deadline`` (time.perf_counter()) is killed and its variants skipped."""
    try:
        text, _ = proc.communicate(timeout=max(5.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"{kind} canary still running at its deadline (a hang?): its variants skipped"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith("CANARY")), None)
    if line is None:
        return False, f"{kind} canary died (rc {proc.returncode}): " + " | ".join(lines[-8:])
    return line.startswith(("CANARY ok", "CANARY skip")), line


if __name__ == "__main__":
    run(sys.argv[1], "--smoke" in sys.argv)
