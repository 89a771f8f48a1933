"""Compile the one-launch Gluon decode kernel (``_kernels/gluon_decode.py``) for sm_90 on a machine without a GPU:
catches layout, barrier and shared-memory errors before a device run, reads ptxas's spills.

    PYTHONPATH=$PWD python benchmarks/gluon_decode_compile_cpu.py [--slots 8] [--block-k 128] [--stages 0] [--split 1]
        [--fp8]

Qwen3-30B-A3B's N = 768, K = 2048. Prints one line: Triton version, seconds, SMEM bytes, spill bytes, whether
ptxas serialized the wgmmas, and PTX counts (atomics, named barriers, wgmma, TMA loads, .cg loads).
Run it under Triton 3.6 too (the H200's): PYTHONPATH=<an unpacked triton 3.6 wheel>:$PWD.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

POINTERS = ("x_ptr", "ids_ptr", "wts_ptr", "h_ptr", "y_ptr", "out_ptr", "part_ptr", "up_done_ptr", "piece_ptr",
            "arrive_ptr", "exit_ptr")


def compile_decode(slots: int, block_k: int, stages: int, split: int, fp8: bool = False) -> str:
    import triton
    from gluon_fp8_compile_cpu import _descriptor, ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_decode import decode_kernel
    from moekit.experts._kernels.gluon_decode_fp8 import decode_fp8_kernel
    from moekit.experts.triton_gluon_decode import BM, plan_decode

    e, n, k, bf16, f32 = 4, 768, 2048, torch.bfloat16, torch.float32
    kernel = decode_fp8_kernel if fp8 else decode_kernel
    plan = plan_decode(slots // 8, 8, n, k, 132, block_k, stages, split, fp8=fp8)
    wdt = torch.float8_e4m3fn if fp8 else bf16
    dtypes = dict(x_ptr=bf16, h_ptr=f32 if fp8 else bf16, out_ptr=bf16, wts_ptr=f32, y_ptr=f32, part_ptr=f32,
                  w13s_ptr=f32, w2s_ptr=f32)
    pointers = POINTERS[:1] + (("w13s_ptr", "w2s_ptr") if fp8 else ()) + POINTERS[1:]
    args = dict(w13_desc=_descriptor([e * 2 * n, k], [BM, block_k], wdt),
                w2_desc=_descriptor([e * k, n], [BM, block_k], wdt),
                **{p: torch.empty(1, dtype=dtypes.get(p, torch.int32)) for p in pointers}, num_experts=e)
    const = dict(S=slots, TOP_K=8, N=n, K=k, KS=split, STAGES=plan.stages, num_warps=4)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()}, attrs)
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    counts = {op: ptx.count(op) for op in ("atom.", "red.global", "bar.sync", "wgmma.mma_async", "cp.async.bulk.tensor",
                                           "ld.global.cg")}
    return (f"triton {triton.__version__} {plan}: {time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B "
            f"(plan {plan.shared_bytes()}), ptxas spill stores {spills} B, wgmma serialized {serialized}, {counts}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--stages", type=int, default=0)
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--fp8", action="store_true", help="the fp8_block kernel (gluon_decode_fp8)")
    a = parser.parse_args()
    try:
        print("OK", compile_decode(a.slots, a.block_k, a.stages, a.split, a.fp8), flush=True)
    except Exception as exc:  # noqa: BLE001 (the error, not a traceback through the compiler)
        print(f"FAIL: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
