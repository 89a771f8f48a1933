"""The word MMA decode's main loops (``_kernels/gemm_wo_mma``, decode "mma", FAST placement on) in sm_90 SASS,
compiled on a machine without a GPU: SASS instructions a weight per thread (the loop body x 32 x warps over the
weights a step), registers, spills, shared memory, the programs an SM can hold (occupancy from the registers, the
shared memory and the warps; an H200 SM: 64K registers, 227 KB shared, 64 warps, 32 programs), and the opcodes that
tell where the operands travel (HMMA: the dots; LDGSTS: cp.async stages; STS / LDS / LDSM / BAR: shared memory;
LDL / STL: spills).

    PYTHONPATH=$PWD python benchmarks/wo_mma_sass_cpu.py            # the candidate tiles, both schemes
    PYTHONPATH=$PWD python benchmarks/wo_mma_sass_cpu.py --quick    # the heuristic's tiles (the test's compile check)
    PYTHONPATH=/path/to/triton-3.6:$PWD python benchmarks/wo_mma_sass_cpu.py --pairs 1   # another Triton, order
    PYTHONPATH=$PWD python benchmarks/wo_mma_sass_cpu.py --block-k 256 --tiles 32:1:3 64:2:2   # 32-word steps
    PYTHONPATH=$PWD python benchmarks/wo_mma_sass_cpu.py --block-k 256 --tiles 32:1:3 --halves   # session 29

The compile is ``wo_reg_sass_cpu``'s (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, the launch's
``tt.divisibility`` hints). Weights a loop step: BN x BLOCK_K (x 2 for gate-up).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_report import report_jobs  # noqa: E402
from wo_gemv_sass_cpu import main_loop_of  # noqa: E402
from wo_reg_sass_cpu import _compile  # noqa: E402

REGISTERS, SHARED, WARPS, PROGRAMS = 65536, 227 * 1024, 64, 32  # an H200 (sm_90) SM's limits


@dataclass
class MmaCount:
    name: str
    per_weight: float  # SASS instructions a weight, per thread
    registers: int
    stack: int  # bytes a thread (spills)
    shared: int  # bytes a program (the cp.async stages included)
    programs: int  # programs an SM can hold
    top: str  # opcodes of interest


def programs_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Resident programs an SM holds: registers (allocated 256 a warp at a time), shared memory, warps, programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGISTERS // (per_warp * num_warps)
    by_shared = SHARED // max(shared, 1)
    return max(0, min(by_regs, by_shared, WARPS // num_warps, PROGRAMS))


def count(scheme: int, block_n: int, down: bool, num_warps: int, num_stages: int,
          pairs: int | None = None, block_k: int = 128, halves: bool = False, block_m: int = 16) -> MmaCount:
    """One kernel's counts; ``halves``: the gate-up as ``gate_up_halves_wo_mma_kernel`` (one side's rows a program);
    ``block_m``: the rows (tokens) of a block."""
    from moekit.experts._kernels import gemm_wo_mma
    from moekit.experts.triton_wo_mma import operand_pairs

    fn = getattr(gemm_wo_mma, "down_wo_mma_kernel" if down else
                 f"gate_up{'_halves' if halves else ''}_wo_mma_kernel")
    pointers = {n: "*bf16" for n in ("x_ptr", "h_ptr", "y_ptr", "weights_ptr", "out_ptr")}
    pointers |= {n: "*i32" for n in ("ids_ptr", "sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr", "counters_ptr",
                                      "map_ptr")}
    pointers |= {"q_ptr": "*u8", "s_ptr": "*u8" if scheme == 2 else "*fp32", "z_ptr": "*u8", "p_ptr": "*fp32"}
    group = {0: block_k, 1: 128, 2: 32}[scheme]
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPAN=min(block_k, group), GROUP=group, GROUP_M=1,
                 SCHEME=scheme, ACT=0, NAIVE=True, UPCAST=False, PDL=False, ASM=True, SPLIT=1,
                 KSUM=False, TOPK_PAD=1, HAS_MAP=False, SUM_ROWS=1, ZERO_T=1,
                 PAIRS=operand_pairs() if pairs is None else pairs, SCALE_WORD=scheme == 2, PER=4 if scheme == 0 else 8,
                 stride_xk=1, stride_qc=1, stride_sg=1,  # unit strides: constants at launch
                 b13_ptr=None, b2_ptr=None,  # no expert biases (session 40's pointers: the plain kernels)
                 LIMIT_AFTER=False)  # act48's constexpr, passed as the launch passes it
    out = _compile(fn, pointers, {k: v for k, v in const.items() if k in fn.arg_names}, num_warps, num_stages)
    m = main_loop_of(out)
    weights = block_n * block_k * (1 if down or halves else 2)
    ops, registers, shared = m.ops, m.registers, int(out.metadata.shared)
    kind = "down" if down else f"gate-up{' halves' if halves else ''}"
    name = (f"mma {('int8', 'int4', 'mxfp4')[scheme]} {kind} {block_n}x{block_k} {num_warps}w {num_stages}s "
            f"BM {block_m} PAIRS {const['PAIRS']}")
    top = " ".join(f"{k}:{ops[k]}" for k in ("HMMA", "LOP3", "SHF", "PRMT", "IMAD", "FFMA", "HFMA2", "LDG", "LDGSTS",
                                             "LDL", "STL", "STS", "LDS", "LDSM", "BAR", "SHFL") if ops[k])
    return MmaCount(name, len(m.loop) * 32 * num_warps / weights, registers, m.stack, shared,
                    programs_per_sm(registers, shared, num_warps), top)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the heuristic's tiles (6 kernels: int8, int4, mxfp4) and the "
                   "int4 halves' taken gate-up tiles (2)")
    p.add_argument("--pairs", type=int, choices=(1, 2), help="the kernels' PAIRS (default: this Triton's, "
                   "``triton_wo_mma.operand_pairs``)")
    p.add_argument("--block-k", type=int, nargs="+", default=[128], choices=(128, 256),
                   help="the steps' columns (BLOCK_K: 64 or 128 bytes of a 4-bit row a step, 128 or 256 of int8)")
    p.add_argument("--tiles", nargs="+", help="BN:warps:stages (default: the candidates)")
    p.add_argument("--schemes", type=int, nargs="+", default=[1, 2], choices=(0, 1, 2), help="0 int8, 1 int4, 2 mxfp4")
    p.add_argument("--halves", action="store_true", help="the gate-up's gate and up rows in separate programs")
    p.add_argument("--block-m", type=int, default=16, choices=(16, 32, 64), help="the rows (tokens) of a block")
    args = p.parse_args(argv)
    if args.tiles:
        tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles]
        jobs = [(s, bn, d, w, st, args.halves) for s in args.schemes for d in (False, True) for bn, w, st in tiles]
    elif args.quick:  # (scheme, BN, down, warps, stages)
        jobs = [(s, 32, d, 1, 3, False) for s in (0, 1, 2) for d in (False, True)]
        jobs += [(1, 32, False, 1, 3, True), (1, 64, False, 2, 3, True)]  # the halves' taken int4 tiles
    else:
        jobs = [(s, bn, d, w, st, args.halves) for s in (1, 2) for d in (False, True)
                for bn, w in ((16, 1), (32, 1), (64, 2), (128, 4)) for st in (3, 4)]
    def line(job: tuple, job_k: int) -> str:
        c = count(*job[:5], pairs=args.pairs, block_k=job_k, halves=job[5], block_m=args.block_m)
        return (f"{c.name}: {c.per_weight:.2f} instructions a weight, {c.registers} registers, stack {c.stack} B, "
                f"shared {c.shared} B, {c.programs} programs an SM; {c.top}")

    return report_jobs([(f"{job}", lambda job=job, bk=bk: line(job, bk)) for bk in args.block_k for job in jobs])


if __name__ == "__main__":
    sys.exit(main())
