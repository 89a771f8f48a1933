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
against 28.7, 3.4% slower).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

Q3, DS3, MIX = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
# Qwen3 first (timing stops at the deadline: bf16 M = 1 / 2 first), then the guards
CELLS = (("bf16", Q3, 1), ("bf16", Q3, 2), ("fp8", Q3, 1), ("fp8", Q3, 2), ("int4", Q3, 1), ("fp8", Q3, 8))
GUARDS = (("bf16", DS3, 1), ("bf16", MIX, 1), ("bf16", Q3, 8))  # with --guards (runs 1-2 had them)
SMOKE_CELLS = (("fp8", Q3, 1), ("bf16", Q3, 1), ("int4", Q3, 1))
SCHEME = {"fp8": "fp8_block", "int4": "int4_w4a16"}


@dataclass(frozen=True)
class Variant:
    name: str
    decode: tuple | None = None  # (block_k, stages, split): the one-launch persistent Gluon decode kernel (session 24)
    route: str = ""  # "on" / "off": the backend as users call it, its decode route switched so
    # (``triton_gluon_decode.DEFAULT_DECODE``: on = every limit 16, off = 0; "": as the default has it)

    @property
    def exact(self) -> bool:
        """Must equal the default bit for bit (the same kernels again); the decode kernel sums y in float32."""
        return self.decode is None and not self.route


# the persistent Gluon decode kernel's (BK, ring stages, gate-up pieces along K) tried on Qwen3 bf16 (M*k <= 16);
# stages 0: as many as SMEM holds (BK 128: 5; BK 64: 11 at M = 1, 10 at M = 2)
DECODE_TILES = ((128, 0, 1), (64, 0, 1), (128, 0, 2), (128, 0, 4), (64, 0, 4))
DECODE_FP8_SPLITS = (1, 2, 4)  # the fp8_block kernel (BK 128 = one scale block; 12 stages fill SMEM)


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    vs = [Variant("default"), Variant("default again")]
    if preset != Q3 or m * 8 > 16 or dtype not in ("bf16", "fp8") or os.environ.get("TRITON_INTERPRET", "0") not in (
            "", "0"):
        return vs
    vs += [Variant("default, decode route off", route="off"), Variant("default, decode route on", route="on")]
    if dtype == "bf16":
        return vs + [Variant(f"gluon decode k{bk} ks{ks}", (bk, st, ks)) for bk, st, ks in DECODE_TILES]
    return vs + [Variant(f"gluon decode fp8 ks{ks}", (128, 0, ks)) for ks in DECODE_FP8_SPLITS]


def run(v: Variant, dtype: str, t, w, config=None, eager: bool = False) -> torch.Tensor:
    """One call of the default on inputs ``t`` (x, topk_ids, topk_weights) and weights ``w`` (w13, w2; quantized for
    fp8 / int4). ``config``: the real shape's tuned config passed explicitly (compile workers on small-E weights, bf16
    and fp8). ``eager``: unused (the backend tells eager calls from captures itself)."""
    if v.route:
        import moekit.experts.triton_gluon_decode as decode
        from moekit.experts.triton import experts_triton

        on = decode.DecodeChoice(max_slots=16, fp8_max_slots=16) if v.route == "on" else decode.DecodeChoice(0, 0)
        kept, decode.DEFAULT_DECODE = decode.DEFAULT_DECODE, on
        try:
            return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
        finally:
            decode.DEFAULT_DECODE = kept
    if v.decode is not None and dtype == "fp8":
        from moekit.experts.triton_gluon_decode_fp8 import experts_gluon_decode_fp8

        return experts_gluon_decode_fp8(t.x, w[0], w[1], t.topk_ids, t.topk_weights, split=v.decode[2])
    if v.decode is not None:
        from moekit.experts.triton_gluon_decode import experts_gluon_decode

        return experts_gluon_decode(t.x, w[0], w[1], t.topk_ids, t.topk_weights, block_k=v.decode[0],
                                    stages=v.decode[1], split=v.decode[2])
    if config is not None and dtype == "bf16":
        from moekit.experts.triton import fused_experts

        return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
    if config is not None and dtype == "fp8":
        from moekit.experts.triton_fp8 import fused_experts_fp8_launch

        return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                        config=config)
    from moekit.experts.triton import experts_triton

    return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
