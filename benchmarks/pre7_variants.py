"""What ``pre7_device_check.py`` runs at issue 19's bf16 prefill cells: the whole-call variants against the route
and the GEMMs it times alone, for the expert-aligned tile order (``GluonTile.expert_order``: a group of the
persistent walk is one expert's row blocks, at most ``group_m`` = 16 of them, so an expert's weight tiles are
fetched once for all its blocks).

Variants (each checked against the Gluon path's torch twin, and bit for bit against the route: the order changes
which program computes a tile, not its arithmetic):
- "route": ``run_experts(backend="triton")``, today's default;
- "up expert": the lean launch with the gate-up GEMM in the expert order, the route's down tile;
- "both expert": both GEMMs in the expert order, the tail kernel's too where the route takes it (experts wider than
  ``NARROW_INTER``: the narrow down GEMM walks its row blocks in plain order, 1.2x faster than GROUP_M 8 there);
- "both expert gather": that, the gate-up GEMM gathering x's rows in its loader (no gather kernel: wide experts
  read the gather kernel + TMA, their gather GEMM measured 6-13% slower in the GROUP_M order, session 23).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from prefill6_variants import Plan, Variant

EXPERT_GROUP = 16  # at most this many of an expert's row blocks a group: DeepSeek-V3 16384 has 4-5, Qwen3 16384 8-9


def expert(tile):
    return replace(tile, expert_order=True, group_m=EXPERT_GROUP)


def orders_down(inter: int) -> bool:
    """Whether the down GEMM is timed in the expert order too (wide experts)."""
    from moekit.experts.triton_gluon_launch import NARROW_INTER

    return inter > NARROW_INTER


def whole_call_variants(w13, w2, plan: Plan) -> list[Variant]:
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_lean import run_lean

    up, down = plan.up, plan.down
    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))]
    if not plan.gluon:
        return out
    out.append(Variant("up expert", lambda x, i, r: run_lean(x, w13, w2, i, r, None, expert(up), down), "route"))
    if orders_down(w2.shape[2]):
        out.append(Variant("both expert", lambda x, i, r: run_lean(x, w13, w2, i, r, None, expert(up), expert(down)),
                           "route"))
        if not plan.in_loader:
            out.append(Variant("both expert gather", lambda x, i, r: run_lean(
                x, w13, w2, i, r, None, expert(up), expert(down), in_loader=True), "route"))
    return out


def gemms_alone(x, ids, bal_ids, w13, w2, plan: Plan) -> dict[str, Callable]:
    """{label: launch} of each GEMM alone under the cell's routing and a balanced one (no padding rows), in the
    route's order and the expert order (the down GEMM's plain tile: the pair's launch takes no tail)."""
    from prefill_variants import bf16_gemm_pair

    from moekit.experts.triton_gluon_launch import down_tile

    down = down_tile(w2.shape[2])
    fns = {}
    for routing, label in ((ids, ""), (bal_ids, " balanced")):
        base = bf16_gemm_pair(x, routing, w13, w2, plan.up, down, in_loader=plan.in_loader)
        ordered = bf16_gemm_pair(x, routing, w13, w2, expert(plan.up), expert(down), in_loader=plan.in_loader)
        base.up()
        ordered.up()
        fns[f"up{label}"], fns[f"up expert{label}"] = base.up, ordered.up
        fns[f"down{label}"] = base.down
        if orders_down(w2.shape[2]):
            fns[f"down expert{label}"] = ordered.down
    if not plan.in_loader:  # the gate-up GEMM gathering its rows, in the expert order (uniform routing)
        gathering = bf16_gemm_pair(x, ids, w13, w2, expert(plan.up), expert(down), in_loader=True)
        fns["up expert in-loader"] = gathering.up
    return fns
