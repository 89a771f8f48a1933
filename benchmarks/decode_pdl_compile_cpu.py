"""Compile the down GEMMs with PRELOAD (weights before the PDL wait, ``_kernels/gemm.py``) for sm_90 on a machine
without a GPU: registers and spills a thread (the preloaded tiles live in registers), and the order of the weight loads
against ``griddepcontrol.wait`` in the PTX (all PRELOAD tiles' loads must come before it).

    PYTHONPATH=$PWD python benchmarks/decode_pdl_compile_cpu.py

Pointer loads (what the plan gives a preloading down GEMM), one line per (dtype, tile, PRELOAD): registers, stack
bytes, shared memory, loads before / after the wait. Then the TMA descriptor form's order before the wait: "T" a bulk
tensor copy, "w" an mbarrier wait; "TwTwTw..." means each tile's copy waits for the one before (why the plan takes
pointers for it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_down(fp8: bool, block_n: int, num_warps: int, preload: int, swap: bool, tma: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.experts._kernels import gemm, gemm_fp8

    fn = gemm_fp8.down_fp8_kernel if fp8 else gemm.down_kernel
    act = "*fp8e4nv" if fp8 else "*bf16"
    w = f"tensordesc<{act[1:]}[{block_n}, 128]>" if tma else act
    types = {"hq_ptr": act, "h_ptr": act, "hs_ptr": "*fp32", "w_ptr": w, "w2_ptr": w, "ws_ptr": "*fp32",
             "y_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
    const = dict(GROUP_N=128, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, NAIVE=True, UPCAST=False,
                 EMULATE=False, H_FP32=False, W_DESC=tma, ONE_BLOCK=True, PDL=True, AHEAD=True, SWAP_AB=swap,
                 KSUM=False, PRELOAD=preload, PRECISION="tf32", b2_ptr=None, sorted_ids_ptr=None,
                 expert_ids_ptr=None, num_padded_ptr=None, out_ptr=None, counters_ptr=None, map_ptr=None,
                 TOPK_PAD=1, HAS_MAP=False, SUM_ROWS=1, ZERO_T=1, top_k=1, num_global=0,
                 stride_wn=1, stride_wsn=1)  # Triton's runtime specialises strides of 1 as constants
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    # the runtime marks pointers and ints divisible by 16 so (N, K, the strides here): without it masked loads are bytes
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if sig[n].startswith("*") or n.startswith("stride_") or n in ("N", "K")}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=4))
    ptx = out.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    before, after = len(re.findall(r"ld\.global", ptx[:wait])), len(re.findall(r"ld\.global", ptx[wait:]))
    if tma:
        order = "".join("T" if op.startswith("cp") else "w"
                        for op in re.findall(r"cp\.async\.bulk\.tensor|mbarrier\.try_wait", ptx[:wait]))
        return f"{'fp8' if fp8 else 'bf16'} d{block_n} w{num_warps} pre{preload} TMA: before the wait {order}"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(out.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    return (f"{'fp8' if fp8 else 'bf16'} d{block_n} w{num_warps} pre{preload}{' swap' if swap else ''}: "
            f"registers {regs}, stack {stack} B, shared {out.metadata.shared} B, ld.global before the wait {before}, "
            f"after {after}")


def main() -> int:
    jobs = [(True, 64, 4, p, True) for p in (0, 6)] + [(True, 128, 8, 6, True), (True, 128, 4, 4, True),
                                                        (True, 128, 4, 0, True)]
    jobs += [(False, 64, 4, p, False) for p in (0, 4)] + [(False, 64, 8, 6, False), (False, 32, 4, 6, False)]
    jobs += [(True, 64, 4, 6, True, True), (False, 64, 8, 6, False, True)]
    failed = 0
    for job in jobs:
        try:
            print(compile_down(*job), flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL {job}: {type(exc).__name__}: {str(exc)[-800:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
