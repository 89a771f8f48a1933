"""Compile the swapped weight-only Gluon GEMM (``_kernels/gluon_gemm_wo_swap.py``: the decoded codes as wgmma's
register operand) for sm_90 on a machine without a GPU, next to the session-27 kernel (``gluon_gemm_wo``) on the
same GEMM: SMEM, ptxas's spill stores, whether it serialized the wgmmas, the partitions' registers, the wgmma waits'
depths in the SASS (``wgmma_hazards``) and the MMA loop's SASS a weight
(``wol7_compile_cpu.loop_counts``).

    PYTHONPATH=$PWD python3 benchmarks/wo4k_compile_cpu.py                          # this Triton (3.9 here)
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/wo4k_compile_cpu.py          # Triton 3.6 (the H200's)
    ... wo4k_compile_cpu.py --sass up                                               # and dump the gate-up SASS
    ... wo4k_compile_cpu.py --cases down-fast-split int4-down                       # these cases only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_report import report_jobs  # noqa: E402
from gluon_fp8_compile_cpu import compile_gluon_sm90, ptxas_report  # noqa: E402
from wgmma_hazards import pipeline_report  # noqa: E402
from wol7_compile_cpu import _descriptor, loop_counts  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled GEMM: the swapped GEMM's launch stages (``triton_gluon_wo.wo_gemm_launch``), Triton's conversion
    or FAST (the inline-PTX pair), SPLIT into a partition a warpgroup."""

    name: str
    gated: bool
    stages: int
    fast: bool = False
    split: bool = False
    scheme: int = 0  # 0 int8, 1 int4 (groups of 128, zero points)


CASES = (Case("up", True, 6), Case("down", False, 8), Case("up-fast", True, 6, True),
         Case("down-fast", False, 8, True), Case("up-fast-split", True, 6, True, True),
         Case("down-fast-split", False, 8, True, True), Case("int4-up", True, 8, scheme=1),
         Case("int4-down", False, 8, scheme=1), Case("int4-up-split", True, 8, split=True, scheme=1))


def compile_swap(case: Case, block_n: int = 128, block_k: int = 64):
    """The compiled swapped GEMM of ``case`` at a small shape (E=2, N=256, K=512: shapes reach it as i32
    arguments)."""
    from moekit.experts._kernels.gluon_gemm_wo_swap import grouped_gemm_wo_swap_kernel as kernel

    e, n, k, t = 2, 256, 512, 1024
    gated, split, scheme = case.gated, case.split, case.scheme
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    args = dict(a_desc=_descriptor([t, r], [128, block_k], torch.bfloat16),
                q_desc=_descriptor([e * w_rows, r // (1 + scheme)], [block_n, block_k // (1 + scheme)],
                                   (torch.int8, torch.uint8)[scheme]),
                c_desc=_descriptor([t, c], [128, block_n // (2 if split else 1)], torch.bfloat16),
                experts_ptr=torch.empty(1, dtype=torch.int32), used_ptr=torch.empty(1, dtype=torch.int32),
                s_ptr=torch.empty(1), z_ptr=torch.empty(1, dtype=(torch.float32, torch.uint8)[scheme]),
                stride_se=w_rows * (1, r // 128)[scheme], stride_sr=(1, r // 128)[scheme], stride_sg=scheme,
                stride_ze=w_rows * r // 128 * scheme, stride_zr=r // 128 * scheme, stride_zg=scheme, reduce_dim=r,
                num_col_blocks=c // block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=case.stages, GROUP_M=8,
                 SCHEME=scheme, GROUP=(1, 128)[scheme], num_warps=4 if split else 8, FAST=case.fast, SPLIT=split)
    return compile_gluon_sm90(kernel, args, const, const["num_warps"], 168)


def sass_of(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin."""
    import subprocess
    import tempfile

    from wo_gemv_sass_cpu import _tool

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def report(case: Case) -> str:
    """One case's line; the loop a weight: SPLIT's loop is one warpgroup's (its 4 warps, half of a step's weights)."""
    t0 = time.perf_counter()
    out = compile_swap(case)
    ptx = out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    regs = sorted(set(ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln))
    weights = (2 if case.gated else 1) * 128 * 64
    return (f"swap {case.name} s{case.stages}: {time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, "
            f"spill stores {spills} B, wgmma serialized {serialized}, bar.sync {ptx.count('bar.sync')}, setmaxnreg "
            f"{regs}, {pipeline_report(sass_of(out.asm['cubin'])).line()}; "
            + loop_counts(out.asm["cubin"], weights))


def main() -> int:
    import triton

    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", choices=[c.name for c in CASES], help="write that GEMM's SASS to /tmp/wo4k")
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], help="compile these only")
    args = parser.parse_args()
    print("triton", triton.__version__, flush=True)
    failed = report_jobs([(case.name, lambda case=case: report(case)) for case in CASES
                          if not args.cases or case.name in args.cases], tail=3000)
    if args.sass:
        from wo_gemv_sass_cpu import _tool  # noqa: E402

        out = compile_swap(next(c for c in CASES if c.name == args.sass))
        os.makedirs("/tmp/wo4k", exist_ok=True)
        base = f"/tmp/wo4k/swap_{args.sass}_{triton.__version__}"
        for kind in ("ptx", "ttgir", "llir"):
            with open(f"{base}.{kind}", "w") as f:
                f.write(out.asm[kind])
        with open(f"{base}.cubin", "wb") as f:
            f.write(out.asm["cubin"])
        os.system(f"{_tool('nvdisasm')} -c {base}.cubin > {base}.sass")
        print("wrote", base + ".*")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
