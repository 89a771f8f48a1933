"""Compile the bf16 Gluon down GEMM (``_kernels/gluon_gemm.py``, not GATED) and the gate-up GEMM gathering in its
loader (``gluon_gemm_gather.py``) for sm_90 on a machine without a GPU, with and without LATE_STORE (each tile's
product stored under the next tile's first MMAs): catches layout, barrier and shared-memory errors before a device
run and reads ptxas's spills and wgmma serialization.

    PYTHONPATH=$PWD python benchmarks/prefill6_compile_cpu.py [--ptx DIR]

Prints one line per form: seconds, SMEM bytes, the partitions' setmaxnreg, spill bytes, whether ptxas serialized the
wgmmas (C7514), the wgmma wait count. ``--ptx``: keep each PTX there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_plain(tile, late_store: bool, gated: bool = False) -> tuple[str, str]:
    """The plain GEMM at a small shape (E=2, N=768, K=512: shapes reach the kernel as i32 arguments), the down GEMM
    or (``gated``) the gate-up GEMM reading x_perm by TMA: (line, PTX)."""
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm import grouped_gemm_kernel as kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS

    e, n, k, t, bf16 = 2, 768, 512, 1024, torch.bfloat16
    int32 = torch.empty(1, dtype=torch.int32)
    red, cols, w_rows = (k, n, 2 * n) if gated else (n, k, k)  # reduce over K into N columns, or over N into K
    args = dict(a_desc=_descriptor([t, red], [BLOCK_M, tile.block_k], bf16),
                w_desc=_descriptor([e * w_rows, red], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, cols], [BLOCK_M, tile.block_n], bf16), experts_ptr=int32, used_ptr=int32,
                reduce_dim=red, num_col_blocks=cols // tile.block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=tile.stages,
                 GROUP_M=tile.group_m, num_warps=NUM_WARPS, LATE_STORE=late_store)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("experts_ptr", "used_ptr", "reduce_dim")}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()}, attrs)
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS))
    ptx = out.asm["ptx"]
    regs = [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln]
    spills, serialized = ptxas_report(ptx)
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, ptxas spill "
            f"stores {spills} B, wgmma serialized {serialized}, wgmma.wait_group {ptx.count('wgmma.wait_group')}, "
            f"TMA stores {ptx.count('cp.async.bulk.tensor.2d.global.shared')}"), ptx


def main() -> int:
    from moekit.experts.triton_gluon_launch import DOWN_TILE, NARROW_DOWN_TILE, UP_TILE

    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", type=Path)
    args = parser.parse_args()
    failed = 0
    for name, tile, gated in (("narrow down", NARROW_DOWN_TILE, False), ("wide down", DOWN_TILE, False),
                              ("TMA gate-up", UP_TILE, True)):
        for late in (False, True):
            try:
                line, ptx = compile_plain(tile, late, gated)
            except Exception as exc:  # noqa: BLE001 (the error, not a traceback through the compiler)
                print(f"FAIL {name} late_store={late}: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
                failed += 1
                continue
            print(f"OK {name} late_store={late}: {line}", flush=True)
            if args.ptx:
                args.ptx.mkdir(parents=True, exist_ok=True)
                (args.ptx / f"{name.replace(' ', '_')}_late{int(late)}.ptx").write_text(ptx)
    from gather_compile_cpu import compile_gather_gemm

    for late in (False, True):
        try:
            line, ptx = compile_gather_gemm(UP_TILE, late)
        except Exception as exc:  # noqa: BLE001
            print(f"FAIL gather gate-up late_store={late}: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
            failed += 1
            continue
        print(f"OK gather gate-up late_store={late}: {line}", flush=True)
        if args.ptx:
            (args.ptx / f"gather_up_late{int(late)}.ptx").write_text(ptx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
