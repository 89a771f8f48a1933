"""Compile ``ovl_kernels.ovl_kernel`` for sm_90 on a machine without a GPU (Gluon does not run in the interpreter):
each dtype / consumer count / chunking / mode the device check runs, with its SMEM, the partitions' setmaxnreg,
ptxas's spills and whether it serialized the wgmmas.

    PYTHONPATH=$PWD python3 benchmarks/ovl_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=/tmp/f8pre-site:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

TOKENS = {"bf16": (32, 128, 256, 1024), "fp8": (32, 256, 512)}  # T rows an expert: the cells' kinds of tile


def jobs() -> list:
    """(name, dtype, consumers, block_k, tn, nchunk, stages, mode, promote) of every tile the device check runs."""
    import ovl_cells as oc

    got, seen = [], set()
    for dtype, tokens in TOKENS.items():
        for t in tokens:
            for cfg in oc.bound_cfgs(dtype):
                p = oc.op.plan_for(2, 1024, 1024, 2 * t, 64 * cfg.consumers, cfg.block_k, cfg.tn, 1)
                key = (dtype, cfg.consumers, cfg.block_k, p.tn, p.nchunk, cfg.stages, cfg.mode, cfg.promote)
                if key in seen:
                    continue
                seen.add(key)
                got.append((f"{dtype} T{t} {cfg.name}", torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn,
                            cfg.consumers, cfg.block_k, p.tn, p.nchunk, cfg.stages, cfg.mode, cfg.promote))
    return got


def compile_one(dtype, consumers: int, block_k: int, tn: int, nchunk: int, stages: int, mode: str,
                promote: int) -> str:
    from gluon_fp8_compile_cpu import _descriptor, compile_gluon_sm90, sm90_summary

    import ovl_kernels as ok

    e, n, k = 2, 512, 1024
    box = [64, block_k]
    args = dict(w13_desc=_descriptor([e * 2 * n, k], box, dtype), w2_desc=_descriptor([e * k, n], box, dtype),
                a_desc=_descriptor([tn * min(nchunk, 2), block_k], [tn, block_k], dtype), out_ptr=torch.empty(1),
                boxes=100, boxes13=60, steps13=k // block_k, steps2=n // block_k)
    const = dict(STAGES=stages, CONSUMERS=consumers, NCHUNK=nchunk, INSTR_K=32 if dtype.itemsize == 1 else 16,
                 MODE=ok.MODES[mode], PROMOTE=promote, CONSUMER_REGS=ok.CONSUMER_REGS, TN=tn, num_warps=4)
    t0 = time.perf_counter()
    out = compile_gluon_sm90(ok.ovl_kernel, args, const, 4, ok.MAX_REGISTERS[consumers])
    wgmma = sum(1 for ln in out.asm["ptx"].splitlines() if "wgmma.mma_async" in ln)
    want = expected_wgmmas(consumers, nchunk, mode, promote)
    if wgmma != want:  # a merged (CSE'd) or dropped wgmma: CK1b's first pipelined promotion ran half of them
        raise AssertionError(f"{wgmma} wgmma.mma_async in the PTX, {want} expected")
    return f"{sm90_summary(out, time.perf_counter() - t0)}, wgmma.mma_async in PTX {wgmma} (as expected)"


def expected_wgmmas(consumers: int, nchunk: int, mode: str, promote: int) -> int:
    """wgmma.mma_async instructions in the PTX: 4 a wgmma (BK / k: 64 / 16 bf16, 128 / 32 e4m3); wgmmas in a
    consumer's code: NCHUNK unrolled (plain), 1 in the chunk loop (promotion), 2 in the pair loop (pipelined; with one
    chunk a pair of boxes and a lone last box, 3); one copy a consumer partition."""
    if mode == "loads":
        return 0
    per = {0: nchunk, 1: 1, 2: 3 if nchunk % 2 else 2}[promote]
    return 4 * per * consumers


def main() -> int:
    from gluon_fp8_compile_cpu import report_each

    only = sys.argv[1:]
    return report_each([(name, lambda j=job: compile_one(*j)) for name, *job in jobs()
                        if not only or any(o in name for o in only)])


if __name__ == "__main__":
    sys.exit(main())
