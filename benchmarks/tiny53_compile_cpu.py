"""Compile, for sm_90 on a machine without a GPU, the weight-only launches of ``tiny53_device_check.py``'s variants:
each decode with the tiny-batch shortcut (block a = assignment a) and on aligned blocks
(``LaunchOptions.shortcut_max_tokens=1``), as ``triton_wo_plan`` / ``triton_wo_words_lean`` bind them at the
H100's / H200's device facts: registers, shared memory, spill stores and SASS instructions per kernel, so what the
aligned layout costs a kernel statically is read before the device times it.

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/tiny53_compile_cpu.py      # Triton 3.6 (the GPU machine's)
    PYTHONPATH=$PWD python3 benchmarks/tiny53_compile_cpu.py                      # Triton 3.9

How: ``dsv52_compile_cpu``'s: Triton's driver is ``trn50_compile_cpu``'s sm_90 stand-in, the weights live on the
meta device (DeepSeek-V3's / Qwen3-30B-A3B's shapes and strides, no memory), the plan asks the device facts of an
H100 / H200 (PDL, 227 KB of shared memory, the register decode's inline PTX), each launch compiles through its
kernel's ``warmup`` with the arguments it binds. The configs: the packaged / heuristic ones of the H200.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from dsv52_compile_cpu import DEVICE, SHARED, compiled_lines, weight  # noqa: E402

# (preset, scheme, M, decode, BLOCK_M of the aligned variant: 0 the config's)
CELLS = (("deepseek-v3", "int4_w4a16", 8, "gluon_words", 0), ("deepseek-v3", "int4_w4a16", 8, "gemv", 0),
         ("deepseek-v3", "int4_w4a16", 8, "gemv", 2), ("deepseek-v3", "mxfp4", 8, "mma", 0),
         ("deepseek-v3", "int8_w8a16", 8, "tile", 0), ("qwen3-30b-a3b", "int4_w4a16", 4, "gemv", 0))
GROUP = {"int4_w4a16": 128, "mxfp4": 32, "int8_w8a16": 0}


def weight_args(scheme: str, e: int, rows: int, cols: int):
    """``triton_wo_plan.WeightArgs`` of meta tensors in the scheme's layout (``tiny53_device_check.packed``'s)."""
    from moekit.experts.triton_wo_plan import weight_args as bind

    group = GROUP[scheme]
    if scheme == "int8_w8a16":
        return bind(weight((e, rows, cols), torch.int8), weight((e, rows), torch.float32), None, 0)
    q = weight((e, rows, cols // 2), torch.uint8)
    if scheme == "int4_w4a16":
        return bind(q, weight((e, rows, cols // group), torch.float32), weight((e, rows, cols // group), torch.uint8),
                    group)
    return bind(q, weight((e, rows, cols // group), torch.uint8), None, group)


def compile_cell(preset: str, scheme: str, m: int, decode: str, block_m: int, aligned: bool) -> list[str]:
    from moekit.bench.cells import Shape
    from moekit.experts.triton_launch import SHORTCUT_ANY_TOKENS, LaunchOptions
    from moekit.experts.triton_wo_configs import wo_config

    shape = Shape.from_preset(preset)
    e, n, k = shape.num_experts, shape.n, shape.k
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w13, w2 = weight_args(scheme, e, 2 * n, k), weight_args(scheme, e, k, n)
    ids, weights = torch.zeros(m, shape.top_k, dtype=torch.int32), torch.zeros(m, shape.top_k)
    options = LaunchOptions(shortcut_max_tokens=1 if aligned else SHORTCUT_ANY_TOKENS)
    out = torch.empty_like(x)
    if decode == "gluon_words":
        from moekit.experts.triton_wo_words_lean import words_launches, words_plan

        plan = words_plan(x, w13, w2, ids, shortcut=not aligned)
        b = plan.workspace.allocate(torch.device("cpu"))
        launches = words_launches(plan, b, x, ids, weights, out, w13, w2)
        layout = "none" if plan.align is None else plan.align.launches
        return [f"{preset} {scheme} M={m} {decode} {'aligned' if aligned else 'shortcut'}: layout launches {layout}",
                *compiled_lines(launches)]
    from moekit.experts.triton_wo import wo_launches
    from moekit.experts.triton_wo_plan import build_wo_plan

    config = None
    if block_m and aligned:
        config = replace(wo_config(m, e, n, k, shape.top_k, scheme, DEVICE, decode), BLOCK_M=block_m)
    plan = build_wo_plan(x, w13, w2, ids, None, scheme, "silu", config, options, decode=decode)
    b = plan.workspace.allocate(torch.device("cpu"))
    launches = wo_launches(plan, b, x, w13, w2, ids, weights, None, out)
    layout = "none" if plan.align is None else plan.align.launches
    return [f"{preset} {scheme} M={m} {decode} {'aligned' if aligned else 'shortcut'}: layout launches {layout}, "
            f"BLOCK_M {plan.config.BLOCK_M}, split {plan.split_k}", *compiled_lines(launches)]


def main() -> int:
    import triton
    from triton.runtime.driver import driver
    from trn50_compile_cpu import _SM90

    import moekit.experts.triton_wo_plan as wp

    driver.set_active(_SM90())
    wp.max_shared_memory = lambda device: SHARED
    wp.inline_asm_ok = lambda device: True  # an sm_90 GPU, compiled
    wp.resolve_launch_options = lambda options, device: options  # PDL kept, as on sm_90
    wp.device_key = lambda device: DEVICE  # the H200's configs, as on the device
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed = 0
    for cell in CELLS:
        for aligned in (False, True):
            if cell[4] and not aligned:
                continue  # the 2-row gemv: its shortcut line is the 1-row one's
            try:
                print(*compile_cell(*cell, aligned), sep="\n", flush=True)
            except Exception as exc:  # noqa: BLE001 (report each plan)
                failed += 1
                print(f"FAIL {cell} aligned={aligned}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
