"""Compile the fp8 Gluon GEMM (``moekit/experts/_kernels/gluon_gemm_fp8.py``) for sm_90 on a machine without a
GPU, to catch typos and layout errors before a device run, and to read its SMEM, the partitions' register
counts (setmaxnreg) and ptxas's spills (``ptxas -v`` on the PTX, with the ptxas Triton bundles that takes it).

    PYTHONPATH=$PWD python benchmarks/gluon_fp8_compile_cpu.py     # the plan's tiles, then gpt-oss's two GEMMs
    PYTHONPATH=$PWD python benchmarks/gluon_fp8_compile_cpu.py variant   # gpt-oss's alone (interleaved, biases, spec)
    PYTHONPATH=$PWD python benchmarks/gluon_fp8_compile_cpu.py after     # gpt-oss's gate-up, its clamp before and
                                                                         # after the activation (Step-3.7's place)
    PYTHONPATH=/tmp/NAME-site:$PWD python benchmarks/gluon_fp8_compile_cpu.py   # the same on another Triton (3.6)

Needs a Triton whose Gluon has ``GluonASTSource`` (3.9 here; ``triton.compile`` with an explicit
``GPUTarget("cuda", 90, 32)`` runs the whole pipeline to a cubin with the bundled ptxas, no driver).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from compile_report import report_jobs
from sass_loops import SpillPlaces, spill_places


@dataclass
class Compiled:
    name: str
    seconds: float
    shared: int  # bytes of SMEM
    n_regs: int | None  # None: not reported by this Triton without a driver
    n_spills: int | None
    setmaxnreg: list  # the per-partition register counts in the PTX
    spill_bytes: int | None  # ptxas -v "bytes spill stores"; None where no bundled ptxas took the PTX
    serialized: bool  # ptxas serialized the wgmmas (C7514: accumulators read inside a wgmma pipeline stage; C7512:
    # too few registers for the pipeline, e.g. a worker partition's in flight beside a 24-register one)
    wgmmas: int = 0  # wgmma.mma_async instructions in the PTX (a merged or dropped MMA shows as fewer)
    places: SpillPlaces | None = None  # the spills in the SASS, inside the K loops or around them (None: no nvdisasm)


def _descriptor(shape: list[int], block: list[int], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.empty(shape, dtype=dtype)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return TensorDescriptor(t, shape, list(t.stride()), block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))


def ptxas_report(ptx: str) -> tuple[int | None, bool]:
    """(bytes of spill stores, whether the wgmmas were serialized) as ptxas reports them for this sm_90a PTX
    (the bundled ptxas, or the newer one beside it where the PTX's version is too new for the first)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            exe = os.path.join(bin_dir, name)
            if not os.path.exists(exe):
                continue
            done = subprocess.run([exe, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True)
            found = re.findall(r"(\d+) bytes spill stores", done.stderr)
            if done.returncode == 0 and found:
                return int(found[0]), re.search(r"\(C751\d\)[^\n]*serialized", done.stderr) is not None  # any cause
    return None, False


def sass_spill_places(ptx: str) -> SpillPlaces | None:
    """Where this sm_90a PTX's spills sit in its SASS (``sass_loops``: inside the innermost MMA loops or around
    them), through the bundled ptxas and nvdisasm; None where they are missing or refuse it."""
    import os
    import subprocess
    import tempfile

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            exe = os.path.join(bin_dir, name)
            if os.path.exists(exe) and subprocess.run([exe, "-arch=sm_90a", src, "-o", cubin],
                                                      capture_output=True).returncode == 0:
                break
        else:
            return None
        done = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True)
        return spill_places(done.stdout) if done.returncode == 0 else None


def compile_gluon_sm90(kernel, args: dict, const: dict, num_warps: int, maxnreg: int | None = None,
                       attrs: dict | None = None):
    """``kernel`` (a Gluon jit function) compiled for sm_90 with these runtime ``args`` (values whose types give the
    signature), ``const`` constexprs and optional argument ``attrs``; the whole pipeline to a cubin, no driver."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.triton_bind import COMPILE_OPTIONS

    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    consts = {(kernel.arg_names.index(name),): v for name, v in const.items()}
    src = GluonASTSource(kernel, sig, consts) if attrs is None else GluonASTSource(kernel, sig, consts, attrs)
    options = dict(num_warps=num_warps, **COMPILE_OPTIONS) | ({} if maxnreg is None else dict(maxnreg=maxnreg))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sm90_summary(out, seconds: float) -> str:
    """A compiled kernel's line: seconds, SMEM, the partitions' setmaxnreg, ptxas's spill stores and serialization."""
    ptx = out.asm["ptx"]
    regs = sorted({line.split()[-1].rstrip(";") for line in ptx.splitlines() if "setmaxnreg" in line})
    spills, serialized = ptxas_report(ptx)
    return (f"{seconds:.1f} s, shared {out.metadata.shared} B, setmaxnreg {regs}, ptxas spill stores {spills} B, "
            f"wgmma serialized {serialized}")


def report_each(jobs, tail: int = 2500) -> int:
    """Run each (name, job) of ``jobs``, printing "OK triton V name: <job()>" or the FAIL line with the error's last
    ``tail`` characters; the exit status: 1 if any failed."""
    import triton

    run = f"triton {triton.__version__}"
    return report_jobs([(f"{run} {name}", lambda name=name, job=job: f"{run} {name}: {job()}") for name, job in jobs],
                       tail)


@dataclass(frozen=True)
class Fp8Variant:
    """A variant call's GEMM (issue #15): gpt-oss-20b's widths (N = K = 2880, not multiples of 128), its biases
    (b13 for the gate-up GEMM, b2 for the down) and its activation (interleaved rows, silu alpha 1.702, limit 7,
    up + 1; the down GEMM takes b2 alone)."""

    experts: int = 32
    inter: int = 2880
    hidden: int = 2880
    limit_after: bool = False  # the clamp after the activation (LIMIT_AFTER: Step-3.7, Bailing-Hybrid; session 48)


GPT_OSS = Fp8Variant()
GPT_OSS_AFTER = Fp8Variant(limit_after=True)
# The kernel's variant arguments of a plain call (its defaults; ``triton.compile`` takes no default, so every
# constexpr is given)
PLAIN_VARIANT = dict(bias_ptr=None, INTERLEAVED=False, ACT=0, ALPHA=1.0, LIMIT=None, UP_SHIFT=0.0, LIMIT_AFTER=False)


def compile_fp8_gemm(gated: bool, tile, variant: Fp8Variant | None = None) -> Compiled:
    """One GEMM (``tile``: an ``Fp8GluonTile``) at a small shape (E=2, N=256, K=512: shapes only reach the kernel
    as i32 arguments), or ``variant``'s (its widths, a bias, its spec)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.experts._kernels.gluon_gemm_fp8 import grouped_gemm_fp8_kernel as kernel
    from moekit.triton_bind import COMPILE_OPTIONS

    e, n, k, t = (2, 256, 512, 1024) if variant is None else (variant.experts, variant.inter, variant.hidden, 4096)
    fp8 = torch.float8_e4m3fn
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    groups = -(-r // 128)
    args = dict(a_desc=_descriptor([t, r], [64, 128], fp8), w_desc=_descriptor([e * w_rows, r], [128, 128], fp8),
                c_desc=_descriptor([t, c], [64, 128], fp8 if gated else torch.bfloat16),
                as_ptr=torch.empty(1), ws_ptr=torch.empty(1), cs_ptr=torch.empty(1),
                experts_ptr=torch.empty(1, dtype=torch.int32), used_ptr=torch.empty(1, dtype=torch.int32),
                reduce_dim=r, num_col_blocks=-(-c // tile.block_n), w_rows=w_rows,
                gate_offset=(128 if variant is not None else n) if gated else (128 if tile.wide else 0),
                stride_as=groups, stride_wse=-(-w_rows // 128) * groups,
                stride_wsr=groups, stride_cs=-(-c // 128))
    const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                 num_warps=4, WIDE=tile.wide, PIPE=tile.pipelined)
    const |= PLAIN_VARIANT
    if variant is not None:
        del const["bias_ptr"]
        args |= dict(bias_ptr=torch.empty(1, dtype=torch.bfloat16))
        const |= dict(INTERLEAVED=True, ACT=0, ALPHA=1.702, LIMIT=7.0, UP_SHIFT=1.0,
                      LIMIT_AFTER=variant.limit_after) if gated else {}
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in const}
    src = GluonASTSource(kernel, sig, {(kernel.arg_names.index(name),): v for name, v in const.items()})
    t0 = time.perf_counter()
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=tile.max_registers,
                                                                                 **COMPILE_OPTIONS))
    ptx = out.asm["ptx"]
    regs = sorted({int(line.split("setmaxnreg")[1].split(",")[0].split(".")[-1].strip().rstrip(";").split()[-1])
                   for line in ptx.splitlines() if "setmaxnreg" in line}) if "setmaxnreg" in ptx else []
    name = (f"{'gate-up' if gated else 'down'} stages={tile.stages} group_m={tile.group_m} "
            f"regs={tile.max_registers}/{tile.consumer_regs}" + (" wide" if tile.wide else "")
            + (" pipelined" if tile.pipelined else "") + (" gpt-oss variant" if variant is not None else "")
            + (" clamp after" if variant is not None and variant.limit_after else ""))
    return Compiled(name, time.perf_counter() - t0, out.metadata.shared, getattr(out, "n_regs", None),
                    getattr(out, "n_spills", None), regs, *ptxas_report(ptx), ptx.count("wgmma.mma_async"),
                    sass_spill_places(ptx))


def main() -> int:
    from moekit.experts.triton_gluon_fp8_launch import (
        DOWN_TILE, PIPELINED_DOWN_TILE, UP_TILE, WIDE_DOWN_TILE,
    )

    def line(gated: bool, tile, variant) -> str:
        c = compile_fp8_gemm(gated, tile, variant)
        return (f"{c.name}: {c.seconds:.1f} s, shared {c.shared} B, setmaxnreg {c.setmaxnreg}, ptxas spill stores "
                f"{c.spill_bytes} B ({c.places}), wgmma serialized {c.serialized}, wgmma.mma_async {c.wgmmas}")

    jobs = ((True, UP_TILE, None), (False, DOWN_TILE, None), (False, WIDE_DOWN_TILE, None),  # the plan's pipelines
            (False, PIPELINED_DOWN_TILE, None),  # wgmmas: 16, 8, 16, 24 expected
            (True, UP_TILE, GPT_OSS), (False, DOWN_TILE, GPT_OSS))  # gpt-oss's calls (issue 15, session 42)
    only = sys.argv[1:]  # "variant": gpt-oss's two alone; "after": its gate-up with the clamp before, then after
    if "after" in only:
        jobs = ((True, UP_TILE, GPT_OSS), (True, UP_TILE, GPT_OSS_AFTER))
    else:
        jobs = [job for job in jobs if not only or (job[2] is not None) == ("variant" in only)]
    return report_jobs([(f"{'gate-up' if gated else 'down'} {tile}" + (" variant" if variant else ""),
                         lambda g=gated, t=tile, v=variant: line(g, t, v)) for gated, tile, variant in jobs],
                       tail=2000)


if __name__ == "__main__":
    sys.exit(main())
