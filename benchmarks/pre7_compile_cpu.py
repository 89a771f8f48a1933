"""Compile the route's bf16 Gluon GEMMs (issue 19 at prefill) for sm_90 on a machine without a GPU: catches errors
before a device run, reads ptxas's spills and wgmma serialization, and the global loads of the tile walk. (Session 27
compiled them beside the expert tile order, ``GluonTile.expert_order``, removed in session 28.)

    PYTHONPATH=$PWD python benchmarks/pre7_compile_cpu.py        (PYTHONPATH=/tmp/x-site:$PWD for another Triton)

One line per kernel (TMA gate-up, down, in-loader-gather gate-up, down with the 64-row tail): seconds,
SMEM bytes, setmaxnreg, spill bytes, wgmma serialized, ld.global count in the PTX. Exit 1 when one fails to compile.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

E, N, K, T = 4, 768, 2048, 2048  # Qwen3-30B-A3B's widths at a small row count


def _compile(kernel, args: dict, const: dict, aligned: tuple) -> str:
    import triton
    from gluon_fp8_compile_cpu import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts.triton_gluon_launch import MAX_REGISTERS, NUM_WARPS
    from moekit.triton_bind import COMPILE_OPTIONS

    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()}, attrs)
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS,
                                                                              maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS))
    ptx = out.asm["ptx"]
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    spills, serialized = ptxas_report(ptx)
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, ptxas spill "
            f"stores {spills} B, wgmma serialized {serialized}, ld.global {ptx.count('ld.global')}")


def plain(tile, gated: bool) -> str:
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts._kernels.gluon_gemm import grouped_gemm_kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, NUM_WARPS

    bf16, int32 = torch.bfloat16, torch.empty(1, dtype=torch.int32)
    reduce_dim, cols, w_rows = (K, N, 2 * N) if gated else (N, K, K)
    args = dict(a_desc=_descriptor([T, reduce_dim], [BLOCK_M, tile.block_k], bf16),
                w_desc=_descriptor([E * w_rows, reduce_dim], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([T, cols], [BLOCK_M, tile.block_n], bf16), experts_ptr=int32, used_ptr=int32,
                reduce_dim=reduce_dim, num_col_blocks=cols // tile.block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=N if gated else 0, GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                 num_warps=NUM_WARPS)
    return _compile(grouped_gemm_kernel, args, const, ("experts_ptr", "used_ptr", "reduce_dim"))


def gather(tile) -> str:
    from gather_compile_cpu import GATHER_ALIGNED, gather_up_args

    from moekit.experts._kernels.gluon_gemm_gather import gather_gate_up_kernel

    args, const = gather_up_args(tile, E, N, K, T)
    return _compile(gather_gate_up_kernel, args, const, GATHER_ALIGNED)


def tail(tile) -> str:
    from tail_compile_cpu import tail_down_args

    from moekit.experts._kernels.gluon_gemm_tail import tail_down_kernel

    args, const = tail_down_args(tile, E, N, K, T)
    return _compile(tail_down_kernel, args, const, ("experts_ptr", "sorted_ptr", "used_ptr"))


def main() -> int:
    import triton

    from moekit.experts.triton_gluon_launch import DOWN_TILE, UP_TILE, with_tail

    print(f"triton {triton.__version__}", flush=True)
    failed = 0
    for label, build in (("gate-up TMA", lambda: plain(UP_TILE, True)), ("down", lambda: plain(DOWN_TILE, False)),
                         ("gate-up gather", lambda: gather(UP_TILE)),
                         ("down tail", lambda: tail(with_tail(DOWN_TILE)))):
        try:
            print(f"OK {label}: {build()}", flush=True)
        except Exception as exc:  # noqa: BLE001 (the error, not a traceback through the compiler)
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
