"""Compile every bf16 Gluon tile of ``ridge_variants`` for sm_90 on a machine without a GPU (Gluon does not run in
the interpreter): catches layout and shared-memory errors before a device run and reads ptxas's spills.

    PYTHONPATH=$PWD python benchmarks/ridge_compile_cpu.py

Needs a Triton whose Gluon has ``GluonASTSource`` (3.9 here); reuses ``gluon_fp8_compile_cpu``'s descriptor and
ptxas helpers. Prints one line per (variant, GEMM): seconds, SMEM bytes, the partitions' setmaxnreg, spill bytes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_bf16_gemm(tile, gated: bool) -> str:
    """One GEMM of the bf16 Gluon kernel at a small shape (E=2, N=512, K=512; W_ROWS, GATE_OFFSET constexprs)."""
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm import grouped_gemm_kernel as kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    int32 = torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, r], [BLOCK_M, tile.block_k], bf16),
                w_desc=_descriptor([e * w_rows, r], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, c], [BLOCK_M, tile.block_n], bf16), experts_ptr=int32, used_ptr=int32,
                reduce_dim=r, num_col_blocks=c // tile.block_n)
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
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, "
            f"ptxas spill stores {spills} B, wgmma serialized {serialized}")


def main() -> int:
    from ridge_variants import bf16_gluon_tiles

    failed = 0
    for inter in (14336, 768):
        for name, (up, down) in bf16_gluon_tiles(inter).items():
            for gemm, tile, gated in (("gate-up", up, True), ("down", down, False)):
                try:
                    print(f"OK N={inter} {name} {gemm}: {compile_bf16_gemm(tile, gated)}", flush=True)
                except Exception as exc:  # noqa: BLE001 (report each GEMM)
                    failed += 1
                    print(f"FAIL N={inter} {name} {gemm} {tile}: {type(exc).__name__}: {str(exc)[-1500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
