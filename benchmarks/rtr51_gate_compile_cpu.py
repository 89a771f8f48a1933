"""The gate kernels under a float32 router, compiled for sm_90 on a machine without a GPU: do the launches that read
x and W as stored (bf16, or DeepSeek-V3's bf16 x with a float32 W) and upcast in registers run the float32 inputs'
floating-point operations in the same order? (Session 51: ``moekit.routing.gate.reads_as``.)

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/rtr51_gate_compile_cpu.py     (Triton 3.6, the H200's)

For each kernel (the row-loop one launch ``gate_route_kernel`` at M = 1 and 8, the tensor-core one
``gate_mma_kernel`` at M = 64, the gate alone ``gate_kernel``) at Qwen3-30B-A3B's and DeepSeek-V3's shapes, the
float32-logits launch on float32 inputs (session 50's path: the casts first) and on the stored dtypes: the TTGIR
layouts of the x and W loads (the reduction of the row-loop gate runs in them: a thread sums its own columns first)
and the float32 arithmetic and shuffle opcodes in the SASS (FFMA, FADD, FMUL, SHFL, FMNMX, MUFU), counted. The same
layouts and the "same" counts are the evidence short of a device run that the bits agree (the order of independent
instructions moves with the loads and conversions around them, so the sequences are compared as counts); the device
check (``benchmarks/rtr51_device_check.py``) compares the bits.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from route_sass_diff_cpu import ALIGNED, DSV3, ONES, QWEN3  # noqa: E402  (the launches' router constexprs)

SHAPES = {"qwen3": (2048, QWEN3), "dsv3": (7168, DSV3)}  # K and the router plan (E inside)
STORED = {"fp32": ("*fp32", "*fp32"), "bf16": ("*bf16", "*bf16"), "bf16_x_fp32_w": ("*bf16", "*fp32")}
ARITH = re.compile(r"\b(FFMA|FADD|FMUL|SHFL\.\w+|FMNMX|MUFU\.\w+)\b")
LOAD = re.compile(r"(?:tt\.load|ttg\.async_copy_global_to_local) .*?tensor<([0-9x]+)x!tt\.ptr<(\w+)>, #(\w+)>")


def _compile(kernel: str, const: dict, x: str, w: str, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.triton_bind import COMPILE_OPTIONS

    fn = getattr(__import__(f"moekit.routing._kernels.{kernel}", fromlist=[kernel]), kernel)
    names = fn.arg_names
    import inspect

    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    const = defaults | {k: v for k, v in const.items() if k in names} | {n: 1 for n in ONES if n in names}
    pointers = {"x_ptr": x, "w_ptr": w, "b_ptr": w, "logits_ptr": "*fp32", "out_ptr": "*fp32", "bias_ptr": "*fp32",
                "gate_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32", "ok_ptr": "*i32", "count_ptr": "*i32",
                "part_ptr": "*fp32"}
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "scaling" else "i32") for n in names}
    aligned = (*ALIGNED, "out_ptr", "stride_om", "k_per_split")  # k_per_split: a multiple of BLOCK_K, as launched
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=num_warps, num_stages=3, enable_reflect_ftz=False, launch_pdl=False, **COMPILE_OPTIONS))


def _layouts(ttgir: str) -> list[str]:
    """'shape dtype sizePerThread' of each load (tt.load, or a pipelined async copy)."""
    blocked = dict(re.findall(r"^#(\w+) = #ttg\.blocked<\{sizePerThread = (\[[0-9, ]+\])", ttgir, re.M))
    return [f"{shape} {dtype} {blocked.get(layout, layout)}" for shape, dtype, layout in LOAD.findall(ttgir)]


def _arith(cubin: bytes) -> list[str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return ARITH.findall(sass)


def cases() -> dict:
    """name -> (kernel, constexprs) of the float32-logits launches (tiles as ``gate._tiles`` / ``mma_tiles`` give)."""
    from moekit.routing.gate import _tiles
    from moekit.routing.gate_mma import mma_tiles

    import torch

    out = {}
    for shape, (k, plan) in SHAPES.items():
        e = plan["NUM_EXPERTS"]
        for m in (1, 8):
            t = _tiles(m, e, k)
            tiles = dict(BLOCK_M=t.block_m, BLOCK_E=t.block_e, BLOCK_K=t.block_k, HAS_LINEAR_BIAS=False)
            out[f"one_{shape}_m{m}"] = ("gate_route_kernel", plan | tiles)
        out[f"gate_{shape}_m1"] = ("gate_kernel", dict(NUM_EXPERTS=e, BLOCK_M=1, BLOCK_E=t.block_e,
                                                       BLOCK_K=t.block_k, HAS_BIAS=False))
        mt = mma_tiles(64, e, k, torch.float32)
        out[f"mma_{shape}_m64"] = ("gate_mma_kernel", plan | dict(
            BLOCK_M=mt.block_m, BLOCK_E=mt.block_e, BLOCK_K=mt.block_k, SPLIT_K=mt.split_k, IEEE=True,
            HAS_LINEAR_BIAS=False, ROUTE=True, ROUTE_M=16 if shape == "qwen3" else 8))
    return out


def main() -> int:
    import triton

    print(f"triton {triton.__version__}, sm_90; float32 logits; 'same': every opcode's count equals the fp32 inputs'")
    failed = 0
    for name, (kernel, const) in cases().items():
        base = None
        for stored, (x, w) in STORED.items():
            upcast = dict(UPCAST=stored != "fp32") if kernel == "gate_mma_kernel" else {}
            compiled = _compile(kernel, const | upcast, x, w)
            arith = Counter(_arith(compiled.asm["cubin"]))
            counts = {op: arith[op] for op in ("FFMA", "FADD", "FMUL")}
            same = "-" if base is None else ("same" if arith == base else "DIFFERENT")
            failed += same == "DIFFERENT"
            base = arith if base is None else base
            print(f"{name:16s} {stored:14s} loads {'; '.join(_layouts(compiled.asm['ttgir']))}")
            print(f"{'':16s} {'':14s} {sum(arith.values())} arith/shfl ops {counts} {same}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
