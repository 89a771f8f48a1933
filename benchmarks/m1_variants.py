"""What ``m1_device_check.py`` measures: its cells (dtype, preset, M) and each cell's variants.

"default" is the backend as users call it (``experts_triton``: bf16, fp8_block and int4_w4a16 weights alike), timed
twice ("default again": the rounds' noise). The Qwen3-30B-A3B decode cells by default, the guards (DeepSeek-V3,
Mixtral, Qwen3 M = 2 / 8 bf16) with ``--guards``.

What the runs measured (the branch history keeps the variants; benchmarks/triton-notes.md has the tables):
run 1 (be148bc, raw/NVIDIA_H200-2026-12-03-be148bc-m1-ck1.*) the down GEMM + k-sum over a token's slots in one launch
(``_kernels/down_slots.py``, removed: 1.27-1.8x slower at Qwen3 M = 1, 1.03-1.79x at DeepSeek-V3 and Mixtral M = 1)
and gate-up tiles; run 2 (c144b49, raw/*-c144b49-m1-ck2early.*) BK 256 tiles for Qwen3's tiny-batch entry (best
0.98-0.99x: none taken) and the k-sum in the down launch with kept counters in a graph (fold 1.045x, sum programs
after 1.001x); run 3 (merged main b89fbea, raw/*-b89fbea-m1-merged.*) fp8 x quantized in every gate-up program's
prologue (``gemm_fp8`` X_PRO, removed: Qwen3 M = 1 19.3 against 19.8 µs, 2.6%, >= 3% in 2 of 7 rounds; M = 2 29.7
against 28.7, 3.4% slower); session 24's run (a6a50f2, raw/*-a6a50f2-persist-ck1.*) one persistent warp-specialized
Gluon kernel per decode call, bf16 and fp8_block (branch ``persist``'s ``_kernels/gluon_decode*.py``, removed: all PASS,
bit-stable, counters reset; Qwen3 M = 1 bf16 32.3 against 26.0 µs, M = 2 53.8 against 47.6, fp8 M = 1 30.9 against
20.1, M = 2 50.1 against 29.1; benchmarks/triton-notes.md, "one persistent Gluon kernel per decode call").
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

    @property
    def exact(self) -> bool:
        """Must equal the default bit for bit (the same kernels again)."""
        return True


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    return [Variant("default"), Variant("default again")]


def run(v: Variant, dtype: str, t, w, config=None, eager: bool = False) -> torch.Tensor:
    """One call of the default on inputs ``t`` (x, topk_ids, topk_weights) and weights ``w`` (w13, w2; quantized for
    fp8 / int4). ``config``: the real shape's tuned config passed explicitly (compile workers on small-E weights, bf16
    and fp8). ``eager``: unused (the backend tells eager calls from captures itself)."""
    if config is not None and dtype == "bf16":
        from moekit.experts.triton import fused_experts

        return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
    if config is not None and dtype == "fp8":
        from moekit.experts.triton_fp8 import fused_experts_fp8_launch

        return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                        config=config)
    from moekit.experts.triton import experts_triton

    return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
