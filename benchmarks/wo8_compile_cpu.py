"""Compile the weight-only Gluon GEMM's session-28 variants (``_kernels/gluon_gemm_wo.py``: SPLIT, the two warpgroups
each owning half of the tile's columns; FAST, the cheaper decode arithmetic) for sm_90 on a machine without a GPU,
and count the MMA loop's SASS a weight (``wol7_compile_cpu.loop_counts``) against the session-27 kernel.

    PYTHONPATH=$PWD python3 benchmarks/wo8_compile_cpu.py                          # this Triton (3.9 here)
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/wo8_compile_cpu.py          # Triton 3.6 (the H200's)

SPLIT's loop is one warpgroup's: its instructions a weight count its 4 warps over its half of a step's weights.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_report import report_jobs  # noqa: E402
from gluon_fp8_compile_cpu import ptxas_report  # noqa: E402
from wol7_compile_cpu import _descriptor, loop_counts  # noqa: E402

# (gated, stages, scheme, block_n): the route's tiles (gate-up 4 stages, down 6), each plain / SPLIT / FAST
CASES = tuple((gated, stages, scheme, 128) for scheme in (0, 1, 2) for gated, stages in ((True, 4), (False, 6)))
VARIANTS = {"base": {}, "split": {"SPLIT": True}, "fast": {"FAST": True}, "split+fast": {"SPLIT": True, "FAST": True},
            "fast+slots3": {"FAST": True, "SLOTS": 3}}


def compile_wo(gated: bool, stages: int, scheme: int, block_n: int, variant: dict, block_k: int = 64):
    """The compiled weight-only Gluon GEMM of one case (``variant``: its SPLIT / FAST / SLOTS constexprs) at a small
    shape (E=2, N=256, K=512: shapes reach it as i32 arguments)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_wo import grouped_gemm_wo_kernel as kernel
    from moekit.triton_bind import COMPILE_OPTIONS

    e, n, k, t = 2, 256, 512, 1024
    split = variant.get("SPLIT", False)
    warps = 4 if split else 8
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    if variant.get("SLOTS", 2) == 3 and gated and scheme == 0:  # as ``launch_gemm_wo``: the third slot for a stage
        stages = min(stages, 3)
    fast = variant.get("FAST", False) and scheme > 0  # FAST: mxfp4 read as int32 words too
    four_bit = (8, torch.int32) if fast else (2, torch.uint8)
    pack, q_dtype = ((1, torch.int8), (8, torch.int32), four_bit)[scheme]
    args = dict(a_desc=_descriptor([t, r], [128, block_k], torch.bfloat16),
                q_desc=_descriptor([e * w_rows, r // pack], [block_n, block_k // pack], q_dtype),
                c_desc=_descriptor([t, c], [128, block_n // (2 if split else 1)], torch.bfloat16),
                experts_ptr=torch.empty(1, dtype=torch.int32), used_ptr=torch.empty(1, dtype=torch.int32),
                s_ptr=torch.empty(1), z_ptr=torch.empty(1, dtype=torch.uint8), stride_se=w_rows * 4, stride_sr=4,
                stride_sg=1, stride_ze=w_rows * 4, stride_zr=4, stride_zg=1, reduce_dim=r, num_col_blocks=c // block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=stages, GROUP_M=8, SCHEME=scheme,
                 GROUP=(1, 128, 32)[scheme], num_warps=warps,
                 **{"SPLIT": False, "FAST": False, "SLOTS": 2, **variant})
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, maxnreg=168,
                                                                                 **COMPILE_OPTIONS))


def compile_case(gated: bool, stages: int, scheme: int, block_n: int, variant: dict, block_k: int = 64) -> str:
    t0 = time.perf_counter()
    out = compile_wo(gated, stages, scheme, block_n, variant, block_k)
    if variant.get("SLOTS", 2) == 3 and gated and scheme == 0:  # the stages ``compile_wo`` compiled
        stages = min(stages, 3)
    ptx = out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    weights = (2 if gated else 1) * block_n * block_k  # (SPLIT: one warpgroup's loop, half of them on half the warps)
    regs = sorted(set(ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln))
    return (f"{('int8', 'int4', 'mxfp4')[scheme]} {'gate-up' if gated else 'down'} s{stages}: "
            f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, spill stores {spills} B, wgmma "
            f"serialized {serialized}, bar.sync {ptx.count('bar.sync')}, setmaxnreg {regs}; "
            + loop_counts(out.asm["cubin"], weights))


def main() -> int:
    import triton

    print("triton", triton.__version__, flush=True)
    only = sys.argv[1:]  # variant names (default: all)
    jobs = [(name, variant, case) for name, variant in VARIANTS.items() for case in CASES if not only or name in only]
    return report_jobs([(f"{name} {case}", lambda n=name, v=variant, c=case: f"{n:<11} {compile_case(*c, v)}")
                        for name, variant, case in jobs])


if __name__ == "__main__":
    sys.exit(main())
