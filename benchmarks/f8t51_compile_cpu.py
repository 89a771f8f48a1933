"""Compile, for sm_90 on a machine without a GPU, the fp8 launches of the switch combinations ``moekit tune`` now
searches (``moekit.bench.tuning_switches.switch_variants``) at real cells, as ``triton_fp8`` launches them: shared
memory and ptxas's spill stores per compiled kernel, so a combination that does not compile or spills in its K loop is
seen before a device run (the tuner would time it as failed, ``tuning._timer``).

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/f8t51_compile_cpu.py [--cells qwen3:512 ...]  # Triton 3.6
    PYTHONPATH=$PWD python3 benchmarks/f8t51_compile_cpu.py                                         # Triton 3.9

How: Triton's driver is ``trn50_compile_cpu``'s sm_90 stand-in; each cell's plan is built on CPU tensors (never read)
with the variant's switches, and each of its launches (``triton_fp8.fp8_launches``) compiles through the kernel's
``warmup`` with the arguments the launch binds (``BoundLaunch.compile_arguments``). A kernel met before (same hash) is
not printed again. One line per new kernel; exit 1 when one fails to compile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# (preset, M, the tiles the switches go on: the packaged H200 entry's at that M)
CELLS = {"qwen3:512": ("qwen3-30b-a3b", 512), "qwen3:8": ("qwen3-30b-a3b", 8), "mixtral:256": ("mixtral-8x7b", 256)}


def compile_variant(shape, m: int, config, seen: dict) -> list[str]:
    """Lines for the kernels of ``config`` (tiles with switches) at M = m not compiled before."""
    from gluon_fp8_compile_cpu import ptxas_report, sass_spill_places

    from moekit.bench.tuning import tiles_of
    from moekit.bench.tuning_switches import switches_of
    from moekit.experts.triton_fp8 import _DESCRIPTORS, fp8_launches
    from moekit.experts.triton_fp8_plan import build_plan
    from moekit.experts.triton_launch import LaunchOptions

    e, n, k = shape.num_experts, shape.n, shape.k
    x = torch.empty(m, k, dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * n, k, dtype=torch.float8_e4m3fn), torch.empty(e, k, n, dtype=torch.float8_e4m3fn)
    s13, s2 = torch.empty(e, 2 * n // 128, k // 128), torch.empty(e, k // 128, n // 128)
    ids, weights = torch.zeros(m, shape.top_k, dtype=torch.int32), torch.zeros(m, shape.top_k)
    s = switches_of(config)
    plan = build_plan(x, w13, s13, w2, s2, ids, None, (128, 128), tiles_of(config), LaunchOptions(),
                      weight_tma=s.weight_tma, persistent=s.persistent, pair_dot=s.pair_dot)
    w13_arg, w2_arg = w13, w2
    if plan.descriptor_key is not None:
        pair = _DESCRIPTORS.get(w13, w2, plan.descriptor_key)
        w13_arg, w2_arg = pair.w13, pair.w2
    b = plan.workspace.allocate(torch.device("cpu"))
    lines = []
    for launch, pointers in fp8_launches(plan, b, x, w13_arg, s13, w2_arg, s2, ids, weights, None, torch.empty_like(x)):
        args, kwargs = launch.compile_arguments(pointers)
        t0 = time.perf_counter()
        compiled = launch.kernel.warmup(*args, grid=launch.grid, **kwargs)
        if compiled.hash in seen:
            continue
        seen[compiled.hash] = launch.kernel.fn.__name__
        spills, _ = ptxas_report(compiled.asm["ptx"])
        lines.append(f"  {launch.kernel.fn.__name__:34s} shared {compiled.metadata.shared:6d} B, spill stores "
                     f"{spills} B ({sass_spill_places(compiled.asm['ptx'])}), {time.perf_counter() - t0:.1f} s")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    args = p.parse_args()
    import triton
    from triton.runtime.driver import driver
    from trn50_compile_cpu import _SM90

    driver.set_active(_SM90())
    from moekit.bench.cells import Shape
    from moekit.bench.tuning_switches import current_fp8, switch_variants
    from moekit.experts.configs import clear_config_cache

    clear_config_cache()
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed, seen = 0, {}
    for cell in args.cells:
        preset, m = CELLS[cell]
        shape = Shape.from_preset(preset)
        today = current_fp8(m, shape, "NVIDIA_H200")
        for config in [today, *switch_variants(m, shape, today)]:
            label = f"{cell} {config.to_dict()}"
            try:
                lines = compile_variant(shape, m, config, seen)
            except Exception as exc:  # noqa: BLE001 (report each variant)
                failed += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
                continue
            print(f"OK {label}", *lines, sep="\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
