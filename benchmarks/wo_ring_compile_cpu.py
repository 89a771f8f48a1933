"""Compile the int4 ring GEMV (``moekit/experts/_kernels/gluon_wo_ring.py``) for sm_90 on a machine without a GPU:
catches typos and layout errors before a device run, and reports SMEM, registers, spills and the main loop's
instructions a weight of the decode loop (SASS, where the bundled cuobjdump takes the cubin).

    PYTHONPATH=$PWD python3 benchmarks/wo_ring_compile_cpu.py          # gate-up and down, the device check's plans
    PYTHONPATH=/tmp/triton36:$PWD python3 benchmarks/wo_ring_compile_cpu.py   # the same on Triton 3.6 (the GPU's):
        pip install --no-deps --target /tmp/triton36 triton==3.6.0
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gluon_fp8_compile_cpu import ptxas_report  # noqa: E402

from moekit.experts.triton_wo import WoWeight  # noqa: E402
from moekit.experts.triton_wo_ring import RingPlan, _descriptors, check_plan, ring_weight  # noqa: E402


def compile_ring(gated: bool, plan: RingPlan, loader_only: bool = False, mx: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_wo_ring import ring_kernel
    from moekit.experts._kernels.gluon_wo_raw import RAW_CONSTANTS, raw_kernel
    from moekit.experts._kernels.gluon_wo_ring_words import ring_words_kernel

    kernel = {"bytes": ring_kernel, "words": ring_words_kernel, "raw": raw_kernel}[plan.decode]

    e, n, k = 2, 256, 512
    r, c = (2 * n, k) if gated else (k, n)
    if mx:
        w = WoWeight("mxfp4", torch.zeros(e, r, c // 2, dtype=torch.uint8),
                     torch.zeros(e, r, c // 32, dtype=torch.uint8), None, 32)
    else:
        w = WoWeight("int4_w4a16", torch.zeros(e, r, c // 2, dtype=torch.uint8), torch.ones(e, r, c // 128),
                     torch.zeros(e, r, c // 128, dtype=torch.uint8), 128)
    rw = ring_weight(w, c)
    check_plan(plan, n if gated else k)
    descs = _descriptors(rw, plan.block_rows, torch.zeros(8, c, dtype=torch.bfloat16), plan.decode)
    i32 = torch.empty(1, dtype=torch.int32)
    names = ["q_desc", "x_desc", "scale_ptr", "zero_ptr"] if plan.decode == "raw" else [
        "q_desc", "s_desc", "z_desc", "x_desc", "xs_desc"]
    args = dict(zip(names, descs))
    args |= dict(ids_ptr=i32, wts_ptr=torch.empty(1),
                item_e_ptr=i32, item_s_ptr=i32, count_ptr=i32,
                out_ptr=torch.empty(1, dtype=torch.bfloat16 if gated else torch.float32), num_experts=e)
    const = dict(S=8, TOP_K=8 if gated else 1, R=r, ROWS=n if gated else k, G=c // 128, GATED=gated,
                 TM=max(plan.group, 1), GROUPED=plan.group > 0, STAGES=plan.stages, LOADER_ONLY=loader_only,
                 num_warps=plan.num_warps)
    if plan.decode == "raw":
        args |= dict(zip(("fifteen", "magic"), RAW_CONSTANTS[mx]))
        const |= dict(MX=mx)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=plan.num_warps))
    spills, _ = ptxas_report(out.asm["ptx"])
    return out, time.perf_counter() - t0, spills


def sass_of(cubin: bytes) -> str | None:
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(exe):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([exe, "-sass", f.name], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def per_weight(sass: str, gated: bool, plan: RingPlan) -> float:
    """Instructions a weight of the decode partition's steady loop: from the first stage wait before the first
    release to the release that ends one loop body (the raw decode unrolls 4 steps), over the weights a thread
    decodes in those steps (rows a thread x gate and up x 16 codes a step)."""
    import re

    ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+", "", line).split(";")[0] for line in sass.splitlines()
           if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    releases = [i for i, op in enumerate(ops) if "SYNCS.ARRIVE.TRANS64.A1T0" in op]
    steps = 4 if plan.decode == "raw" else 1
    if len(releases) < steps:
        return float("nan")  # the loop not laid out as one body of releases (read the SASS by hand)
    start = max(i for i, op in enumerate(ops) if "TRYWAIT" in op and i < releases[0])
    weights = plan.block_rows // (4 * plan.num_warps) * (2 if gated else 1) * 16 * steps
    return (releases[steps - 1] + 1 - start) / weights


def main() -> int:
    import triton

    print("triton", triton.__version__, flush=True)
    failed = 0
    raw = dict(decode="raw")
    jobs = [(True, RingPlan(32, 8, 4)), (False, RingPlan(32, 8, 4)), (True, RingPlan(64, 8, 8)),
            (True, RingPlan(32, 8, 4, group=2)), (False, RingPlan(32, 8, 4, group=2)),
            (True, RingPlan(32, 8, 4, group=4)),
            (True, RingPlan(32, 8, 4, decode="words")), (False, RingPlan(32, 8, 4, decode="words")),
            (True, RingPlan(32, 8, 4, group=2, decode="words")), (True, RingPlan(64, 8, 4, decode="words")),
            (True, RingPlan(64, 8, 4, **raw)), (False, RingPlan(64, 8, 4, **raw)),
            (True, RingPlan(64, 8, 4, group=2, **raw)), (True, RingPlan(32, 8, 4, **raw))]
    for gated, plan, mx in [(g, p, False) for g, p in jobs] + [(True, RingPlan(64, 8, 4, **raw), True),
                                                              (False, RingPlan(64, 8, 4, **raw), True),
                                                              (True, RingPlan(32, 8, 4, **raw), True)]:
        name = f"{'gate-up' if gated else 'down'} {plan}" + (" mxfp4" if mx else "")
        try:
            out, sec, spills = compile_ring(gated, plan, mx=mx)
            sass = sass_of(out.asm["cubin"])
            each = f"{per_weight(sass, gated, plan):.2f}" if sass else "?"
            print(f"OK {name}: {sec:.1f} s, shared {out.metadata.shared} B, ptxas spill stores {spills} B, "
                  f"{each} instructions a weight", flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
