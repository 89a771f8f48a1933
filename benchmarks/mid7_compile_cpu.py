"""Compile what ``mid7_device_check.py`` runs new for sm_90 on a machine without a GPU (Gluon does not run in the
interpreter): the probe kernels (``mid7_probes.py``); layout and SMEM errors before a device run, ptxas's spills and
wgmma serialization. (The half-tile and wide gate-up GEMMs it also compiled were removed after the merged run.)

    PYTHONPATH=$PWD python3 benchmarks/mid7_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_sm90(kernel, args: dict, const: dict) -> str:
    """Compile ``kernel`` (a Gluon jit function) for sm_90 with these runtime ``args`` and ``const`` constexprs."""
    from gluon_fp8_compile_cpu import compile_gluon_sm90, sm90_summary

    from moekit.experts.triton_gluon_launch import MAX_REGISTERS, NUM_WARPS

    t0 = time.perf_counter()
    out = compile_gluon_sm90(kernel, args, const, NUM_WARPS, MAX_REGISTERS)
    return sm90_summary(out, time.perf_counter() - t0)


def gemm_args(tile, gated: bool, kind: str) -> tuple[dict, dict]:
    """(args, constexprs) of one probe at a small shape (E=2, N=512, K=512); kind "stream" or "mma"."""
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts.triton_gluon_launch import BLOCK_M, NUM_WARPS

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    int32 = torch.empty(1, dtype=torch.int32)
    a_desc = _descriptor([t, r], [BLOCK_M, tile.block_k], bf16)
    w_desc = _descriptor([e * w_rows, r], [tile.block_n, tile.block_k], bf16)
    c_desc = _descriptor([t, c], [BLOCK_M, tile.block_n], bf16)
    const = dict(GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                 num_warps=NUM_WARPS)
    if kind == "stream":
        return (dict(a_desc=a_desc, w_desc=w_desc, experts_ptr=int32, used_ptr=int32, reduce_dim=r,
                     num_col_blocks=c // tile.block_n), dict(W_ROWS=w_rows, **const))
    return (dict(a_desc=a_desc, w_desc=w_desc, c_desc=c_desc, used_ptr=int32, reduce_dim=r,
                 num_col_blocks=c // tile.block_n), const)


def main() -> int:
    import mid7_probes
    from gluon_fp8_compile_cpu import report_each

    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile

    jobs = []
    for gated, tile in ((True, UP_TILE), (False, down_tile(14336))):
        for kind, kernel in (("stream", mid7_probes.stream_kernel), ("mma", mid7_probes.mma_kernel)):
            jobs.append((f"probe {kind} {'gate-up' if gated else 'down'}",
                         lambda kn=kernel, t=tile, g=gated, kd=kind: compile_sm90(kn, *gemm_args(t, g, kd))))
    return report_each(jobs)


if __name__ == "__main__":
    sys.exit(main())
