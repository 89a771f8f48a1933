"""The fp8 Gluon GEMM's A-from-registers option (``Fp8GluonTile.a_regs``) on the CPU: the plain and lean launches
bind it (and its register split) with the GEMMs as torch stand-ins (``_gluon_fakes.fp8_gemm``), equal bit for bit to
the SMEM-operand tiles and close to a float64 loop; the register budget of its split. The kernel itself (the wgmma
reading A from registers): ``benchmarks/f8pre_device_check.py`` on the H200, ``gluon_fp8_compile_cpu.py`` offline."""

from __future__ import annotations

import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8_launch import (
    A_REGS_UP_TILE, A_REGS_WIDE_DOWN_TILE, DOWN_TILE, UP_TILE, Fp8GluonTile,
)
from test_gluon_fp8_wide import _f64, _problem


def test_a_regs_tiles_equal_the_smem_ones_and_a_float64_loop(fake_gemms):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _problem(40)
    base = experts_gluon_fp8(x, *q, ids, weights, up=UP_TILE, down=DOWN_TILE, lean=False)
    plain = experts_gluon_fp8(x, *q, ids, weights, up=A_REGS_UP_TILE, down=A_REGS_WIDE_DOWN_TILE, lean=False)
    lean = experts_gluon_fp8(x, *q, ids, weights, up=A_REGS_UP_TILE, down=A_REGS_WIDE_DOWN_TILE)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, base) and torch.equal(lean, base)
    assert rel_l2(plain, _f64(x, q, ids, weights)) < 2e-2
    launches = [(bound, options) for _, bound, options in fake_gemms["fp8"].log]
    bound_a_regs = [(b["GATED"], b["A_REGS"], b["CONSUMER_REGS"], o.get("maxnreg")) for b, o in launches]
    assert (True, True, 240, 168) in bound_a_regs and (False, True, 240, 168) in bound_a_regs  # plain and lean
    assert (True, False, 224, 160) in bound_a_regs  # the plan's tiles: SMEM operands


def test_a_regs_register_split_fits_the_register_file():
    """12 warps at launch (the loader's one padded to a warpgroup) within 64K registers; consumer 0 gets the rest
    (3 x max_registers - 24 - consumer_regs), at most 256 and at least consumer 1's 240 (16 more than the plan's)."""
    for tile in (A_REGS_UP_TILE, A_REGS_WIDE_DOWN_TILE):
        assert 12 * 32 * tile.max_registers <= 64 * 1024
        consumer0 = 3 * tile.max_registers - 24 - tile.consumer_regs
        assert tile.consumer_regs <= consumer0 <= 256 and consumer0 % 8 == 0
        assert tile.consumer_regs - Fp8GluonTile().consumer_regs == 16
