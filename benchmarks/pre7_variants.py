"""What ``pre7_device_check.py`` runs at issue 19's bf16 prefill cells: the route's whole call and the GEMMs it times
alone. (Session 27 built it for the expert-aligned tile order, ``GluonTile.expert_order``; no default took it in
three device runs and it was removed in session 28: see triton-notes.md, "Issue 19, session 27".)

Variants (each checked against the Gluon path's torch twin):
- "route": ``run_experts(backend="triton")``, today's default.
"""

from __future__ import annotations

from typing import Callable

from prefill6_variants import Plan, Variant


def whole_call_variants(w13, w2, plan: Plan) -> list[Variant]:
    from moekit.experts import run_experts

    return [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))]


def gemms_alone(x, ids, bal_ids, w13, w2, plan: Plan) -> dict[str, Callable]:
    """{label: launch} of each GEMM alone with the route's tiles under the cell's routing and a balanced one (no
    padding rows; the down GEMM's plain tile: the pair's launch takes no tail)."""
    from prefill_variants import bf16_gemm_pair

    from moekit.experts.triton_gluon_launch import down_tile

    down = down_tile(w2.shape[2])
    fns = {}
    for routing, label in ((ids, ""), (bal_ids, " balanced")):
        pair = bf16_gemm_pair(x, routing, w13, w2, plan.up, down, in_loader=plan.in_loader)
        pair.up()  # compiled, and h filled for the down GEMM
        fns[f"up{label}"], fns[f"down{label}"] = pair.up, pair.down
    return fns
