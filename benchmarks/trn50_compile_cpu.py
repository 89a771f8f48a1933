"""Compile the fused backward's kernels for sm_90 on a machine without a GPU, as ``experts_backward`` launches them
for a tile set at a real shape: each tile candidate of ``triton_backward_candidates`` and the tiles the backward takes
now, at the cells ``trn50_device_check.py`` times. Shared memory and ptxas's spill stores per kernel, so a candidate
that would not fit or spills is seen before a device run.

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/trn50_compile_cpu.py      # Triton 3.6 (the GPU machine's)
    PYTHONPATH=$PWD python3 benchmarks/trn50_compile_cpu.py                      # Triton 3.9

How: Triton's driver is replaced by a stand-in whose current target is sm_90 and every ``kernels(name)`` of the
launch modules by one whose ``kernel[grid](...)`` is ``kernel.warmup``: the launch functions run on CPU tensors
(``torch.empty``, never read) and each launch compiles without running. The layout and the k-sum (which launch
through bound launches, not ``kernels``) are stand-ins of the right shapes. One line per (cell, tile set, compiled
kernel): shared bytes, spill store bytes and where the spills sit (``sass_loops``: in the MMA loops or around them),
seconds. Exit 1 when one fails to compile.

Shapes: M tokens, A = M*k, P layout rows, E experts, K hidden, N intermediate, B the layout's block.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# (layer, M, E, top_k, K, N, the class ``TUNED`` keys it by on sm_90)
CELLS = (("mixtral", 1024, 8, 2, 4096, 14336, "wide/few"), ("mixtral", 4096, 8, 2, 4096, 14336, "wide/some"),
         ("dsv2lite", 16384, 64, 6, 2048, 1408, "mid/many"))


class _SM90:
    """Triton's driver as far as a warmup needs it: device 0, stream 0, target sm_90."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _Warm:
    """A kernel module whose ``kernel[grid](...)`` compiles (``warmup``) and records (name, compiled kernel)."""

    def __init__(self, module, seen: list):
        self.module, self.seen = module, seen

    def __getattr__(self, name):
        kernel = getattr(self.module, name)

        class Launch:
            def __getitem__(_, grid):
                def warm(*args, **kwargs):
                    t0 = time.perf_counter()
                    self.seen.append((name, kernel.warmup(*args, grid=grid, **kwargs), time.perf_counter() - t0))
                return warm
        return Launch()


def _layout(bl, a: int, num_experts: int, block_m: int):
    """A stand-in layout of the real one's shapes (its contents never read: nothing runs)."""
    rows = (a + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    i32 = dict(dtype=torch.int32)
    return bl.Layout(torch.zeros(rows, **i32), torch.zeros(rows // block_m, **i32), torch.zeros(1, **i32),
                     torch.zeros(num_experts, **i32), rows // block_m, a, block_m)


def compile_cell(cell: tuple, tiles, seen: list) -> None:
    import moekit.experts.triton_backward_launch as bl

    _, m, e, top_k, k, n, _ = cell
    x, dout = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(m, k, dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * n, k, dtype=torch.bfloat16), torch.empty(e, k, n, dtype=torch.bfloat16)
    ids, weights = torch.zeros(m, top_k, dtype=torch.int32), torch.zeros(m, top_k)
    real_align, real_sum = bl.align, bl.sum_slots
    bl.align = lambda ids_, _map, num_experts, block_m: _layout(bl, ids_.numel(), num_experts, block_m)
    bl.sum_slots = lambda per_slot, ids_, _map, _e, dtype: torch.empty(ids_.shape[0], per_slot.shape[1], dtype=dtype)
    try:
        bl.experts_backward(dout, x, w13, w2, ids, weights, None, None, "silu", (True,) * 4, tiles=tiles)
    finally:
        bl.align, bl.sum_slots = real_align, real_sum


def main() -> int:
    import triton
    from triton.runtime.driver import driver

    driver.set_active(_SM90())
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_backward_sorted as bs
    import moekit.experts.triton_wgrad as tw
    from moekit.experts.triton_backward_candidates import candidates_for

    seen: list = []
    for module in (bl, bs, tw):
        real = module.kernels
        module.kernels = lambda name, real=real: _Warm(real(name), seen)
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed = 0
    for cell in CELLS:
        cls = cell[-1]
        default = bl.TUNED.get(cls) or bl.backward_tiles(cell[1] * cell[3], cell[2], cell[5], torch.bfloat16)
        for name, tiles in {"default": default, **candidates_for(cls)}.items():
            seen.clear()
            try:
                compile_cell(cell, tiles, seen)
            except Exception as exc:  # noqa: BLE001 (report each tile set)
                failed += 1
                print(f"FAIL {cell[0]} M={cell[1]} [{cls}] {name}: {type(exc).__name__}: {str(exc)[-800:]}")
                continue
            report(f"{cell[0]} M={cell[1]} [{cls}] {name:13s}", seen)
    return 1 if failed else 0


def report(label: str, seen: list) -> None:
    """One line per distinct compiled kernel of ``seen`` ((name, compiled, seconds) from ``_Warm``): shared bytes,
    ptxas's spill stores and where they sit (``gluon_fp8_compile_cpu``), warps, stages, compile seconds."""
    from gluon_fp8_compile_cpu import ptxas_report, sass_spill_places

    done = set()
    for kernel_name, compiled, seconds in seen:
        if compiled.hash in done:  # dW13 and dW2 (or the two permutes) of one compiled kernel
            continue
        done.add(compiled.hash)
        spills, _ = ptxas_report(compiled.asm["ptx"])
        places = sass_spill_places(compiled.asm["ptx"])
        print(f"OK {label} {kernel_name:30s} shared {compiled.metadata.shared:6d} B, spill stores {spills} B "
              f"({places}), warps {compiled.metadata.num_warps}, stages {compiled.metadata.num_stages}, "
              f"{seconds:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
