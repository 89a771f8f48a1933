"""The words gate-up (``moekit/experts/_kernels/gluon_wo_words.py``) compiled for sm_90 without a GPU: registers and
stack (cuobjdump), and its main loop in the SASS (the backward branch whose body holds the HMMAs): instructions a
weight a thread (the loop runs two steps: 2 rows x 256 columns x 2 steps / 4 lanes = 256 weights a thread; the
down kernel's likewise), its
opcodes, its loads by width, and any STS / LDS / SHFL (the operand must reach the MMA without them).

    PYTHONPATH=$PWD python3 benchmarks/w4g45_sass_cpu.py                          # this Triton (3.9 here)
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/w4g45_sass_cpu.py          # Triton 3.6 (the H200's)
    ... w4g45_sass_cpu.py naive aligned                                            # these cases only
    ... w4g45_sass_cpu.py --ahead 2 naive down                                     # words two steps ahead

``--after`` with ``--variant``: the clamp after the activation (LIMIT_AFTER, Step-3.7's; session 48).
``--ahead 2`` compiles ``words_loop``'s AHEAD 2 (session 45, w4u45): its loop runs three steps (384 weights a thread).
``--mxfp4`` compiles both kernels' mxfp4 decode (session 46, wl46: ``_kernels/words_mx.py``; uint8 e8m0 scales, one a
32 columns, no zero points); ``--variant`` gpt-oss's epilogues (b13 / b2, interleaved rows, the clamped SwiGLU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gluon_fp8_compile_cpu import compile_gluon_sm90  # noqa: E402

# (name, BM, NAIVE, num_warps): Mixtral's shape (N 14336, K 4096); shapes reach the kernel as i32 arguments
CASES = (("naive", 8, True, 4), ("aligned", 8, False, 4), ("aligned-bm16", 16, False, 4), ("naive-w8", 8, True, 8),
         ("naive-split", 8, True, 4), ("down", 8, True, 4), ("down-split", 8, True, 4), ("down-aligned", 8, False, 4))
WEIGHTS_A_STEP = 128  # a thread's weights in one step (2 rows x 256 columns / 4 lanes); AHEAD 1 loops 2, AHEAD 2 3


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _groups(mx: bool) -> tuple[int, torch.dtype]:
    """(columns a scale, the scales' dtype): mxfp4's e8m0 bytes of 32, else int4's float32 of 128."""
    return (32, torch.uint8) if mx else (128, torch.float32)


def compile_down(bm: int, naive: bool, split: int, num_warps: int, ahead: int = 1, mx: bool = False,
                 variant: bool = False):
    """The down kernel at Mixtral's shape (w2 [8, 4096, 14336]), 14 steps a split."""
    from moekit.experts._kernels.gluon_wo_words_down import down_words_kernel as kernel

    n, k, e = 14336, 4096, 8
    g, sd = _groups(mx)
    t = lambda dtype: torch.empty(16, dtype=dtype)  # noqa: E731
    args = dict(h_ptr=t(torch.bfloat16), q_ptr=t(torch.uint8), s_ptr=t(sd), z_ptr=t(torch.uint8),
                y_ptr=t(torch.float32 if split > 1 else torch.bfloat16), weights_ptr=t(torch.float32),
                ids_ptr=t(torch.int32), sorted_ids_ptr=t(torch.int32), expert_ids_ptr=t(torch.int32),
                num_padded_ptr=t(torch.int32), b2_ptr=t(torch.float32), K=k, N=n,
                num_assignments=2, num_experts=e, split_steps=14,
                stride_hm=n, stride_qe=k * n // 8, stride_qr=n // 8, stride_se=k * n // g, stride_sr=n // g,
                stride_ze=k * n // 128, stride_zr=n // 128, stride_ym=k, stride_be=k)
    return _compiled(kernel, args, dict(BM=bm, GROUP=g, NAIVE=naive, SPLIT=split, num_warps=num_warps, AHEAD=ahead,
                                        MXFP4=mx, BIASED=variant))


def _compiled(kernel, args: dict, const: dict):
    # what a launch specialises: tensors' 16-byte alignment, integers divisible by 16
    aligned = [name for name, v in args.items() if isinstance(v, torch.Tensor) or (v is not None and v % 16 == 0)]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return compile_gluon_sm90(kernel, args, const, const["num_warps"], attrs=attrs)


def compile_case(bm: int, naive: bool, num_warps: int, split: int = 1, ahead: int = 1, mx: bool = False,
                 variant: bool = False, after: bool = False):
    from moekit.experts._kernels.gluon_wo_words import gate_up_words_kernel as kernel

    n, k, e = 14336, 4096, 8
    g, sd = _groups(mx)
    t = lambda dtype: torch.empty(16, dtype=dtype)  # noqa: E731
    args = dict(x_ptr=t(torch.bfloat16), xsum_ptr=t(torch.float32), q_ptr=t(torch.uint8), s_ptr=t(sd),
                z_ptr=t(torch.uint8), h_ptr=t(torch.bfloat16), ids_ptr=t(torch.int32), sorted_ids_ptr=t(torch.int32),
                expert_ids_ptr=t(torch.int32), num_padded_ptr=t(torch.int32),
                b13_ptr=t(torch.float32), N=n, K=k, num_assignments=2, top_k=2,
                num_experts=e, stride_xm=k, stride_xsm=k // 128, stride_qe=2 * n * k // 8, stride_qr=k // 8,
                stride_se=2 * n * k // g, stride_sr=k // g, stride_ze=2 * n * k // 128, stride_zr=k // 128,
                stride_hm=n, stride_be=2 * n)
    const = dict(BM=bm, GROUP=g, NAIVE=naive, num_warps=num_warps, H_ORDER=split == 1, SPLIT=split, AHEAD=ahead,
                 MXFP4=mx)
    # every constexpr by value (this compile takes no defaults): plain SiLU, or gpt-oss's b13, interleaved rows and
    # clamped SwiGLU
    const.update(BIASED=variant, INTERLEAVED=variant, LIMIT=7.0 if variant else 0.0, ALPHA=1.702 if variant else 1.0,
                 UP_SHIFT=1.0 if variant else 0.0, LIMIT_AFTER=variant and after)
    return _compiled(kernel, args, const)


def loop_ops(sass: str) -> list[str]:
    """The opcodes (with their modifiers) of the last backward branch's body that holds HMMAs."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i + 1) < i and any("HMMA" in b for b in lines[labels[m.group(1)]:i]):
            found = []
            for b in lines[labels[m.group(1)]:i + 1]:
                if mm := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", b):
                    words = mm.group(1).split()
                    found.append(words[1] if words[0].startswith("@") else words[0])
    return found


def report(name: str, bm: int, naive: bool, num_warps: int, ahead: int = 1, mx: bool = False,
           variant: bool = False, after: bool = False) -> str:
    if name.startswith("down"):
        out = compile_down(bm, naive, 4 if name == "down-split" else 1, num_warps, ahead, mx, variant)
    else:
        out = compile_case(bm, naive, num_warps, 2 if name == "naive-split" else 1, ahead, mx, variant, after)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(out.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(_tools(), "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True).stdout
        usage = subprocess.run([os.path.join(_tools(), "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ops = loop_ops(sass)
    top = " ".join(f"{k}:{v}" for k, v in Counter(o.split(".")[0] for o in ops).most_common(12))
    loads = dict(Counter(o for o in ops if o.startswith("LDG")))
    hops = sum(o.startswith(("STS", "LDS", "SHFL", "STL", "LDL")) for o in ops)
    weights = WEIGHTS_A_STEP * (ahead + 1)  # the loop's steps: 2 (AHEAD 1), 3 (AHEAD 2)
    label = name + " mxfp4" * mx + " variant" * variant + " clamp after" * (variant and after)
    return (f"{label} ahead {ahead}: registers {regs.group(1)}, stack {regs.group(2)} B; loop {len(ops)} "
            f"instructions, {len(ops) / weights:.2f} a weight ({bm} tokens a block), "
            f"STS/LDS/SHFL/local in the loop {hops}; {top}; loads {loads}")


def main() -> int:
    import triton

    print("triton", triton.__version__, flush=True)
    names = [n for n in sys.argv[1:] if n not in ("--mxfp4", "--variant", "--after")]
    mx, variant, after, ahead = "--mxfp4" in sys.argv, "--variant" in sys.argv, "--after" in sys.argv, 1
    if "--ahead" in names:
        i = names.index("--ahead")
        ahead = int(names[i + 1])
        names = names[:i] + names[i + 2:]
    for case in CASES:
        if not names or case[0] in names:
            print(report(*case, ahead=ahead, mx=mx, variant=variant, after=after), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
