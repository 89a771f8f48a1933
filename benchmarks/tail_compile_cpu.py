"""Compile the bf16 Gluon down GEMM with merged tails (``_kernels/gluon_gemm_tail.py``) for sm_90 without a GPU, at
the route's down tiles with the tail (wide and narrow experts): layout and SMEM errors before a device run, ptxas's
spills and wgmma serialization.

    PYTHONPATH=$PWD python3 benchmarks/tail_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_tail_down(tile) -> str:
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_tail import tail_down_kernel as kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    int32 = torch.empty(1, dtype=torch.int32)
    w_rows, r, c = k, n, k
    args = dict(a_desc=_descriptor([t, r], [BLOCK_M, tile.block_k], bf16),
                t_desc=_descriptor([t, r], [tile.tail, tile.block_k], bf16),
                w_desc=_descriptor([e * w_rows, r], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, c], [BLOCK_M, tile.block_n], bf16),
                ct_desc=_descriptor([t, c], [tile.tail, tile.block_n], bf16), experts_ptr=int32, sorted_ptr=int32,
                used_ptr=int32, num_assignments=t, reduce_dim=r, num_col_blocks=c // tile.block_n)
    const = dict(W_ROWS=w_rows, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=NUM_WARPS)
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


def main() -> int:
    import triton

    from moekit.experts.triton_gluon_launch import down_tile

    failed = 0
    for inter in (2048, 768):
        name = f"triton {triton.__version__} N={inter} down tail 64"
        try:
            print(f"OK {name}: {compile_tail_down(down_tile(inter, tail=True))}", flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
