"""Compile, for sm_90 on a machine without a GPU, the bf16 (and fp8_block) launches of a decode call with the
tiny-batch shortcut (block a = assignment a, no alignment) and without it (``plan_block_rows(shortcut=False)``: at
A <= 64 the alignment folded into the gate-up GEMM's prologue), as ``triton_plan`` / ``triton_fp8_plan`` bind them:
registers, shared memory, spill stores and
SASS instructions per kernel, so the folded prologue's static cost is read before the device times it
(``dsv52_device_check.py``'s "aligned" variant).

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/dsv52_compile_cpu.py      # Triton 3.6 (the GPU machine's)
    PYTHONPATH=$PWD python3 benchmarks/dsv52_compile_cpu.py                      # Triton 3.9

How: Triton's driver is ``trn50_compile_cpu``'s sm_90 stand-in; the plan is built on CPU tensors (weights on the meta
device: the shapes and strides of DeepSeek-V3's, no memory), the device facts the plan asks
(Triton available, PDL, 227 KB of shared memory) as on an H100 / H200; each launch compiles through the kernel's
``warmup`` with the arguments the launch binds (``BoundLaunch.compile_arguments``). One line per kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

CELLS = (("deepseek-v3", 8), ("deepseek-v3", 4), ("qwen3-30b-a3b", 4))
FP8_CELLS = (("deepseek-v3", 8),)  # fp8_block, the packaged entry with its switches (swap_ab at M = 8)
SHARED = 232448  # bytes a program may use on sm_90 (H100 / H200)
DEVICE = "NVIDIA_H200"  # whose packaged entries the plans take


def weight(shape: tuple, dtype=torch.bfloat16) -> torch.Tensor:
    """A tensor of ``shape`` on the meta device (no memory: compiled against, never read; address 0)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, SASS instructions) of a cubin, from the bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return (int(regs.group(1)) if regs else -1), len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))


def compile_plan(preset: str, m: int, shortcut: bool) -> list[str]:
    import moekit.experts.triton_plan as tp
    from moekit.bench.cells import Shape
    from moekit.experts.configs import get_config
    from moekit.experts.triton import descriptor_pair
    from moekit.experts.triton_launch import LaunchOptions

    shape = Shape.from_preset(preset)
    e, n, k = shape.num_experts, shape.n, shape.k
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w13, w2 = weight((e, 2 * n, k)), weight((e, k, n))
    ids, weights = torch.zeros(m, shape.top_k, dtype=torch.int32), torch.zeros(m, shape.top_k)
    real = tp.plan_block_rows
    tp.plan_block_rows = lambda *a, **kw: real(*a, **{**kw, "shortcut": shortcut})
    try:
        config = get_config(m, e, n, k, shape.top_k, torch.bfloat16, DEVICE)  # the packaged entry, as on the device
        plan = tp.build_plan(x, w13, w2, ids, None, "silu", config, LaunchOptions())
    finally:
        tp.plan_block_rows = real
    pair = descriptor_pair(w13, w2, plan.descriptor_key) if plan.descriptor_key is not None else None
    w13_arg, up_arg, w2_arg = (pair.w13, pair.w13_up, pair.w2) if pair else (w13, None, w2)
    b = plan.workspace.allocate(torch.device("cpu"))
    launches = tp.plan_launches(plan, b, x, w13_arg, up_arg, w2_arg, None, None, ids, weights, None,
                                torch.empty_like(x), None)
    return [title(preset, m, shortcut, plan), *compiled_lines(launches)]


def compile_fp8_plan(preset: str, m: int, shortcut: bool) -> list[str]:
    import moekit.experts.triton_fp8_plan as fp
    from moekit.bench.cells import Shape
    from moekit.bench.tuning import tiles_of
    from moekit.bench.tuning_switches import current_fp8, switches_of
    from moekit.experts.triton_fp8 import _DESCRIPTORS, fp8_launches
    from moekit.experts.triton_launch import LaunchOptions

    shape = Shape.from_preset(preset)
    e, n, k = shape.num_experts, shape.n, shape.k
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w13, w2 = weight((e, 2 * n, k), torch.float8_e4m3fn), weight((e, k, n), torch.float8_e4m3fn)
    s13, s2 = weight((e, 2 * n // 128, k // 128), torch.float32), weight((e, k // 128, n // 128), torch.float32)
    ids, weights = torch.zeros(m, shape.top_k, dtype=torch.int32), torch.zeros(m, shape.top_k)
    config = current_fp8(m, shape, DEVICE)
    sw = switches_of(config)
    real = fp.plan_block_rows
    fp.plan_block_rows = lambda *a, **kw: real(*a, **{**kw, "shortcut": shortcut})
    try:
        plan = fp.build_plan(x, w13, s13, w2, s2, ids, None, (128, 128), tiles_of(config), LaunchOptions(),
                             weight_tma=sw.weight_tma, persistent=sw.persistent, pair_dot=sw.pair_dot)
    finally:
        fp.plan_block_rows = real
    w13_arg, w2_arg = w13, w2
    if plan.descriptor_key is not None:
        pair = _DESCRIPTORS.get(w13, w2, plan.descriptor_key)
        w13_arg, w2_arg = pair.w13, pair.w2
    b = plan.workspace.allocate(torch.device("cpu"))
    launches = fp8_launches(plan, b, x, w13_arg, s13, w2_arg, s2, ids, weights, None, torch.empty_like(x))
    return [title(f"{preset} fp8", m, shortcut, plan), *compiled_lines(launches)]


def title(name: str, m: int, shortcut: bool, plan) -> str:
    layout = "none" if plan.align is None else ("folded" if plan.align.folded else plan.align.launches)
    return f"{name} M={m} {'shortcut' if shortcut else 'aligned'}: layout {layout}, config {plan.config.to_dict()}"


def compiled_lines(launches) -> list[str]:
    """One line per launch: each compiled through its kernel's warmup with the arguments the launch binds."""
    from gluon_fp8_compile_cpu import ptxas_report

    lines = []
    for launch, pointers in launches:
        args, kwargs = launch.compile_arguments(pointers)
        compiled = launch.kernel.warmup(*args, grid=launch.grid, **kwargs)
        spills, _ = ptxas_report(compiled.asm["ptx"])
        regs, sass = resources(compiled.asm["cubin"])
        lines.append(f"  {launch.kernel.fn.__name__:20s} grid {launch.grid} regs {regs:3d} shared "
                     f"{compiled.metadata.shared:6d} B spill stores {spills} B, {sass} SASS instructions")
    return lines


def main() -> int:
    import triton
    from triton.runtime.driver import driver
    from trn50_compile_cpu import _SM90

    import moekit.experts.triton_fp8_plan as fp
    import moekit.experts.triton_plan as tp

    driver.set_active(_SM90())
    tp.is_available = lambda device: True
    tp.max_shared_memory = lambda device: SHARED
    tp.resolve_launch_options = fp.resolve_launch_options = lambda options, device: options  # PDL kept, as on sm_90
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed = 0
    for build, cells in ((compile_plan, CELLS), (compile_fp8_plan, FP8_CELLS)):
        for preset, m in cells:
            for shortcut in (True, False):
                try:
                    print(*build(preset, m, shortcut), sep="\n", flush=True)
                except Exception as exc:  # noqa: BLE001 (report each plan)
                    failed += 1
                    print(f"FAIL {preset} M={m} shortcut={shortcut}: {type(exc).__name__}: {str(exc)[-600:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
