"""Compile the kept forward's kernels (``triton_train_forward``: the gate-up GEMM storing h_p, the down GEMM) for sm_90
on a machine without a GPU, with the tiles each source of ``triton_kept_forward`` gives at the cells
``trn52_device_check.py`` times (as an H100 picks them: its sibling H200's config files, 227 KB of shared memory);
shared memory and ptxas's spill stores per kernel, so a tile that would not compile, fit or that spills in its loop is
seen before a device run.

    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/trn52_compile_cpu.py      # Triton 3.6 (the GPU machine's)
    PYTHONPATH=$PWD python3 benchmarks/trn52_compile_cpu.py                      # Triton 3.9

How: ``trn50_compile_cpu``'s driver stand-in (target sm_90), its ``kernels`` wrapper whose launch is
``kernel.warmup`` and its layout stand-in; the k-sum a stand-in of the right shape. One line per (cell, source,
compiled kernel not seen before). Exit 1 when one fails to compile.

Shapes: M tokens, A = M*k, P layout rows, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from trn50_compile_cpu import _SM90, _Warm, _layout, report  # noqa: E402

# (layer, M, E, top_k, K, N): trn52_device_check's cells
CELLS = (("dsv2lite", 1024, 64, 6, 2048, 1408), ("dsv2lite", 4096, 64, 6, 2048, 1408),
         ("qwen3", 1024, 128, 8, 2048, 768), ("qwen3", 4096, 128, 8, 2048, 768),
         ("hunyuan", 1024, 64, 8, 4096, 3072), ("dsv3", 1024, 64, 8, 7168, 2048),
         ("mixtral", 1024, 8, 2, 4096, 14336))
DEVICE, SHARED = "NVIDIA_H100_80GB_HBM3", 232448  # the device's key and the shared memory a program may use


def source_tiles(cell: tuple, source: str):
    """The kept path's tiles at ``cell`` with ``source``'s forward tiles, as an H100 picks them."""
    import moekit.experts.triton_backward_launch as bl
    from moekit.experts.triton_backward_sorted import kept_tiles
    from moekit.experts.triton_kept_forward import KeptShape, forward_tiles

    _, m, e, top_k, k, n = cell
    kept = kept_tiles(bl.TUNED[bl.shape_class(m * top_k, e, n)])
    shape = KeptShape(m, e, n, k, top_k, torch.bfloat16, DEVICE)
    pick = forward_tiles(shape, kept.block_m, kept.fwd13.desc, SHARED, kept.fwd13, source)
    return dataclasses.replace(kept, fwd13=pick.fwd13, fwd2=pick.fwd2), pick.source


def compile_cell(cell: tuple, tiles) -> None:
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_train_forward as tf

    _, m, e, top_k, k, n = cell
    x = torch.empty(m, k, dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * n, k, dtype=torch.bfloat16), torch.empty(e, k, n, dtype=torch.bfloat16)
    ids, weights = torch.zeros(m, top_k, dtype=torch.int32), torch.zeros(m, top_k)
    real = (tf.align, tf.sum_slots)
    tf.align = lambda ids_, _map, num_experts, block_m: _layout(bl, ids_.numel(), num_experts, block_m)
    tf.sum_slots = lambda per_slot, ids_, _map, _e, dtype: torch.empty(ids_.shape[0], per_slot.shape[1], dtype=dtype)
    try:
        tf.sorted_forward(x, w13, w2, ids, weights, None, "silu", tiles, keep_h=True)
    finally:
        tf.align, tf.sum_slots = real


def main() -> int:
    import triton
    from triton.runtime.driver import driver

    driver.set_active(_SM90())
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_train_forward as tf
    from moekit.experts.triton_kept_forward import CANDIDATES

    seen, compiled = [], set()
    for module in (bl, tf):
        real = module.kernels
        module.kernels = lambda name, real=real: _Warm(real(name), seen)
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    failed = 0
    sources = ("kept", "inference", *CANDIDATES) if len(sys.argv) < 2 else tuple(sys.argv[1].split(","))
    for cell in CELLS:
        for source in sources:
            tiles, got = source_tiles(cell, source)
            label = f"{cell[0]} M={cell[1]} {source}{'' if got == source else ' -> ' + got}"
            seen.clear()
            try:
                compile_cell(cell, tiles)
            except Exception as exc:  # noqa: BLE001 (report each cell and source)
                failed += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-800:]}")
                continue
            new = [s for s in seen if s[1].hash not in compiled]
            compiled.update(s[1].hash for s in seen)
            tile_words = " / ".join(f"{t.rows or tiles.block_m}x{t.cols}x{t.red} w{t.num_warps} s{t.num_stages} "
                                    f"g{t.group}" for t in (tiles.fwd13, tiles.fwd2))
            print(f"   {label}: {tile_words}" + ("" if new else " (compiled before)"), flush=True)
            report(label, new)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
