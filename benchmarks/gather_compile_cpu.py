"""Compile the bf16 Gluon gate-up GEMM with the in-loader gather (``_kernels/gluon_gemm_gather.py``) for sm_90 on a
machine without a GPU: catches layout, barrier and shared-memory errors before a device run, reads ptxas's spills.

    PYTHONPATH=$PWD python benchmarks/gather_compile_cpu.py [--ptx FILE]

Prints one line: seconds, SMEM bytes, the partitions' setmaxnreg, spill bytes, and the
cp.async / cp.async.mbarrier.arrive / fence.proxy.async counts in the PTX. ``--ptx``: keep the PTX there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


# x's pointer and row stride 16-byte aligned (what the route checks and Triton specialises on), the index arrays too
GATHER_ALIGNED = ("x_ptr", "sorted_ptr", "dst_ptr", "experts_ptr", "used_ptr", "stride_x", "reduce_dim")


def gather_up_args(tile, e: int, n: int, k: int, t: int) -> tuple[dict, dict]:
    """(args, const) of ``gather_gate_up_kernel`` for a compile: the gate-up GEMM of ``e`` experts, top-k 8, over t
    assignment rows gathered from x [., k], n output columns (w13 as [e * 2n, k]), at ``tile``."""
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts.triton_gluon_launch import BLOCK_M, LOADER_REGS, LOADER_WARPS, NUM_WARPS

    bf16, int32 = torch.bfloat16, torch.empty(1, dtype=torch.int32)
    args = dict(x_ptr=torch.empty(1, dtype=bf16), sorted_ptr=int32, dst_ptr=int32,
                w_desc=_descriptor([e * 2 * n, k], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, n], [BLOCK_M, tile.block_n], bf16), experts_ptr=int32, used_ptr=int32,
                num_assignments=t, stride_x=k, reduce_dim=k, num_col_blocks=n // tile.block_n)
    return args, dict(TOP_K=8, W_ROWS=2 * n, GATE_OFFSET=n, STAGES=tile.stages, GROUP_M=tile.group_m,
                      LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=NUM_WARPS)


def compile_gather_gemm(tile) -> tuple[str, str]:
    """The gather gate-up GEMM at a small shape (E=2, N=512, K=512, top-k 8): (report line, PTX)."""
    import triton
    from gluon_fp8_compile_cpu import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_gather import gather_gate_up_kernel as kernel
    from moekit.experts.triton_gluon_launch import MAX_REGISTERS, NUM_WARPS
    from moekit.triton_bind import COMPILE_OPTIONS

    args, const = gather_up_args(tile, 2, 512, 512, 1024)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in GATHER_ALIGNED}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()}, attrs)
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS))
    ptx = out.asm["ptx"]
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    spills, serialized = ptxas_report(ptx)
    counts = {op: ptx.count(op) for op in ("cp.async.cg", "cp.async.ca", "cp.async.mbarrier.arrive",
                                           "fence.proxy.async", "cp.async.bulk.tensor")}
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, "
            f"ptxas spill stores {spills} B, wgmma serialized {serialized}, {counts}"), ptx


def main() -> int:
    from moekit.experts.triton_gluon_launch import UP_TILE

    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", type=Path)
    args = parser.parse_args()
    try:
        line, ptx = compile_gather_gemm(UP_TILE)
    except Exception as exc:  # noqa: BLE001 (the error, not a traceback through the compiler)
        print(f"FAIL: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
        return 1
    print(f"OK {UP_TILE}: {line}", flush=True)
    if args.ptx:
        args.ptx.parent.mkdir(parents=True, exist_ok=True)
        args.ptx.write_text(ptx)
    return 0

if __name__ == "__main__":
    sys.exit(main())
