"""Compile the probes of ``f8mid8_probes.py`` (loads alone, consumers alone, wgmmas alone, the GEMM without the
promotion) for sm_90 on a machine without a GPU, at the fp8 Gluon plan's gate-up and down tiles; per kernel its
SMEM, the partitions' setmaxnreg and ptxas's spill stores (``gluon_fp8_compile_cpu.ptxas_report``). (The down GEMM
with the tail consumer it also compiled until 827fb54: removed.)

    PYTHONPATH=$PWD python3 benchmarks/f8mid8_compile_cpu.py                   # Triton 3.9 (this machine)
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/f8mid8_compile_cpu.py   # Triton 3.6 (the H200's)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gluon_fp8_compile_cpu import _descriptor, compile_gluon_sm90, report_each, sm90_summary  # noqa: E402

E, N, K, T = 2, 256, 512, 1024  # shapes reach the kernels only as i32 arguments
FP8 = torch.float8_e4m3fn
INT32 = torch.empty(1, dtype=torch.int32)


def _compile(kernel, args: dict, const: dict, num_warps: int, maxnreg: int | None) -> str:
    t0 = time.perf_counter()
    return sm90_summary(compile_gluon_sm90(kernel, args, const, num_warps, maxnreg), time.perf_counter() - t0)


def _gemm_shapes(gated: bool) -> tuple[int, int, int]:
    """(w_rows, reduce, cols) of the gate-up (W [2N, K], out [T, N]) or down GEMM (W [K, N], out [T, K])."""
    return (2 * N, K, N) if gated else (K, N, K)


def probe(kind: str, gated: bool, tile) -> str:
    import f8mid8_probes as p

    w_rows, r, c = _gemm_shapes(gated)
    a64, w = _descriptor([T, r], [64, 128], FP8), _descriptor([E * w_rows, r], [128, 128], FP8)
    gate_offset = N if gated else 0
    if kind == "stream":
        args = dict(a_desc=a64, w_desc=w, experts_ptr=INT32, used_ptr=INT32, reduce_dim=r, num_col_blocks=c // 128,
                    w_rows=w_rows, gate_offset=gate_offset)
        const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=4)
        return _compile(p.stream_fp8_kernel, args, const, 4, None)
    if kind == "consumers":
        args = dict(a_desc=a64, w_desc=w, c_desc=_descriptor([T, c], [64, 128], FP8 if gated else torch.bfloat16),
                    as_ptr=torch.empty(1), ws_ptr=torch.empty(1), cs_ptr=torch.empty(1), experts_ptr=INT32,
                    used_ptr=INT32, reduce_dim=r, num_col_blocks=c // 128, gate_offset=gate_offset,
                    stride_as=r // 128, stride_wse=w_rows * r // 128 ** 2, stride_wsr=r // 128, stride_cs=c // 128)
        const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                     num_warps=4)
        return _compile(p.consumers_fp8_kernel, args, const, 4, tile.max_registers)
    if kind == "unpromoted":
        args = dict(a_desc=a64, w_desc=w, c_desc=_descriptor([T, c], [64, 128], FP8 if gated else torch.bfloat16),
                    cs_ptr=torch.empty(1), experts_ptr=INT32, used_ptr=INT32, reduce_dim=r, num_col_blocks=c // 128,
                    w_rows=w_rows, gate_offset=gate_offset, stride_cs=c // 128)
        const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                     num_warps=4)
        return _compile(p.unpromoted_fp8_kernel, args, const, 4, tile.max_registers)
    args = dict(a_desc=_descriptor([T, r], [128, 128], FP8), w_desc=w,
                c_desc=_descriptor([T, c], [128, 128], torch.bfloat16), used_ptr=INT32, reduce_dim=r,
                num_col_blocks=c // 128, gate_offset=gate_offset)
    const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=8)
    return _compile(p.mma_fp8_kernel, args, const, 8, None)


def main() -> int:
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

    jobs = []
    for kind in ("stream", "consumers", "mma", "unpromoted"):
        for gated, tile in ((True, UP_TILE), (False, DOWN_TILE)):
            jobs.append((f"{kind} {'gate-up' if gated else 'down'}", lambda k=kind, g=gated, t=tile: probe(k, g, t)))
    return report_each(jobs)


if __name__ == "__main__":
    sys.exit(main())
