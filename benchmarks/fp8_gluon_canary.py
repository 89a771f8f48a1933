"""Canaries of ``fp8_gluon_device_check.py``: subprocesses that run, once, what could hang the GPU (a Gluon
barrier that never arrives), and compile everything else the check will time, while the check builds its
weights. The check runs the Gluon variants only if the gluon canary's line says ok; the kernels the canaries compiled
are in Triton's disk cache, so the check's own first calls do not compile (that took most of the check's time
otherwise).

    python benchmarks/fp8_gluon_canary.py gluon|triton|bf16 [--smoke]    # prints CANARY lines

gluon: the Gluon fp8 path at Qwen3-30B-A3B M=1024 (~1100 tiles per GEMM: several per program, the SMEM rings
wrapping) against the twin, then each GEMM variant once (a variant that hangs leaves no "gluon-variants"
line: the check then times none); triton: the Triton fp8 plans of
M=1024/4096/16384 and the other config; bf16: moekit's bf16 Triton and Gluon paths at those M.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import torch

KINDS = ("gluon", "triton", "bf16")
TOLERANCE = 2e-2
BATCHES = (1024, 4096, 16384)


def say(ok: bool, name: str, detail: str = "") -> None:
    print(f"CANARY {'ok' if ok else 'wrong'} {name} {detail}", flush=True)


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run(kind: str, smoke: bool) -> None:
    from fp8_device_check import quantize_blocks
    from fp8_gluon_device_check import GEMM_VARIANTS, TRITON_CONFIGS, triton_config
    from moekit.bench.cells import Shape, make_weights, uniform_routing
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, experts_gluon_fp8_twin, gluon_fp8_supported

    dev = torch.device("cpu" if smoke else "cuda")
    if smoke or (kind == "gluon" and not gluon_fp8_supported(dev)):
        print(f"CANARY skip {kind}: not run on {dev}", flush=True)
        return
    s = Shape.from_preset("qwen3-30b-a3b")
    w = make_weights(s, torch.bfloat16, dev)
    q = (*quantize_blocks(w.w13), *quantize_blocks(w.w2))
    calls = {}
    for m in BATCHES:
        r = uniform_routing(m, s, dev, seed=7)
        calls[m] = (torch.randn(m, s.k, device=dev, dtype=torch.bfloat16), r.topk_ids, r.topk_weights)
    x, ids, rw = calls[1024]
    twin = experts_gluon_fp8_twin(x, *q, ids, rw)
    if kind == "gluon":
        say(rel(experts_gluon_fp8(x, *q, ids, rw), twin) < TOLERANCE, "gluon")
        from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

        for gemm, variants in GEMM_VARIANTS.items():  # each variant once through the whole path
            for _, fields in variants:
                base = UP_TILE if gemm == "gate-up" else DOWN_TILE
                tile = replace(base, stages=base.stages - 1) if fields is None else replace(base, **fields)
                out = experts_gluon_fp8(x, *q, ids, rw, **{"up" if gemm == "gate-up" else "down": tile})
                say(rel(out, twin) < TOLERANCE, f"gluon-variant {gemm} {tile}")
        torch.cuda.synchronize()
        say(True, "gluon-variants")
    elif kind == "triton":
        for m, (xm, idm, rwm) in calls.items():
            fused_experts_fp8_launch(xm, *q, idm, rwm)
            for spec in TRITON_CONFIGS.values():
                fused_experts_fp8_launch(xm, *q, idm, rwm, config=triton_config(spec))
    else:
        from moekit.experts import run_experts
        from moekit.experts.triton_gluon import experts_gluon

        for xm, idm, rwm in calls.values():
            run_experts(xm, w.w13, w.w2, idm, rwm, backend="triton")
            experts_gluon(xm, w.w13, w.w2, idm, rwm)
    torch.cuda.synchronize()
    print(f"CANARY done {kind}", flush=True)


def start(kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, kind] + (["--smoke"] if "--smoke" in sys.argv else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, deadline: float) -> tuple[list[str], str]:
    """(the canary's output lines, how it ended): waits until ``deadline`` (time.perf_counter()), then kills."""
    try:
        text, _ = proc.communicate(timeout=max(5.0, deadline - time.perf_counter()))
        ended = f"rc {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        ended = "killed at its deadline (a hang, or compiles too slow)"
    return [ln for ln in (text or "").splitlines() if ln.strip()], ended


def verdict(name: str, lines: list[str], ended: str) -> tuple[bool, str]:
    """(may the check run ``name``'s variants, a line for the log)."""
    for line in lines:
        if line.startswith(f"CANARY ok {name}") or line.startswith("CANARY skip"):
            return True, line
        if line.startswith(f"CANARY wrong {name}"):
            return False, line
    return False, f"{name} canary gave no verdict ({ended}): " + " | ".join(lines[-8:])


if __name__ == "__main__":
    run(sys.argv[1], "--smoke" in sys.argv)
