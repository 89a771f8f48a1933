"""The float32 tensor-core gate compiled for sm_90 on a machine without a GPU (session 52): what a program of the gate
+ router launch does at 16 / 64 / 256 rows on today's tiles and on narrower expert blocks
(``gate_mma.mma_tiles(..., fp32_block_e=)``, the same split of K).

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/gate52_compile_cpu.py     (Triton 3.6, the H200's)

For Qwen3-30B-A3B's gate (bf16 x and W, E 128, K 2048), DeepSeek-V3's (bf16 x, float32 W, E 256, K 7168) and
Mixtral's (bf16, E 8, K 4096), each row: the tiles, the grid's programs, the K steps a program runs, the SASS of its
K loop (the loop holding the most FFMAs and no shuffle, which the router's loop has: its instructions, FFMAs and
LDS), the FFMAs a thread issues over its K slice (loop FFMAs x steps), spills (STL / LDL) and shared memory. What a
thread issues in series is what the float32 gate's latency follows (no float32 MMA at ieee); the device check
(``gate52_device_check.py``) times it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from route_sass_diff_cpu import DSV3, MIXTRAL, QWEN3  # noqa: E402  (the launches' router constexprs)
from rtr51_gate_compile_cpu import _compile  # noqa: E402

SHAPES = {"qwen3": (2048, QWEN3, "*bf16"), "dsv3": (7168, DSV3, "*fp32"), "mixtral": (4096, MIXTRAL, "*bf16")}
ROWS = (16, 64, 256)
BLOCK_E = (None, 32, 16)  # fp32_block_e: today's, the candidates
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")
_OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _sass(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


def k_loop(sass: str) -> list[str]:
    """The instructions of the loop (a backward branch to a label above it) with the most FFMAs and no SHFL."""
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.match(line):
            labels.update({name: len(code) for name in pending})
            pending = []
            code.append(m.group(2))
    loops = [code[labels[m.group(1)]:i + 1] for i, text in enumerate(code)
             if (m := _BRANCH.search(text)) and labels.get(m.group(1), i + 1) <= i]
    loops = [body for body in loops if not any(text.startswith("SHFL") for text in body)]
    return max(loops, key=lambda body: sum(text.startswith("FFMA") for text in body), default=[])


def row(shape: str, m: int, block_e: int | None) -> str:
    import torch

    from moekit.routing.gate_mma import mma_tiles

    k, plan, w = SHAPES[shape]
    e = plan["NUM_EXPERTS"]
    t = mma_tiles(m, e, k, torch.float32, fp32_block_e=block_e)
    rows, experts, splits = t.grid(m, e)
    steps = -(-t.k_per_split(k) // t.block_k)
    const = plan | dict(BLOCK_M=t.block_m, BLOCK_E=t.block_e, BLOCK_K=t.block_k, SPLIT_K=t.split_k, IEEE=True,
                        UPCAST=True, HAS_LINEAR_BIAS=False, ROUTE=True, ROUTE_M=max(1, min(t.block_m, 2048 // e)))
    compiled = _compile("gate_mma_kernel", const, "*bf16", w)
    sass = _sass(compiled.asm["cubin"])
    body = k_loop(sass)
    ops = Counter(op.group(1) for text in body if (op := _OPCODE.match(text)))
    spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    return (f"{shape:8} {m:>4} {str(block_e):>5} {t.block_m:>3}x{t.block_e:<4} {t.split_k:>6} "
            f"{rows * experts * splits:>8} {steps:>6} {len(body):>6} {ops['FFMA']:>6} {ops['LDS']:>5} "
            f"{ops['FFMA'] * steps:>11} {spills:>6} {compiled.metadata.shared:>7}")


def main() -> int:
    import triton

    print(f"triton {triton.__version__}, sm_90; float32 logits, x bf16 (V3: W float32), gate + router launch")
    print(f"{'shape':8} {'M':>4} {'fp32e':>5} {'tile':>8} {'split':>6} {'programs':>8} {'steps':>6} {'loop':>6} "
          f"{'FFMA':>6} {'LDS':>5} {'FFMA/thr':>11} {'spills':>6} {'shared':>7}")
    for shape in SHAPES:
        for m in ROWS:
            for block_e in BLOCK_E:
                print(row(shape, m, block_e), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
