"""The calls and GEMMs ``f8r32_device_check.py`` times: the route, the fp8 Gluon path with the plan's tiles and with
the options (padding halves skipped, the pipelined promotion, the gate-up in pipelined passes), and the GEMMs alone
on a cell's layout."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_variants import Variant  # noqa: E402


def calls(q: tuple) -> list[Variant]:
    """route (the ``triton`` backend), gluon (the lean fp8 Gluon call, the plan's tiles), pipe (the down GEMM
    pipelined), skip (both GEMMs skipping padding halves: bit-equal to gluon), skip+pipe (skip, the
    down GEMM pipelined: bit-equal to pipe), pairs+pipe (the gate-up in two pipelined passes, the down pipelined),
    skip+pairs+pipe (the same skipping padding halves: bit-equal to pairs+pipe)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import (
        PAIRS_UP_TILE, PIPELINED_DOWN_TILE, SKIP_DOWN_TILE, SKIP_UP_TILE,
    )
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))

    def gluon(up=None, down=None):
        return lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=up, down=down)

    return [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("gluon", "gluon", gluon()),
            Variant("pipe", "gluon", gluon(down=PIPELINED_DOWN_TILE)),
            Variant("skip", "gluon", gluon(SKIP_UP_TILE, SKIP_DOWN_TILE), same_as="gluon"),
            Variant("skip+pipe", "gluon", gluon(SKIP_UP_TILE, replace(SKIP_DOWN_TILE, pipelined=True)),
                    same_as="pipe"),
            Variant("pairs+pipe", "gluon", gluon(PAIRS_UP_TILE, PIPELINED_DOWN_TILE)),
            Variant("skip+pairs+pipe", "gluon", gluon(replace(PAIRS_UP_TILE, skip=True),
                                                      replace(SKIP_DOWN_TILE, pipelined=True)), same_as="pairs+pipe")]



def gemms_alone(x: torch.Tensor, ids: torch.Tensor, q: tuple) -> list[Variant]:
    """The cell's GEMMs alone on its layout, each a Variant whose call takes no arguments: gate-up (the plan's: the h
    the down GEMMs read, zeros until it runs), gate-up skip, gate-up pairs, down, down skip, down pipe, down skip
    pipe."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import (
        PAIRS_UP_TILE, PIPELINED_DOWN_TILE, SKIP_DOWN_TILE, SKIP_UP_TILE, launch_gemm_fp8, plan_gluon_fp8,
    )

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    plan = plan_gluon_fp8(x.shape[0], ids.shape[1], num_experts, hidden)
    lay = gluon_fp8_layout(x, ids, num_experts, gather_groups=plan.gather_groups)
    rows = lay.x_q.shape[0]
    h_q = torch.zeros(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.ones(rows, inter // 128, device=x.device, dtype=torch.float32)  # [R, N/128]
    h2_q, h2_s = torch.empty_like(h_q), torch.empty_like(h_s)
    y = x.new_empty(rows, hidden)  # [R, K]
    common = dict(sorted_ids=lay.sorted_ids, num_assignments=ids.numel())

    def up(tile, out, out_s):
        return lambda *_: launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, out, out_s, lay.block_experts,
                                          lay.rows_used, tile, True, inter, **common)

    def down(tile):
        return lambda *_: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, lay.block_experts, lay.rows_used, tile,
                                          False, **common)

    return [Variant("gate-up", "gemm", up(plan.up, h_q, h_s)),
            Variant("gate-up skip", "gemm", up(SKIP_UP_TILE, h2_q, h2_s)),
            Variant("gate-up pairs", "gemm", up(PAIRS_UP_TILE, h2_q, h2_s)),
            Variant("down", "gemm", down(plan.down)), Variant("down skip", "gemm", down(SKIP_DOWN_TILE)),
            Variant("down pipe", "gemm", down(PIPELINED_DOWN_TILE)),
            Variant("down skip pipe", "gemm", down(replace(SKIP_DOWN_TILE, pipelined=True)))]
