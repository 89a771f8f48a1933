"""Compile the swapped weight-only Gluon GEMM (``_kernels/gluon_gemm_wo_swap.py``: the decoded codes as wgmma's
register operand) for sm_90 on a machine without a GPU, next to the session-27 kernel (``gluon_gemm_wo``) on the
same GEMM: SMEM, ptxas's spill stores, whether it serialized the wgmmas, the partitions' registers and the MMA
loop's SASS a weight (``wol7_compile_cpu.loop_counts``).

    PYTHONPATH=$PWD python3 benchmarks/wo4k_compile_cpu.py                          # this Triton (3.9 here)
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/wo4k_compile_cpu.py          # Triton 3.6 (the H200's)
    ... wo4k_compile_cpu.py --sass up                                               # and dump the gate-up SASS
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gluon_fp8_compile_cpu import compile_gluon_sm90, ptxas_report  # noqa: E402
from wol7_compile_cpu import _descriptor, loop_counts  # noqa: E402

# (name, gated, stages, fast, split): the swapped GEMM's launch stages (``triton_gluon_wo.wo_gemm_launch``), with
# Triton's conversion, with FAST (the inline-PTX pair), and split into a partition a warpgroup
CASES = (("up", True, 6, False, False), ("down", False, 8, False, False), ("up-fast", True, 6, True, False),
         ("down-fast", False, 8, True, False), ("up-fast-split", True, 6, True, True),
         ("down-fast-split", False, 8, True, True), ("int4-up", True, 8, False, False, 1),
         ("int4-down", False, 8, False, False, 1), ("int4-up-split", True, 8, False, True, 1))


def compile_swap(gated: bool, stages: int, fast: bool, split: bool, scheme: int = 0, block_n: int = 128,
                 block_k: int = 64):
    """The compiled swapped GEMM (``scheme`` 0 int8, 1 int4 with groups of 128 and zero points) at a small shape
    (E=2, N=256, K=512: shapes reach it as i32 arguments)."""
    from moekit.experts._kernels.gluon_gemm_wo_swap import grouped_gemm_wo_swap_kernel as kernel

    e, n, k, t = 2, 256, 512, 1024
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
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=stages, GROUP_M=8, SCHEME=scheme,
                 GROUP=(1, 128)[scheme], num_warps=4 if split else 8, FAST=fast, SPLIT=split)
    return compile_gluon_sm90(kernel, args, const, const["num_warps"], 168)


def report(name: str, gated: bool, stages: int, fast: bool, split: bool, scheme: int = 0) -> str:
    """One case's line; the loop a weight: SPLIT's loop is one warpgroup's (its 4 warps, half of a step's weights)."""
    t0 = time.perf_counter()
    out = compile_swap(gated, stages, fast, split, scheme)
    ptx = out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    regs = sorted(set(ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln))
    weights = (2 if gated else 1) * 128 * 64
    return (f"swap {name} s{stages}: {time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, spill "
            f"stores {spills} B, wgmma serialized {serialized}, bar.sync {ptx.count('bar.sync')}, setmaxnreg {regs}; "
            + loop_counts(out.asm["cubin"], weights))


def main() -> int:
    import triton

    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", choices=[c[0] for c in CASES], help="write that GEMM's SASS to /tmp/wo4k")
    args = parser.parse_args()
    print("triton", triton.__version__, flush=True)
    failed = 0
    for case in CASES:
        try:
            print("OK", report(*case), flush=True)
        except Exception as exc:  # noqa: BLE001 (report each case)
            failed += 1
            print(f"FAIL {case[0]}: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
    if args.sass:
        from wo_gemv_sass_cpu import _tool  # noqa: E402

        case = next(c for c in CASES if c[0] == args.sass)
        out = compile_swap(*case[1:])
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
