"""The calls ``f8r32_device_check.py`` times: the route (the plan's tiles: the pipelined down GEMM where
``wants_pipelined_down``), the fp8 Gluon path with the waited tiles ("plan": ``UP_TILE``, ``DOWN_TILE``) and with the
pipelined down tile named ("pipe")."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prefill_variants import Variant  # noqa: E402


def calls(q: tuple) -> list[Variant]:
    """route (the ``triton`` backend), plan (the lean fp8 Gluon call, ``UP_TILE`` / ``DOWN_TILE``), pipe (the same with
    ``PIPELINED_DOWN_TILE``: the same products folded in the same order, bit-equal to plan)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, PIPELINED_DOWN_TILE, UP_TILE
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    def gluon(down):
        return lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=UP_TILE, down=down)

    return [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("plan", "gluon", gluon(DOWN_TILE)), Variant("pipe", "gluon", gluon(PIPELINED_DOWN_TILE),
                                                               same_as="plan")]
