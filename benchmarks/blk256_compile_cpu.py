"""Compile the 256-row bf16 Gluon gate-up GEMM (``_kernels/gluon_gemm_blk256.py``) for sm_90 on a machine without a GPU
(Gluon does not run in the interpreter): layout and SMEM errors before a device run, ptxas's spills and wgmma
serialization, the SMEM the compiler allocated against ``GluonTile.shared_bytes``.

    PYTHONPATH=$PWD python3 benchmarks/blk256_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_sm90(kernel, args: dict, const: dict) -> str:
    """Compile ``kernel`` (a Gluon jit function) for sm_90 with these runtime ``args`` and ``const`` constexprs."""
    import triton
    from gluon_fp8_compile_cpu import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts.triton_gluon_blk256 import CONSUMER_WARPS, MAX_REGISTERS

    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=CONSUMER_WARPS,
                                                                               maxnreg=MAX_REGISTERS))
    ptx = out.asm["ptx"]
    regs = sorted({ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln})
    spills, serialized = ptxas_report(ptx)
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, "
            f"ptxas spill stores {spills} B, wgmma serialized {serialized}")


def gemm_args(tile) -> tuple[dict, dict]:
    """(args, constexprs) of the kernel at a small shape (E=2, N=512, K=512)."""
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts.triton_gluon_blk256 import CONSUMER_REGS, SUB_M, out_cols

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    cols = out_cols(tile)
    int32 = torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, k], [SUB_M, tile.block_k], bf16),
                w_desc=_descriptor([e * 2 * n, k], [cols, tile.block_k], bf16),
                c_desc=_descriptor([t, n], [SUB_M, cols], bf16), experts_ptr=int32, used_ptr=int32,
                sorted_ptr=int32, num_assignments=t, reduce_dim=k, num_col_blocks=n // cols)
    const = dict(W_ROWS=2 * n, GATE_OFFSET=n, STAGES=tile.stages, GROUP_M=tile.group_m, SEARCH_STEPS=4,
                 CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return args, const


def main() -> int:
    import triton

    from blk256_variants import UP_VARIANTS

    from moekit.experts._kernels.gluon_gemm_blk256 import blk256_gemm_kernel

    failed = 0
    for name, tile in UP_VARIANTS.items():
        try:
            report = compile_sm90(blk256_gemm_kernel, *gemm_args(tile))
            print(f"OK triton {triton.__version__} {name} {tile} (model SMEM {tile.shared_bytes(True)} B): {report}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL triton {triton.__version__} {name}: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
