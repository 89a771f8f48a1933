"""Compile the kept path's kernels (``BackwardOptions(recompute=False)``: the forward on permuted rows that stores
h_p, the backward that reads it) for sm_90 on a machine without a GPU, with the tiles ``kept_tiles`` makes of
``TUNED`` at the cells ``trn51_device_check.py`` times; shared memory and ptxas's spill stores per kernel, so a
kernel that would not compile, fit or that spills in its loop is seen before a device run.

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/trn51_compile_cpu.py      # Triton 3.6 (the GPU machine's)
    PYTHONPATH=$PWD python3 benchmarks/trn51_compile_cpu.py                      # Triton 3.9

How: ``trn50_compile_cpu``'s driver stand-in (target sm_90) and its ``kernels`` wrapper whose launch is
``kernel.warmup``, installed on the forward's module too; the layout and the k-sum are stand-ins of the right
shapes. One line per (cell, compiled kernel). Exit 1 when one fails to compile.

Shapes: M tokens, A = M*k, P layout rows, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from trn50_compile_cpu import _SM90, _Warm, _layout, report  # noqa: E402

# (layer, M, E, top_k, K, N, the class ``TUNED`` keys it by on sm_90)
CELLS = (("mixtral", 1024, 8, 2, 4096, 14336, "wide/few"), ("mixtral", 4096, 8, 2, 4096, 14336, "wide/some"),
         ("mixtral", 8192, 8, 2, 4096, 14336, "wide/many"), ("dsv2lite", 1024, 64, 6, 2048, 1408, "mid/few"),
         ("dsv2lite", 4096, 64, 6, 2048, 1408, "mid/some"), ("qwen3", 4096, 128, 8, 2048, 768, "narrow/few"))


def compile_cell(cell: tuple, seen: list) -> None:
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_train_forward as tf
    from moekit.experts.triton_backward_sorted import kept_tiles

    _, m, e, top_k, k, n, cls = cell
    tiles = kept_tiles(bl.TUNED[cls])
    x, dout = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(m, k, dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * n, k, dtype=torch.bfloat16), torch.empty(e, k, n, dtype=torch.bfloat16)
    ids, weights = torch.zeros(m, top_k, dtype=torch.int32), torch.zeros(m, top_k)
    real = (bl.align, bl.sum_slots, tf.align, tf.sum_slots)
    bl.align = tf.align = lambda ids_, _map, num_experts, block_m: _layout(bl, ids_.numel(), num_experts, block_m)
    bl.sum_slots = tf.sum_slots = lambda per_slot, ids_, _map, _e, dtype: torch.empty(ids_.shape[0],
                                                                                      per_slot.shape[1], dtype=dtype)
    try:
        kept = tf.sorted_forward(x, w13, w2, ids, weights, None, "silu", tiles, keep_h=True)
        bl.experts_backward(dout, x, w13, w2, ids, weights, None, kept.h_p, "silu", (True,) * 4, tiles=tiles,
                            x_p=kept.x_p)
    finally:
        bl.align, bl.sum_slots, tf.align, tf.sum_slots = real


def main() -> int:
    import triton
    from triton.runtime.driver import driver

    driver.set_active(_SM90())
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_backward_sorted as bs
    import moekit.experts.triton_train_forward as tf
    import moekit.experts.triton_wgrad as tw

    seen: list = []
    for module in (bl, bs, tf, tw):
        real = module.kernels
        module.kernels = lambda name, real=real: _Warm(real(name), seen)
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed = 0
    for cell in CELLS:
        seen.clear()
        try:
            compile_cell(cell, seen)
        except Exception as exc:  # noqa: BLE001 (report each cell)
            failed += 1
            print(f"FAIL {cell[0]} M={cell[1]} [{cell[-1]}]: {type(exc).__name__}: {str(exc)[-800:]}")
            continue
        report(f"{cell[0]} M={cell[1]} [{cell[-1]}]", seen)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
