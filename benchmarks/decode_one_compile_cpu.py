"""Compile the one-launch decode kernel (``moekit/experts/_kernels/decode_one.py``) for sm_90 on a machine without
a GPU: every tile variant of ``decode_one_device_check.py`` at one shape, with the runtime's specialisation (16-byte
aligned pointers, N and K divisible by 16), to catch compile errors before a device run and to read the registers,
spills, shared memory and the load widths (16-byte ``ld.global.v4`` is what the weight stream needs).

    PYTHONPATH=$PWD python benchmarks/decode_one_compile_cpu.py [--n 768 --k 2048] [--fp8]

Triton 3.9 here: ``triton.compile`` with an explicit ``GPUTarget("cuda", 90, 32)``; registers from the bundled
ptxas that takes the PTX's version (``ptxas-blackwell`` for 3.9's PTX 9.4).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

POINTERS = {"x_ptr": "*bf16", "w13_ptr": "*bf16", "w2_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
            "h_ptr": "*bf16", "y_ptr": "*fp32", "out_ptr": "*bf16", "counters_ptr": "*i32"}
SCALARS = ("N", "K", "num_experts", "num_slots", "top_k")


def ptxas_registers(ptx: str) -> str:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            done = subprocess.run([str(bin_dir / name), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True)
            regs = re.findall(r"Used (\d+) registers", done.stderr)
            spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
            if done.returncode == 0 and regs:
                return f"{regs[0]} regs, {spills[0] if spills else '?'} B spilled"
    return "ptxas: no report"


FP8_POINTERS = {"x_ptr": "*bf16", "w13q_ptr": "*fp8e4nv", "w13s_ptr": "*fp32", "w2q_ptr": "*fp8e4nv", "w2s_ptr": "*fp32",
                "ids_ptr": "*i32", "weights_ptr": "*fp32", "h_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*bf16",
                "counters_ptr": "*i32"}


def compile_variant(config, fp8: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.experts._kernels.decode_one import decode_one_kernel
    from moekit.experts._kernels.decode_one_fp8 import decode_one_fp8_kernel
    from moekit.experts.triton_decode_one import SPIN_LIMIT

    kernel, pointers = (decode_one_fp8_kernel, FP8_POINTERS) if fp8 else (decode_one_kernel, POINTERS)
    constexprs = dict(S_PAD=16, BN_UP=config.block_n_up, BK_UP=config.block_k_up, BK_OUT=config.block_k_out,
                      BN_RED=config.block_n_red, **({"EMULATE": False} if fp8 else {"GEMV": config.gemv, "UPCAST": False}),
                      PDL=True, SPIN_LIMIT=SPIN_LIMIT, TICKET=config.ticket,
                      DOWN_TILES=config.down_tiles)
    signature = {**pointers, **{s: "i32" for s in SCALARS}, **{c: "constexpr" for c in constexprs}}
    names = list(signature)
    aligned = list(pointers) + ["N", "K"]
    source = ASTSource(kernel, signature, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                       attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ptx = compiled.asm["ptx"]
    widths = {w: len(re.findall(rf"ld\.global(?:\.cg)?\.{w}\b", ptx)) for w in ("v4.b32", "b16", "b8")}
    order = "w2 loads before the wait" if _loads_before_acquire(ptx) else "NO w2 load before the wait"
    return (f"shared {compiled.metadata.shared} B, {ptxas_registers(ptx)}, 16-byte loads {widths['v4.b32']}, "
            f"2-byte loads {widths['b16']}, 1-byte loads {widths['b8']}, {order}")


def _loads_before_acquire(ptx: str) -> bool:
    """Whether 16-byte global loads (the first w2 step) come in the 120 PTX lines before the first acquire read
    (the down tile's wait)."""
    lines = ptx.splitlines()
    first = next((i for i, line in enumerate(lines) if "acquire.b32" in line), None)
    return first is not None and any("ld.global.v4.b32" in line for line in lines[max(0, first - 120):first])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=768)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--fp8", action="store_true", help="the fp8_block kernel, with the device check's fp8 variants")
    a = p.parse_args()
    from decode_one_device_check import fp8_variants, variants

    for name, config in (fp8_variants if a.fp8 else variants)(a.n, a.k).items():
        try:
            print(f"{name:<14} {compile_variant(config, a.fp8)}", flush=True)
        except Exception as exc:  # noqa: BLE001  one variant failing must not hide the others
            print(f"{name:<14} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
