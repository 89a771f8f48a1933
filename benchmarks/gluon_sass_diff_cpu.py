"""The route's Gluon GEMMs in sm_90 SASS, compiled on a machine without a GPU, and a comparison of two such dumps: for a
change that should leave the default kernels' machine code alone (an option removed, a signature trimmed), run
``--dump`` on the tree before and after it, on each Triton, then ``--compare``.

    PYTHONPATH=/tmp/before-tree python3 benchmarks/gluon_sass_diff_cpu.py --dump /tmp/sass-before   (Triton 3.9)
    PYTHONPATH=$PWD python3 benchmarks/gluon_sass_diff_cpu.py --dump /tmp/sass-after
    PYTHONPATH=/tmp/x-site:$PWD ...                                                     (another Triton, e.g. 3.6)
    python3 benchmarks/gluon_sass_diff_cpu.py --compare /tmp/sass-before /tmp/sass-after

Kernels: bf16 gate-up (TMA, and gathering in its loader), down (GROUP_M 8 and the narrow tile's plain order), down with
the 64-row tail, the gate-up GEMM on 256-row tiles (``BLK256_UP_TILE``), the weight-only GEMMs at the variants
``GLUON_WO_OPTIONS`` launches (``wo_cases``; they share ``gluon_gemm._loader``), the fp8 GEMM (gate-up, the narrow, the
wide and the pipelined down tile; Mixtral widths; plain calls: no biases, silu).
``--only PREFIX ...`` dumps the kernels whose names start with one of them (``blk256_up``: two consumers; ``fp8``).
Each is compiled with the arguments its signature names (``_compile``: a removed parameter is not passed, one the
case does not know gets a stand-in), DeepSeek-V3-like widths.
``--compare`` prints per kernel: lines, lines that differ, and whether they differ only in the constant bank's
parameter offsets (``c[0x0][...]``: a parameter removed before them shifts them) and by how much; where the code
differs, the instructions only one side has, addresses and register numbers aside (e.g. two mbarrier inits).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

E, N, K, T = 8, 2048, 7168, 4096  # experts, N (inter), K (hidden), rows: the widths only size the descriptors
PARAM = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")  # an instruction's address
REGISTER = re.compile(r"\bU?R\d+\b|\bU?P\d\b")  # (uniform) registers and predicates
BRANCH = re.compile(r"BRX R\d+ -0x[0-9a-f]+")  # an indirect branch's relative target


def _compile(kernel, args: dict, const: dict, aligned: tuple, num_warps: int = 8, maxnreg: int = 168):
    """triton.compile for sm_90 of the arguments and constexprs ``kernel`` names (16-divisible: ``aligned``); a
    parameter this tree's kernel has and the case does not name (another tree's option): an int32 pointer (``*_ptr``,
    16-aligned) or a False constexpr (upper case), as a launch that does not use it passes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from moekit.triton_bind import COMPILE_OPTIONS

    names = kernel.arg_names
    args, const = {k: v for k, v in args.items() if k in names}, {k: v for k, v in const.items() if k in names}
    for n in (n for n in names if n not in args and n not in const):
        if n.endswith("_ptr"):
            args[n], aligned = torch.empty(1, dtype=torch.int32), (*aligned, n)
        elif n.isupper():
            const[n] = False
        else:
            raise ValueError(f"{kernel}: no value for parameter {n}")
    sig = {n: mangle_type(args[n]) if n in args else "constexpr" for n in names if n in args or n in const}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in args}
    src = GluonASTSource(kernel, sig, {(names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg,
                                                                            **COMPILE_OPTIONS))


def bf16_cases() -> dict:
    """{name: () -> compiled} of the route's bf16 kernels."""
    from wol7_compile_cpu import _descriptor as desc

    from moekit.experts._kernels import gluon_gemm, gluon_gemm_gather, gluon_gemm_tail
    from moekit.experts.triton_gluon_launch import (
        BLOCK_M, DOWN_TILE, LOADER_REGS, LOADER_WARPS, NARROW_DOWN_TILE, UP_TILE, with_tail,
    )

    i32, bf16 = torch.empty(1, dtype=torch.int32), torch.bfloat16
    ptrs = dict(experts_ptr=i32, used_ptr=i32, sorted_ptr=i32, dst_ptr=i32)

    def plain(tile, gated: bool, inter: int = N):
        r, c, w_rows = (K, inter, 2 * inter) if gated else (inter, K, K)
        args = ptrs | dict(a_desc=desc([T, r], [BLOCK_M, tile.block_k], bf16), reduce_dim=r,
                           w_desc=desc([E * w_rows, r], [tile.block_n, tile.block_k], bf16),
                           c_desc=desc([T, c], [BLOCK_M, tile.block_n], bf16), num_col_blocks=c // tile.block_n)
        const = dict(W_ROWS=w_rows, GATE_OFFSET=inter if gated else 0, GATED=gated, STAGES=tile.stages,
                     GROUP_M=tile.group_m, num_warps=8)
        return _compile(gluon_gemm.grouped_gemm_kernel, args, const, (*ptrs, "reduce_dim"))

    def gather(tile, inter: int = 768, k: int = 2048):
        args = ptrs | dict(x_ptr=torch.empty(1, dtype=bf16), w_desc=desc([E * 2 * inter, k], [tile.block_n,
                           tile.block_k], bf16), c_desc=desc([T, inter], [BLOCK_M, tile.block_n], bf16),
                           num_assignments=T, stride_x=k, reduce_dim=k, num_col_blocks=inter // tile.block_n)
        const = dict(TOP_K=8, W_ROWS=2 * inter, GATE_OFFSET=inter, STAGES=tile.stages, GROUP_M=tile.group_m,
                     LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=8)
        return _compile(gluon_gemm_gather.gather_gate_up_kernel, args, const, (*ptrs, "x_ptr", "stride_x",
                                                                               "reduce_dim"))

    def tail(tile):
        args = ptrs | dict(a_desc=desc([T, N], [BLOCK_M, tile.block_k], bf16),
                           t_desc=desc([T, N], [tile.tail, tile.block_k], bf16),
                           w_desc=desc([E * K, N], [tile.block_n, tile.block_k], bf16),
                           c_desc=desc([T, K], [BLOCK_M, tile.block_n], bf16),
                           ct_desc=desc([T, K], [tile.tail, tile.block_n], bf16), num_assignments=T, reduce_dim=N,
                           num_col_blocks=K // tile.block_n)
        const = dict(W_ROWS=K, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=8)
        return _compile(gluon_gemm_tail.tail_down_kernel, args, const, tuple(ptrs))

    def blk256_up():
        from moekit.experts._kernels.gluon_gemm_blk256 import blk256_gemm_kernel
        from moekit.experts.triton_gluon_blk256 import CONSUMER_REGS, CONSUMER_WARPS, MAX_REGISTERS, SUB_M
        from moekit.experts.triton_gluon_launch import BLK256_UP_TILE as tile

        cols = tile.block_n // 2  # 64 gate + 64 up weight rows a stage, 64 output columns
        args = ptrs | dict(a_desc=desc([T, K], [SUB_M, tile.block_k], bf16), num_assignments=T, reduce_dim=K,
                           w_desc=desc([E * 2 * N, K], [cols, tile.block_k], bf16),
                           c_desc=desc([T, N], [SUB_M, cols], bf16), num_col_blocks=N // cols)
        const = dict(W_ROWS=2 * N, GATE_OFFSET=N, GATED=True, STAGES=tile.stages, GROUP_M=tile.group_m,
                     SEARCH_STEPS=6, CONSUMER_REGS=CONSUMER_REGS, num_warps=CONSUMER_WARPS)
        return _compile(blk256_gemm_kernel, args, const, (*ptrs, "reduce_dim"), CONSUMER_WARPS, MAX_REGISTERS)

    return {"gateup_tma": lambda: plain(UP_TILE, True), "down": lambda: plain(DOWN_TILE, False),
            "down_narrow": lambda: plain(NARROW_DOWN_TILE, False, 768), "gateup_gather": lambda: gather(UP_TILE),
            "down_tail": lambda: tail(with_tail(DOWN_TILE)), "blk256_up": blk256_up}


def wo_cases() -> dict:
    """{name: () -> compiled} of the weight-only Gluon GEMMs at the variants ``GLUON_WO_OPTIONS`` launches, on the
    route's tiles (``wo8_compile_cpu`` / ``wo4k_compile_cpu``'s small shape: E=2, N=256, K=512): the session-27
    kernel (gate-up 4 stages, down 6) for each scheme, mxfp4 FAST and SPLIT + FAST; the swapped GEMM for int8 (FAST,
    SPLIT: gate-up 6 stages, down 8) and int4 (SPLIT, 8 and 8)."""
    from wo4k_compile_cpu import Case, compile_swap
    from wo8_compile_cpu import compile_wo

    cases = {}
    for scheme, name in enumerate(("int8", "int4", "mxfp4")):
        variants = {"": {}} | ({"_fast": {"FAST": True}, "_split_fast": {"SPLIT": True, "FAST": True}}
                               if scheme == 2 else {})
        for suffix, variant in variants.items():
            cases[f"wo_{name}_up{suffix}"] = partial(compile_wo, True, 4, scheme, 128, variant)
            cases[f"wo_{name}_down{suffix}"] = partial(compile_wo, False, 6, scheme, 128, variant)
    for case in (Case("int8_up", True, 6, True, True), Case("int8_down", False, 8, True, True),
                 Case("int4_up", True, 8, split=True, scheme=1), Case("int4_down", False, 8, split=True, scheme=1)):
        cases[f"wo_swap_{case.name}"] = partial(compile_swap, case)
    return cases


def fp8_case(gated: bool, tile):
    """The route's fp8 GEMM (``tile``: an ``Fp8GluonTile``) at Mixtral's widths (K = 4096, N = 14336), integer
    arguments 16-divisible where their values are (as a launch specializes them)."""
    from gluon_fp8_compile_cpu import PLAIN_VARIANT, _descriptor as desc

    n, k, fp8 = 14336, 4096, torch.float8_e4m3fn
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    ints = dict(reduce_dim=r, num_col_blocks=c // tile.block_n, w_rows=w_rows,
                gate_offset=n if gated else (128 if tile.wide else 0), stride_as=r // 128,
                stride_wse=w_rows * r // 128 ** 2, stride_wsr=r // 128, stride_cs=c // 128)
    ptrs = dict(as_ptr=torch.empty(1), ws_ptr=torch.empty(1), cs_ptr=torch.empty(1),
                experts_ptr=torch.empty(1, dtype=torch.int32), used_ptr=torch.empty(1, dtype=torch.int32))
    args = ptrs | ints | dict(a_desc=desc([T, r], [64, 128], fp8), w_desc=desc([E * w_rows, r], [128, 128], fp8),
                              c_desc=desc([T, c], [64, 128], fp8 if gated else torch.bfloat16))
    const = dict(GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                 WIDE=tile.wide, PIPE=tile.pipelined, num_warps=4) | PLAIN_VARIANT  # no biases, plain silu
    from moekit.experts._kernels.gluon_gemm_fp8 import grouped_gemm_fp8_kernel

    aligned = (*ptrs, *(name for name, v in ints.items() if v % 16 == 0))
    return _compile(grouped_gemm_fp8_kernel, args, const, aligned, num_warps=4, maxnreg=tile.max_registers)


def fp8_cases() -> dict:
    """{name: () -> compiled} of the route's fp8 GEMMs: gate-up, the narrow and the wide down tile."""
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, PIPELINED_DOWN_TILE, UP_TILE, WIDE_DOWN_TILE

    return {"fp8_gateup": lambda: fp8_case(True, UP_TILE), "fp8_down": lambda: fp8_case(False, DOWN_TILE),
            "fp8_down_wide": lambda: fp8_case(False, WIDE_DOWN_TILE),
            "fp8_down_pipe": lambda: fp8_case(False, PIPELINED_DOWN_TILE)}


def dump(out: Path, only: list[str] | None) -> int:
    cases = bf16_cases() | wo_cases() | fp8_cases()
    return write_sass(out, {name: build for name, build in cases.items() if not only or name.startswith(tuple(only))})


def sass_of(compiled) -> str:
    """A compiled kernel's SASS: its cubin through the bundled ``nvdisasm -c``."""
    from wo_gemv_sass_cpu import _tool

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout


def write_sass(out: Path, cases: dict) -> int:
    """out/NAME.sass: the sm_90 SASS of each case ({name: () -> compiled}), one line a kernel printed."""
    import triton

    out.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__} -> {out}", flush=True)
    for name, build in cases.items():
        compiled = build()
        sass = sass_of(compiled)
        (out / f"{name}.sass").write_text(sass)
        print(f"{name}: {sass.count(chr(10))} lines, shared {compiled.metadata.shared} B", flush=True)
    return 0


def compare(before: Path, after: Path) -> int:
    """1 when a kernel's code differs beyond parameter offsets (or is missing on one side)."""
    changed = 0
    for path in sorted(before.glob("*.sass")):
        other = after / path.name
        a = path.read_text().splitlines()
        b = other.read_text().splitlines() if other.exists() else []
        pairs = [(x, y) for x, y in zip(a, b) if x != y]
        same_code = len(a) == len(b) and all(PARAM.sub("c", x) == PARAM.sub("c", y) for x, y in pairs)
        shifts = sorted({int(p, 16) - int(q, 16) for x, y in pairs for p, q in zip(PARAM.findall(x),
                                                                                  PARAM.findall(y))})
        verdict = "identical" if not pairs and len(a) == len(b) else (
            f"parameter offsets only (before - after: {shifts} bytes)" if same_code else "CODE DIFFERS")
        changed += verdict == "CODE DIFFERS"
        print(f"{path.stem:14s} {len(a)} / {len(b)} lines, {len(pairs)} differ: {verdict}")
        if verdict == "CODE DIFFERS":
            print(instructions_changed(a, b))
    return 1 if changed else 0


def instructions_changed(a: list[str], b: list[str]) -> str:
    """The instructions one dump has and the other lacks, addresses and register numbers aside (a removed
    instruction shifts every address after it and can rename registers): what a removal really changed."""
    import difflib
    from collections import Counter

    def normal(lines: list[str]) -> list[str]:
        code = (ADDRESS.sub("", x).split(";")[0].strip() for x in lines if ADDRESS.search(x))
        return [REGISTER.sub("r", BRANCH.sub("BRX", x)) for x in code]

    na, nb = normal(a), normal(b)
    blocks = [o for o in difflib.SequenceMatcher(None, na, nb, autojunk=False).get_opcodes() if o[0] != "equal"]
    gone = Counter(x for _, i, j, _, _ in blocks for x in na[i:j])
    new = Counter(x for _, _, _, i, j in blocks for x in nb[i:j])
    show = lambda c: "; ".join(f"{n} x {x}" for x, n in sorted(c.items())) or "none"  # noqa: E731
    return (f"    registers and addresses aside, {len(na)} / {len(nb)} instructions; only before: {show(gone - new)}"
            f"\n    only after: {show(new - gone)}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", type=Path)
    parser.add_argument("--compare", type=Path, nargs=2)
    parser.add_argument("--only", nargs="+", help="name prefixes of the kernels to dump (default: all; e.g. fp8)")
    args = parser.parse_args()
    return dump(args.dump, args.only) if args.dump else compare(*args.compare)


if __name__ == "__main__":
    sys.exit(main())
