"""What ``m1_device_check.py`` measures: its cells (dtype, preset, M) and each cell's variants.

"default" is the backend as users call it (``experts_triton``: bf16, fp8_block and int4_w4a16 weights alike), timed
twice ("default again": the rounds' noise). Run 3 (merged main, ~80 s of device time: Qwen3 cells only, the
guards with ``--guards``): fp8_block Qwen3-30B-A3B entry 1 (M = 1-2) quantizes x
in every gate-up program's prologue ("x_prologue", ``gemm_fp8``'s X_PRO: one launch fewer in graphs too); "x own
kernel" is the behaviour before (``x_prologue=False``: x quantized by its own kernel under a graph capture, inside
the gate-up loop in eager calls, as the entry's "x_in_gate_up" says). The other cells are guards (their defaults).

Run 1 (be148bc, raw/NVIDIA_H200-2026-12-03-be148bc-m1-ck1.*) measured the down GEMM + k-sum over a token's slots in
one launch (``_kernels/down_slots.py``, removed: 1.27-1.8x slower at Qwen3 M = 1, 1.03-1.79x at DeepSeek-V3 and
Mixtral M = 1) and gate-up tiles; run 2 (c144b49, raw/*-c144b49-m1-ck2early.*) BK 256 tiles for both GEMMs of Qwen3's
tiny-batch entry (best 0.98-0.99x: none taken) and the k-sum in the down launch with kept counters in a graph (fold
1.045x, sum programs after 1.001x). The branch history keeps those variants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q3, DS3, MIX = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
# Qwen3 first (timing stops at the deadline), then the guards
CELLS = (("fp8", Q3, 1), ("fp8", Q3, 2), ("bf16", Q3, 1), ("int4", Q3, 1), ("fp8", Q3, 8))
GUARDS = (("bf16", Q3, 2), ("bf16", DS3, 1), ("bf16", MIX, 1), ("bf16", Q3, 8))  # with --guards (runs 1-2 had them)
SMOKE_CELLS = (("fp8", Q3, 1), ("bf16", Q3, 1), ("int4", Q3, 1))
SCHEME = {"fp8": "fp8_block", "int4": "int4_w4a16"}


@dataclass(frozen=True)
class Variant:
    name: str
    again: bool = False  # the default, timed as a row of its own
    x_prologue: bool | None = None  # fp8: passed to ``fused_experts_fp8_launch`` (None: the default call)

    @property
    def is_default(self) -> bool:
        return self.x_prologue is None

    @property
    def exact(self) -> bool:
        """Must equal the default bit for bit (x quantized with the same rounding wherever it is)."""
        return True


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    ends = [Variant("default"), Variant("default again", again=True)]
    if dtype == "fp8" and preset == Q3 and m <= 2:
        return ends + [Variant("x own kernel", x_prologue=False)]
    return ends


def run(v: Variant, dtype: str, t, w, config=None, eager: bool = False) -> torch.Tensor:
    """One call of ``v`` on inputs ``t`` (x, topk_ids, topk_weights) and weights ``w`` (w13, w2; quantized for
    fp8 / int4). ``config``: the real shape's tuned config passed explicitly (compile workers on small-E weights; the
    switches of a tuned fp8 entry then come from ``x_prologue`` alone). ``eager``: unused (the plan tells eager calls
    from captures itself)."""
    if v.is_default:
        if config is not None and dtype == "bf16":
            from moekit.experts.triton import fused_experts

            return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
        if config is not None and dtype == "fp8":
            from moekit.experts.triton_fp8 import fused_experts_fp8_launch

            return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                            config=config, x_prologue=t.x.shape[0] <= 2)
        from moekit.experts.triton import experts_triton

        return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, x_prologue=v.x_prologue)
