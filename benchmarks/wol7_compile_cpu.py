"""Compile the weight-only Gluon GEMM (``moekit/experts/_kernels/gluon_gemm_wo.py``) for sm_90 on a machine without a
GPU: every (scheme, GEMM, tile) the device check runs, with SMEM, ptxas's spill stores and the CTA barriers in the
PTX (the decoded buffers' barriers come from Triton's membar pass; expect them around each step's wgmma).

    PYTHONPATH=$PWD python3 benchmarks/wol7_compile_cpu.py                          # this Triton (3.9 here)
    PYTHONPATH=/tmp/NAME-site:$PWD python3 benchmarks/wol7_compile_cpu.py           # a private Triton 3.6 wheel

Shapes reach the kernel as i32 arguments and W_ROWS / GATE_OFFSET constexprs: one small shape (E=2, N=256, K=512).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_report import report_jobs  # noqa: E402
from gluon_fp8_compile_cpu import ptxas_report  # noqa: E402
from wo_gemv_sass_cpu import _tool  # noqa: E402

# (gated, stages, scheme, block_n): the route's tiles (gate-up 4 stages, down 6) and the device check's variants
CASES = ((True, 4, 0, 128), (False, 6, 0, 128), (True, 3, 0, 128), (False, 4, 0, 128), (False, 3, 0, 256),
         (True, 4, 1, 128), (False, 6, 1, 128), (True, 4, 2, 128), (False, 6, 2, 128), (True, 6, 0, 64),
         (True, 6, 1, 64), (True, 6, 2, 64))


def _descriptor(shape: list[int], block: list[int], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.empty(shape, dtype=dtype)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.int8: gl.int8, torch.uint8: gl.uint8, torch.int32: gl.int32}[dtype]
    return TensorDescriptor(t, shape, list(t.stride()), block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))


def loop_counts(cubin: bytes, weights: int) -> str:
    """The MMA partition's main loop in the SASS (the backward branch whose body holds the HGMMAs): instructions a
    weight a thread (8 warps share a step's ``weights``), and its most frequent opcodes."""
    import re
    import subprocess
    import tempfile
    from collections import Counter

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        body = lines[labels.get(m.group(1), i):i + 1] if m else []
        if any("HGMMA" in b for b in body):
            ops = [b.split("*/")[1].split()[1 if b.split("*/")[1].split()[0].startswith("@") else 0].split(".")[0]
                   for b in body if re.match(r"\s*/\*[0-9a-f]+\*/", b)]
            top = " ".join(f"{k}:{v}" for k, v in Counter(ops).most_common(8))
            return f"loop {len(ops)} instructions, {len(ops) * 8 * 32 / weights:.2f} a weight a thread ({top})"
    return "loop not found"


def compile_case(gated: bool, stages: int, scheme: int, block_n: int, block_k: int = 64) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_wo import grouped_gemm_wo_kernel as kernel
    from moekit.triton_bind import COMPILE_OPTIONS

    e, n, k, t = 2, 256, 512, 1024
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    pack, q_dtype = ((1, torch.int8), (8, torch.int32), (2, torch.uint8))[scheme]  # int4: int32 words of 8 codes
    args = dict(a_desc=_descriptor([t, r], [128, block_k], torch.bfloat16),
                q_desc=_descriptor([e * w_rows, r // pack], [block_n, block_k // pack], q_dtype),
                c_desc=_descriptor([t, c], [128, block_n], torch.bfloat16),
                experts_ptr=torch.empty(1, dtype=torch.int32), used_ptr=torch.empty(1, dtype=torch.int32),
                s_ptr=torch.empty(1), z_ptr=torch.empty(1, dtype=torch.uint8), stride_se=w_rows * 4, stride_sr=4,
                stride_sg=1, stride_ze=w_rows * 4, stride_zr=4, stride_zg=1, reduce_dim=r, num_col_blocks=c // block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=stages, GROUP_M=8, SCHEME=scheme,
                 GROUP=(1, 128, 32)[scheme], num_warps=8)
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=8, maxnreg=168, **COMPILE_OPTIONS))
    ptx = out.asm["ptx"]
    spills, serialized = ptxas_report(ptx)
    return (f"{('int8', 'int4', 'mxfp4')[scheme]} {'gate-up' if gated else 'down'} {block_n}x{block_k} s{stages}: "
            f"{time.perf_counter() - t0:.1f} s, shared {out.metadata.shared} B, spill stores {spills} B, wgmma "
            f"serialized {serialized}, bar.sync {ptx.count('bar.sync')}; "
            + loop_counts(out.asm["cubin"], (2 if gated else 1) * block_n * block_k))


def main() -> int:
    import triton

    print("triton", triton.__version__, flush=True)
    return report_jobs([(f"{case}", lambda case=case: compile_case(*case)) for case in CASES])


if __name__ == "__main__":
    sys.exit(main())
