"""Session 54's proof that a kernel refactor (a repeated block moved into a shared ``@triton.jit`` helper) left the
generated code alone: each kernel compiled for sm_90 on a machine without a GPU, its PTX and its SASS written, and two
such dumps compared, PTX modulo line info and names, SASS modulo addresses.

    PYTHONPATH=/tmp/tidy54/base python3 benchmarks/tidy54_ptx_cpu.py --dump /tmp/tidy54/before      (Triton 3.9)
    PYTHONPATH=$PWD python3 benchmarks/tidy54_ptx_cpu.py --dump /tmp/tidy54/after
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/tidy54_ptx_cpu.py --dump ...                  (Triton 3.6)
    python3 benchmarks/tidy54_ptx_cpu.py --compare /tmp/tidy54/before /tmp/tidy54/after

Why both: a helper is inlined, so its instructions usually come out the same, but the debug scope of each inlined
call puts ``$L__tmp`` labels into the PTX (line info is on in a launch), and ptxas schedules around a label as around
a block start (sessions 30, 33, 49: the PTX instructions equal, the SASS not). PTX alone would pass such a change; the
verdict "same" needs both. Cases: ``wo_sass_diff_cpu``'s (the weight-only, bf16 and fp8 down and gate-up GEMMs at the
tiles their tuned files and heuristics launch: ``--only`` takes its name prefixes) and ``backward_cases`` here (the
weight-gradient GEMMs of ``_kernels/gemm_backward`` at ``triton_backward``'s tiles).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from wo_sass_diff_cpu import (  # noqa: E402
    compile_case, dense_cases, fp8_up_cases, gate_up_cases, prefill_cases, tile_reg_up_cases, wo_cases,
)

LINE_INFO = re.compile(r"^\s*(\.loc|\.file)\b|^\s*\$L__(tmp|func_begin|func_end)\d*:|^\s*//")
DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug")


# the weight grads' integers a launch at real widths specializes as multiples of 16 (with the pointers)
BACKWARD_ALIGNED = ("l_ptr", "r_ptr", "out_ptr", "sorted_ids_ptr", "counts_ptr", "starts_ptr", "R", "C", "block_m",
                    "stride_lm", "stride_rm", "stride_os", "stride_oe", "stride_or")


@dataclass
class BackwardCase:
    """A weight-grad kernel (``_kernels/gemm_backward``, ``_kernels/wgrad_persistent``) with its launch's constexprs
    and pointer types."""

    kernel: str
    const: dict
    num_warps: int
    num_stages: int
    pointers: dict  # l_ptr / r_ptr / out_ptr (l_desc ..): "*bf16"-style types or a descriptor's signature type
    module: str = "gemm_backward"


def backward_cases() -> dict[str, BackwardCase]:
    """The expert weight-gradient GEMMs at ``triton_backward_launch``'s tiles: the gathering kernel at the bf16
    heuristic (128 x 128, 128-row steps, 8 warps, 3 stages; DeepSeek-V3's 256 experts, split: float32 partials) and the
    float32 one (64 x 64, 64-row steps, 2 stages, ieee); the contiguous kernel at ``TUNED``'s tiles (128 x 256, 64-row
    steps, 8 warps, 3 stages, 8 row tiles a sweep) through TMA descriptors, and on pointers (bf16 out, split 1); the
    persistent kernel (``_kernels/wgrad_persistent``) at ``TUNED``'s persistent tile, flat and nested, its output
    through a descriptor and by pointer."""
    from wo_sass_diff_cpu import _descriptor

    gather = dict(BLOCK_R=128, BLOCK_C=128, BLOCK_K=128, E_PAD=256, UPCAST=False, PRECISION="tf32")
    contig = dict(BLOCK_R=128, BLOCK_C=256, BLOCK_K=64, GROUP_R=8, E_PAD=256, UPCAST=False, PRECISION="tf32")
    bf16 = {"l_ptr": "*bf16", "r_ptr": "*bf16", "out_ptr": "*fp32"}
    desc = {"l_ptr": _descriptor([4096 * 8, 2048], [64, 128], "bf16"),
            "r_ptr": _descriptor([4096 * 8, 7168], [64, 256], "bf16"), "out_ptr": "*fp32"}
    # the persistent kernel (``triton_wgrad``) at ``_contiguous(256, 3, 8, 1)``: the output through a descriptor
    persistent = dict(BLOCK_R=128, BLOCK_C=256, BLOCK_K=64, GROUP_R=8, OUT_DESC=True, FLAT=True, UPCAST=False,
                      PRECISION="tf32")
    persistent_desc = {"l_desc": desc["l_ptr"], "r_desc": desc["r_ptr"],
                       "out_ptr": _descriptor([8, 2048, 7168], [1, 128, 256], "bf16")}
    return {
        "wgrad_gather_bf16": BackwardCase("weight_grad_kernel", gather, 8, 3, bf16),
        "wgrad_gather_fp32": BackwardCase("weight_grad_kernel", gather | dict(
            BLOCK_R=64, BLOCK_C=64, BLOCK_K=64, E_PAD=8, PRECISION="ieee"), 8, 2,
            {"l_ptr": "*fp32", "r_ptr": "*fp32", "out_ptr": "*fp32"}),
        "wgrad_contig_desc": BackwardCase("weight_grad_contiguous_kernel", contig | dict(DESC=True), 8, 3, desc),
        "wgrad_contig_ptr_bf16out": BackwardCase("weight_grad_contiguous_kernel", contig | dict(DESC=False), 8, 3,
                                                 bf16 | {"out_ptr": "*bf16"}),
        "wgrad_persistent_flat": BackwardCase("weight_grad_persistent_kernel", persistent, 8, 3, persistent_desc,
                                              "wgrad_persistent"),
        "wgrad_persistent_nested": BackwardCase("weight_grad_persistent_kernel", persistent | dict(FLAT=False), 8, 3,
                                                persistent_desc, "wgrad_persistent"),
        "wgrad_persistent_ptr_out": BackwardCase("weight_grad_persistent_kernel", persistent | dict(OUT_DESC=False), 8,
                                                 3, persistent_desc | {"out_ptr": "*bf16"}, "wgrad_persistent"),
    }


def compile_backward(case: BackwardCase):
    """triton.compile of a weight-grad case for sm_90 (``BACKWARD_ALIGNED`` 16-divisible, the rest i32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.triton_bind import COMPILE_OPTIONS

    fn = getattr(importlib.import_module(f"moekit.experts._kernels.{case.module}"), case.kernel)
    const = {k: v for k, v in case.const.items() if k in fn.arg_names}
    ptrs = case.pointers | {"sorted_ids_ptr": "*i32", "counts_ptr": "*i32", "starts_ptr": "*i32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in BACKWARD_ALIGNED
             if n in fn.arg_names and not sig[n].startswith("tensordesc")}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=case.num_warps, num_stages=case.num_stages, **COMPILE_OPTIONS))


def all_cases() -> dict:
    """{name: () -> compiled} of every case."""
    cases = (wo_cases() | gate_up_cases() | tile_reg_up_cases() | dense_cases() | prefill_cases() | fp8_up_cases())
    return ({n: partial(compile_case, c) for n, c in cases.items()}
            | {n: partial(compile_backward, c) for n, c in backward_cases().items()})


def normal_ptx(ptx: str) -> list[str]:
    """The PTX's instructions and declarations: line info (``.loc``, ``.file``, the inlined scopes' ``$L__tmp``
    labels), comments and the debug sections dropped, white space folded."""
    lines = []
    for line in ptx.splitlines():
        if DEBUG_SECTION.match(line):
            break
        if LINE_INFO.match(line) or not line.strip():
            continue
        lines.append(" ".join(line.split()))
    return lines


def dump(out: Path, only: list[str] | None) -> int:
    """out/NAME.ptx and out/NAME.sass of each case (``--only``: the names starting with one of the prefixes)."""
    import moekit
    import triton
    from gluon_sass_diff_cpu import sass_of

    cases = {n: c for n, c in all_cases().items() if not only or n.startswith(tuple(only))}
    out.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}, moekit at {Path(moekit.__file__).parent}: {len(cases)} kernels -> {out}",
          flush=True)
    for name, build in cases.items():
        compiled = build()
        sass = sass_of(compiled)
        (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (out / f"{name}.sass").write_text(sass)
        print(f"{name}: {len(normal_ptx(compiled.asm['ptx']))} PTX lines, {sass.count(chr(10))} SASS lines", flush=True)
    return 0


def compare(before: Path, after: Path) -> int:
    """A line a kernel (PTX identical modulo line info? SASS identical modulo addresses?) and a table last; 1 when
    any kernel differs in either or is missing on one side."""
    from gluon_sass_diff_cpu import ADDRESS

    rows, differ = [], 0
    for path in sorted(before.glob("*.ptx")):
        other = after / path.name
        if not other.exists():
            rows.append((path.stem, "missing", "missing"))
            differ += 1
            continue
        ptx_same = normal_ptx(path.read_text()) == normal_ptx(other.read_text())
        sass = [[ADDRESS.sub("", x) for x in p.with_suffix(".sass").read_text().splitlines()] for p in (path, other)]
        sass_same = sass[0] == sass[1]
        differ += not (ptx_same and sass_same)
        rows.append((path.stem, "identical" if ptx_same else "DIFFERS", "identical" if sass_same else "DIFFERS"))
        print(f"{'PASS' if ptx_same and sass_same else 'FAIL'} {path.stem}", flush=True)
    print(f"\n{'kernel':32s} {'PTX (line info aside)':22s} SASS (addresses aside)")
    for name, ptx, sass in rows:
        print(f"{name:32s} {ptx:22s} {sass}")
    print(f"{len(rows) - differ} / {len(rows)} identical in both")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, help="write DIR/NAME.ptx and DIR/NAME.sass for this tree")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--only", nargs="+", help="name prefixes of the kernels to dump (e.g. tile reg mma wgrad)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(all_cases()))
        return 0
    if args.dump:
        return dump(args.dump, args.only)
    if args.compare:
        return compare(*args.compare)
    parser.error("one of --dump, --compare, --list")
    return 2


if __name__ == "__main__":
    sys.exit(main())
