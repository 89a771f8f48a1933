"""The word decode's main loops in sm_90 SASS, compiled on a machine without a GPU: instructions a weight
(per thread) of the float32 word decode (``gemm_wo_gemv``, decode "gemv", its inline PTX included), the proxy
for its issue-bound speed; also registers and stack (spills) per thread. (Until session 21 also the packed-half
decode's, "gemv_half", removed then, as ``wo_half_sass_cpu.py``.)

    PYTHONPATH=$PWD python benchmarks/wo_gemv_sass_cpu.py            # the x tile and AHEAD 2, both schemes
    PYTHONPATH=$PWD python benchmarks/wo_gemv_sass_cpu.py --quick    # the default tiles' gate-up, 1- and 2-row

``triton.compile`` with an explicit ``GPUTarget("cuda", 90, 32)`` runs the whole pipeline to a cubin with
the bundled ptxas; ``nvdisasm`` and ``cuobjdump`` (bundled too) give the SASS and the resource usage. The
pointers, strides and word counts carry the ``tt.divisibility`` 16 a launch at the real shapes specializes them
with (DIVISIBLE): without it the words load 32 bits at a time, not as the GPU runs them (LDG.128); the counts
in the notes before session 21 (gemv 3.89, gemv_half 3.48 int4 gate-up) were compiled without it.
The main loop is the longest backward branch's body; weights a loop step: BN x BKW x 8 (x 2 for gate-up).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

from compile_report import report_jobs


@dataclass
class LoopCount:
    name: str
    per_weight: float  # SASS instructions a weight, per thread
    registers: int
    stack: int  # bytes a thread (spills)
    top: str  # the most frequent opcodes


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# arguments a launch at the real shapes specializes as multiples of 16 (pointers: 16-byte aligned)
DIVISIBLE = ("x_ptr", "h_ptr", "q_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "KW", "NW", "stride_xm", "stride_qe",
             "stride_qr", "stride_se", "stride_sr", "stride_ze", "stride_zr", "stride_hm", "stride_ym", "split_words")


def _compile(fn, pointer_types: dict, const: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.triton_bind import COMPILE_OPTIONS

    sig = {n: "constexpr" if n in const else pointer_types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **COMPILE_OPTIONS))


def _main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (label .. its backward branch)."""
    labels, ops, best = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if op:
            ops.append(op.group(1))
            target = re.search(r"BRA\s.*?\.(L_x_\d+)", op.group(1))
            if target and labels.get(target.group(1), len(ops)) < len(ops) - 1:
                body = ops[labels[target.group(1)]:]
                best = body if len(body) > len(best) else best
    return best


@dataclass
class MainLoop:
    """A compiled kernel's main loop (``_main_loop`` of its SASS) and resource use (``cuobjdump -res-usage``)."""

    loop: list[str]  # the loop's instructions
    ops: Counter  # opcode (predicate and modifiers dropped) -> count in the loop
    registers: int
    stack: int  # bytes a thread (spills)


def main_loop_of(compiled) -> MainLoop:
    """``compiled``'s cubin disassembled (``nvdisasm -c``), its main loop counted, its registers and stack read."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    loop = _main_loop(sass)
    ops = Counter((o.split()[1] if o.startswith("@") else o.split()[0]).split(".")[0] for o in loop)
    return MainLoop(loop, ops, int(re.search(r"REG:(\d+)", usage).group(1)),
                    int(re.search(r"STACK:(\d+)", usage).group(1)))


def count(module: str, scheme: int, block_m: int, block_n: int, bkw: int, num_warps: int, down: bool = False,
          up_split: int = 1, ahead: int = 1, x_tile: bool = False) -> LoopCount:
    kernels = importlib.import_module(f"moekit.experts._kernels.{module}")
    kind = "gemv"
    fn = getattr(kernels, f"{'down' if down else 'gate_up'}_wo_gemv_kernel")
    pointers = {n: "*bf16" for n in ("x_ptr", "h_ptr", "y_ptr", "weights_ptr", "out_ptr")}
    pointers |= {n: "*i32" for n in ("ids_ptr", "sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr", "counters_ptr",
                                      "map_ptr")}
    pointers |= {"q_ptr": "*u8", "s_ptr": "*fp32" if scheme == 1 else "*u8", "z_ptr": "*u8"}
    if up_split > 1:  # the down GEMM reading the split gate-up's float32 partials (``wo_split.load_h``)
        pointers["h_ptr"] = "*fp32"
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BKW=bkw, PER=8, GROUP=128 if scheme == 1 else 32, GROUP_M=1,
                 SCHEME=scheme, ACT=0, NAIVE=True, PDL=False, ASM=True, SPLIT=1, KSUM=False,
                 TOPK_PAD=1, HAS_MAP=False, SUM_ROWS=1, ZERO_T=1, UP_SPLIT=up_split, ROUND=1, AHEAD=ahead, XTILE=x_tile,
                 b13_ptr=None, b2_ptr=None,  # no expert biases (session 40's pointers: the plain kernels)
                 LIMIT_AFTER=False)  # act48's constexpr, passed as the launch passes it
    m = main_loop_of(_compile(fn, pointers, {k: v for k, v in const.items() if k in fn.arg_names}, num_warps))
    weights = block_n * bkw * 8 * (1 if down else 2)
    name = (f"{kind} {'int4' if scheme == 1 else 'mxfp4'} {'down' if down else 'gate-up'} BM={block_m} "
            f"{block_n}x{bkw}w {num_warps}w"
            + (f" h folded from {up_split} splits" if up_split > 1 else "") + (f" ahead {ahead}" if ahead > 1 else "")
            + (" x tile" if x_tile else ""))
    return LoopCount(name, len(m.loop) * 32 * num_warps / weights, m.registers, m.stack,
                     " ".join(f"{k}:{v}" for k, v in m.ops.most_common(8)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default 64 x 16-word gate-up, 1- and 2-row blocks")
    p.add_argument("--fold", action="store_true", help="the down GEMMs reading h plain or folded from 2 / 4 splits")
    args = p.parse_args(argv)
    if args.quick:
        return _report([("gemm_wo_gemv", s, m, 64 if m == 1 else 16, 16, 2 if m == 1 else 1) for s in (1, 2)
                        for m in (1, 2)])
    if args.fold:
        return _report([("gemm_wo_gemv", s, 1, 64, 16, 2, True, u) for s in (1, 2) for u in (1, 2, 4)])
    # session 21 (int4 gate-up 64 x 16 words, 2 warps: 4.65 -> 3.41 with the x tile, same registers)
    return _report([("gemm_wo_gemv", s, 1, bn, 16, 2, d, 1, a, x) for s in (1, 2) for bn in (64, 32)
                    for d in (False, True) for a, x in ((1, False), (1, True), (2, True))])


def _report(jobs: list[tuple], counter=None) -> int:
    """Print each job's OK line (``counter(*job)``, default this file's ``count``) or its FAIL line; 1 if any
    failed (``wo_reg_sass_cpu`` passes its own counter)."""

    def line(job: tuple) -> str:
        c = (counter or count)(*job)
        return (f"{c.name}: {c.per_weight:.2f} instructions a weight, {c.registers} registers, stack {c.stack} B; "
                f"{c.top}")

    return report_jobs([(f"{job}", lambda job=job: line(job)) for job in jobs])


if __name__ == "__main__":
    sys.exit(main())
