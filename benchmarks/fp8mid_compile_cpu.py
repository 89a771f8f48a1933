"""Compile the fp8 GEMMs of ``fp8mid_device_check`` for sm_90 on a machine without a GPU: the one-tile-a-program
kernels (``gemm_fp8``) and the persistent ones (``gemm_fp8_persistent``) at Qwen3-30B-A3B's tuned
tiles (TMA weights) of M = 1024 (BM 64) and M = 64 (BM 16), so a compile error or a spill shows before device time;
each gate-up also with PAIR_DOT (session 27: gate and up in one dot a step, through ``triton_cache.pair_descriptor``).

    PYTHONPATH=$PWD python3 benchmarks/fp8mid_compile_cpu.py

Prints per kernel: seconds, SMEM bytes, ptxas registers / spill stores (sm_90a), how many TMA loads and
``cp.async`` copies the TTGIR holds (a flattened loop that pipelines issues its next tile's loads in the loop), its
wgmmas (shapes) and their waits (pendings), and its layout conversions (one through shared memory is a cost).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_report import report_jobs  # noqa: E402

E, N, K, A, M = 128, 768, 2048, 8192, 1024


def _desc(rows: int, cols: int, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(torch.empty(rows, cols, dtype=torch.float8_e4m3fn), block)


def compile_one(kernel, pointers: dict, scalars: dict, const: dict, num_warps: int, num_stages: int) -> str:
    import triton
    from gluon_fp8_compile_cpu import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    const = const | {name: 1 for name in ("stride_xk", "stride_wk", "stride_wn") if name in scalars}  # 1 specialised
    plain = dict(b13_ptr=None, b2_ptr=None, ACT=None, INTERLEAVED=False, ALPHA=1.0, LIMIT=None, UP_SHIFT=0.0)
    const = {name: v for name, v in plain.items() if name in kernel.arg_names} | const  # fpb40's variant: plain
    sig = {name: mangle_type(v) for name, v in pointers.items()}
    sig |= {name: "i32" for name in scalars if name not in const} | {name: "constexpr" for name in const}
    missing = [a for a in kernel.arg_names if a not in sig]
    if missing:
        raise TypeError(f"not given: {missing}")
    # as a launch specialises them: pointers and the scalars that are multiples of 16 (all but top_k, strides 1)
    aligned = [n for n in sig if sig[n] != "constexpr" and n not in ("top_k", "stride_wk", "stride_wn", "stride_xk")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if not n.startswith("w_ptr")}
    src = ASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()}, attrs)
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                            num_stages=num_stages))
    ttgir, ptx = out.asm["ttgir"], out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    tma = len(re.findall(r"async_tma_copy_global_to_local", ttgir))
    cp_async = len(re.findall(r"async_copy_global_to_local", ttgir))
    wgmma = re.findall(r"ttng.warp_group_dot [^\n]*-> tensor<(\d+x\d+)", ttgir)
    waits = re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)
    return (f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, spill stores {spills} B, "
            f"wgmma serialized {serialized}, TTGIR TMA loads {tma}, cp.async copies {cp_async}, "
            f"scf.for loops {ttgir.count('scf.for ')}, wgmma {wgmma} waits {waits}, mma.sync dots "
            f"{ttgir.count('tt.dot ')}, layout conversions {ttgir.count('convert_layout')}")


# (label, BLOCK_M, gate-up GROUP_M / warps / stages, down GROUP_M / warps / stages): the tuned entries 1024 and 64
TILES = (("M=1024", 64, (8, 8, 4), (8, 4, 4)), ("M=64", 16, (1, 4, 4), (1, 4, 4)))


def main() -> int:
    failed = 0
    for tile in TILES:
        failed += compile_tile(*tile)
    return 1 if failed else 0


def compile_tile(label: str, block_m: int, up_tile: tuple, down_tile: tuple) -> int:
    from moekit.experts._kernels import gemm_fp8, gemm_fp8_persistent as pk
    from moekit.experts.triton_cache import pair_chunk, pair_descriptor

    f32, i32 = torch.empty(1), torch.empty(1, dtype=torch.int32)
    fp8 = torch.empty(1, dtype=torch.float8_e4m3fn)
    bf16 = torch.empty(1, dtype=torch.bfloat16)
    up = dict(GROUP_N=128, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=up_tile[0], UPCAST=False, EMULATE=False,
              W_DESC=True, ONE_BLOCK=True, PDL=True)
    down = dict(up, GROUP_M=down_tile[0])
    up_ptrs = dict(xq_ptr=fp8, xs_ptr=f32, w_ptr=_desc(E * 2 * N, K, [128, 128]), ws_ptr=f32, hq_ptr=fp8, hs_ptr=f32,
                   ids_ptr=i32, sorted_ids_ptr=i32, expert_ids_ptr=i32, num_padded_ptr=i32, map_ptr=i32)
    up_scalars = dict.fromkeys(["N", "K", "num_assignments", "top_k", "stride_xm", "stride_xsm", "stride_we",
                                "stride_wn", "stride_wk", "stride_wse", "stride_wsn", "stride_wsk", "stride_hm",
                                "stride_hsm"])
    down_ptrs = dict(hq_ptr=fp8, hs_ptr=f32, w_ptr=_desc(E * K, N, [128, 128]), ws_ptr=f32, y_ptr=bf16,
                     weights_ptr=f32, ids_ptr=i32, sorted_ids_ptr=i32, expert_ids_ptr=i32, num_padded_ptr=i32,
                     out_ptr=bf16, counters_ptr=i32, map_ptr=i32)
    down_scalars = dict.fromkeys(["K", "N", "num_assignments", "stride_hm", "stride_hsm", "stride_we", "stride_wk",
                                  "stride_wn", "stride_wse", "stride_wsk", "stride_wsn", "stride_ym"])
    one = dict(up, NAIVE=False, H_FP32=False, AHEAD=True, SWAP_AB=False, HAS_MAP=False)
    two_dots = dict(PAIR_DOT=False, PAIR_CHUNK=64)
    one_up = dict(one, X_RAW=False, FOLD=False, A_PAD=1, E_PAD=1, FOLD_CHUNK=1, **two_dots)
    one_down = dict(one, KSUM=False, TOPK_PAD=1, SUM_ROWS=1, ZERO_T=1, SUM_AFTER=False, SUM_T=1, SUM_K=1)
    jobs = [
        ("gate-up one tile a program", gemm_fp8.gate_up_fp8_kernel, up_ptrs,
         up_scalars | dict.fromkeys(["num_experts", "num_pid_m", "num_global", "stride_xk"]), one_up, *up_tile[1:]),
        ("down one tile a program", gemm_fp8.down_fp8_kernel, down_ptrs,
         down_scalars | dict.fromkeys(["num_experts", "num_pid_m", "top_k", "num_global"]), one_down, *down_tile[1:]),
    ]
    jobs.append(("gate-up persistent", pk.gate_up_fp8_persistent_kernel, up_ptrs, up_scalars, up | two_dots,
                 *up_tile[1:]))
    pair_ptrs = dict(up_ptrs, w_ptr=pair_descriptor(torch.empty(E, 2 * N, K, dtype=torch.float8_e4m3fn), 128, 128))
    for name, kernel, _, scalars, const, warps, stages in (jobs[0], jobs[2]):  # the two gate-ups
        pair = dict(const, PAIR_DOT=True, PAIR_CHUNK=pair_chunk(128))
        jobs.append((f"{name}, PAIR_DOT", kernel, pair_ptrs, scalars, pair, warps, stages))
    jobs.append(("down persistent", pk.down_fp8_persistent_kernel, down_ptrs, down_scalars,
                 {k: v for k, v in down.items() if k != "EMULATE"}, *down_tile[1:]))
    return report_jobs([(f"{label} {job[0]}", lambda job=job: f"{label} {job[0]}: {compile_one(*job[1:])}")
                        for job in jobs])


if __name__ == "__main__":
    sys.exit(main())
