"""Compile the bf16 Gluon down GEMM with merged tails (``_kernels/gluon_gemm_tail.py``) for sm_90 without a GPU, each
tail at the down tiles of the route (wide and narrow experts): layout and SMEM errors before a device run, ptxas's
spills and wgmma serialization.

    PYTHONPATH=$PWD python3 benchmarks/tail_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_tail_gemm(tile, gated: bool) -> str:
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_tail import tail_gemm_kernel as kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    int32 = torch.empty(1, dtype=torch.int32)
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    args = dict(a_desc=_descriptor([t, r], [BLOCK_M, tile.block_k], bf16),
                t_desc=_descriptor([t, r], [tile.tail, tile.block_k], bf16),
                w_desc=_descriptor([e * w_rows, r], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, c], [BLOCK_M, tile.block_n], bf16),
                ct_desc=_descriptor([t, c], [tile.tail, tile.block_n], bf16), experts_ptr=int32, sorted_ptr=int32,
                used_ptr=int32, num_assignments=t, reduce_dim=r, num_col_blocks=c // tile.block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=tile.stages,
                 GROUP_M=tile.group_m, num_warps=NUM_WARPS)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS))
    ptx = out.asm["ptx"]
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    spills, serialized = ptxas_report(ptx)
    return (f"{time.perf_counter() - t0:.1f} s, {tile}, shared {out.metadata.shared} B, "
            f"setmaxnreg {regs}, ptxas spill stores {spills} B, wgmma serialized {serialized}")


def compile_tail_fp8(stages: int, consumer_regs: int, max_registers: int) -> str:
    """The fp8 down GEMM with the third (tail) consumer at a small shape (E=2, N=256, K=512)."""
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_fp8_tail import tail_down_fp8_kernel as kernel

    e, n, k, t, fp8 = 2, 256, 512, 1024, torch.float8_e4m3fn
    int32 = torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, n], [64, 128], fp8), w_desc=_descriptor([e * k, n], [128, 128], fp8),
                c_desc=_descriptor([t, k], [64, 128], torch.bfloat16), as_ptr=torch.empty(1), ws_ptr=torch.empty(1),
                experts_ptr=int32, sorted_ptr=int32, used_ptr=int32, num_assignments=t, reduce_dim=n,
                num_col_blocks=k // 128, w_rows=k, stride_as=n // 128, stride_wse=k * n // 128 ** 2,
                stride_wsr=n // 128)
    const = dict(STAGES=stages, GROUP_M=8, CONSUMER_REGS=consumer_regs, num_warps=4)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=max_registers))
    ptx = out.asm["ptx"]
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    spills, serialized = ptxas_report(ptx)
    return (f"{time.perf_counter() - t0:.1f} s, stages {stages}, regs {max_registers}/{consumer_regs}, shared "
            f"{out.metadata.shared} B, setmaxnreg {regs}, ptxas spill stores {spills} B, wgmma serialized {serialized}")


def main() -> int:
    import triton

    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile
    from moekit.experts.triton_gluon_tail import TAILS, with_tail

    failed = 0
    cases = [(2048, UP_TILE, 64, True)] + [(n, down_tile(n), tail, False) for n in (2048, 768) for tail in TAILS]
    for inter, tile, tail, gated in cases:
        name = f"triton {triton.__version__} N={inter} {'gate-up' if gated else 'down'} tail {tail}"
        try:
            print(f"OK {name}: {compile_tail_gemm(with_tail(tile, tail, gated), gated)}", flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE_T64

    name = f"triton {triton.__version__} fp8 down tail 64"
    try:
        t = DOWN_TILE_T64
        print(f"OK {name}: {compile_tail_fp8(t.stages, t.consumer_regs, t.max_registers)}", flush=True)
    except Exception as exc:  # noqa: BLE001
        failed += 1
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
