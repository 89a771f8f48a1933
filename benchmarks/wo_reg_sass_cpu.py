"""The register decode's main loops (``_kernels/gemm_wo_reg``, decode "register", inline PTX on) in sm_90 SASS,
compiled on a machine without a GPU (session 24 also counted a word MMA decode, removed after it lost on the
H200: 2.63 / 5.05 instructions a weight for int4 / mxfp4 gate-up; history at 1fa2c6c): SASS
instructions a weight per thread (the loop body x 32 x warps over the weights a step), registers, spills, and
whether the dots run on wgmma (HGMMA) or mma.sync (HMMA); unswapped against SWAP_AB (``KernelConfig.swap_ab``: the
weight tile as the MMA's M side).

    PYTHONPATH=$PWD python benchmarks/wo_reg_sass_cpu.py            # register loops, both orders

The compile is ``wo_gemv_sass_cpu``'s (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, the launch's
``tt.divisibility`` hints). Weights a loop step: BN x BLOCK_K (x 2 for gate-up). Tiles: the heuristic's decode
tiles (16-row blocks; gate-up 64 x 128, down 128 x 128, 4 warps, 4 stages) and 128-row gate-up tiles.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wo_gemv_sass_cpu import LoopCount, _report, main_loop_of  # noqa: E402

DIVISIBLE = ("x_ptr", "h_ptr", "q_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "K_STORED", "N_STORED", "stride_xm",
             "stride_qe", "stride_qr", "stride_se", "stride_sr", "stride_ze", "stride_zr", "stride_hm", "stride_ym",
             "split_len", "KW", "NW")


def _compile(fn, pointer_types: dict, const: dict, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.triton_bind import COMPILE_OPTIONS

    sig = {n: "constexpr" if n in const else pointer_types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                               num_stages=num_stages,
                                                                               **COMPILE_OPTIONS))


def count(scheme: int, block_n: int, block_k: int, swap: bool, down: bool = False, num_warps: int = 4,
          num_stages: int = 4) -> LoopCount:
    from moekit.experts._kernels import gemm_wo_reg

    fn = getattr(gemm_wo_reg, f"{'down' if down else 'gate_up'}_wo_reg_kernel")
    pointers = {n: "*bf16" for n in ("x_ptr", "h_ptr", "y_ptr", "weights_ptr", "out_ptr")}
    pointers |= {n: "*i32" for n in ("ids_ptr", "sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr", "counters_ptr",
                                      "map_ptr")}
    pointers |= {"q_ptr": "*u8", "s_ptr": "*fp32" if scheme == 1 else "*u8", "z_ptr": "*u8"}
    group = 128 if scheme == 1 else 32
    const = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPAN=min(block_k, group), GROUP=group, GROUP_M=1,
                 SCHEME=scheme, ACT=0, NAIVE=True, UPCAST=False, PDL=False, ASM=True, SPLIT=1, KSUM=False,
                 TOPK_PAD=1, HAS_MAP=False, SUM_ROWS=1, ZERO_T=1, SWAP_AB=swap)
    m = main_loop_of(_compile(fn, pointers, {k: v for k, v in const.items() if k in fn.arg_names}, num_warps,
                              num_stages))
    weights = block_n * block_k * (1 if down else 2)
    name = (f"register {'int4' if scheme == 1 else 'mxfp4'} {'down' if down else 'gate-up'} {block_n}x{block_k} "
            f"{num_warps}w {num_stages}s{' SWAP_AB' if swap else ''}")
    return LoopCount(name, len(m.loop) * 32 * num_warps / weights, m.registers, m.stack,
                     " ".join(f"{k}:{v}" for k, v in m.ops.most_common(10))
                     + f" (HGMMA {m.ops['HGMMA']}, HMMA {m.ops['HMMA']})")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    jobs = [(s, bn, 128, sw, d) for s in (1, 2) for d in (False, True) for bn in ((128,) if d else (64, 128))
            for sw in (False, True)]  # (scheme, BN, BK, swap, down)
    return _report(jobs, count)


if __name__ == "__main__":
    sys.exit(main())
