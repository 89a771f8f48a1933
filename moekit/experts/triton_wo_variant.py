"""Which fused decode a weight-only call with expert biases or an activation variant (gpt-oss as it ships) takes
where the device measured it apart from a plain call of its shape: ``VARIANT_DECODE_MEASURED``, read by
``triton_wo_plan._usable_decode`` before the plain chooser (``choose_decode``). Where no entry covers a call, it takes
the plain call's decode when that is one of ``triton_wo_gemm.VARIANT_DECODES`` (tile, register, mma, gemv), else
"register"; the scratch decode has its own rule (``triton_wo_scratch.VARIANT_SCRATCH_FROM``).

    measured_variant_decode(scheme, M, E, N, K, k) -> the entry of the nearest measured M (log2 distance) among
    those of the call's tile-height bucket (``height_bucket``), as ``DECODE_MEASURED`` is read, but never past a
    factor 2 beyond the bucket's measured Ms (min / 2 <= M < 2 max: no entry speaks for an M far below or above
    what was measured); None without one

Shapes: M tokens, k slots, E local experts, N intermediate, K hidden.
"""

from __future__ import annotations

from moekit.experts.configs import nearest
from moekit.experts.triton_wo_configs import height_bucket

# (scheme, E, N, K) -> {M: the decode measured faster for variant calls at M}. An entry of another decode than the
# plain chooser's goes in only where the device check (``f6f35e93:benchmarks/wom40_device_check.py``: gpt-oss-20b's
# experts with b13 / b2 and its spec, the new decode against the one the route ran, graph µs) read every check PASS and
# the new decode >= 3% faster in 5/5 rounds; an entry of the chooser's own decode bounds one (a measured M where it
# stayed faster). One H100 80GB HBM3, torch 2.11, Triton 3.6, session 40, f6f35e93:benchmarks/wom40_device_check.py at
# 32870a2d (results/wom40/wom40.log, 59 s, every check PASS), graph µs of the mma decode (16-row blocks, 32 x 128
# one-warp tiles) / the route's decode / bf16, 5 settled rounds:
#   mxfp4 M=8 221.4 / tile 285.9 / 411.9 (x1.29, 5/5), M=64 286.7 / tile 373.7 / 533.2 (x1.30, 5/5); M=256 609.7 /
#   506.9, M=512 1065.9 (32-row 1048.4) / 1047.3, M=724 1426.5 (1328.1) / 1051.7: the tile decode stays (0/5 each).
#   int4 g128 M=8 218.1 / register 229.7 / 411.8 (x1.05, 5/5), M=64 279.0 / 281.8 (x1.01, 0/5: register stays),
#   M=256 557.0 / tile 478.0 (0/5), M=512 952.6 / tile 1043.9 / 600.8 (x1.10, 5/5), M=724 1285.9 / 1070.1 (0/5).
#   int8 M=8 / 64 / 256 / 512: the tile decode 1.03-1.06x the mma (0/5 each): no entry; M=724 not reached.
# Round 2 (the lead, merged main 88753e62, the same H100 kind, wom40 at M = 1 / 8 / 64 / 512, 60 s, every check PASS;
# results/raw/NVIDIA_H100-2026-12-06-88753e6-wom40r2.*): mxfp4 M=1 mma16 54.6 / tile 71.9 / 75.9 (x1.32, 5/5);
# int4 M=1 register 63.9 stays (gemv 62.3, 1/5; mma 66.6); the rows above confirmed (the route's pick within 1% of
# the best arm at mxfp4 8 / 64, int4 8 / 64 / 512).
# So, by the factor-2 reach: mxfp4 M = 1..127 mma; int4 M = 4..22 mma, 23..127 register, 512..608 mma, 609..1023 tile
# (from 1024 scratch, VARIANT_SCRATCH_FROM); int4 M = 1..3 and everything else the plain chooser's.
VARIANT_DECODE_MEASURED: dict[tuple[str, int, int, int], dict[int, str]] = {
    ("mxfp4", 32, 2880, 2880): {1: "mma", 8: "mma", 64: "mma"},  # gpt-oss-20b
    ("int4_w4a16", 32, 2880, 2880): {8: "mma", 64: "register", 512: "mma", 724: "tile"},  # gpt-oss-20b
}


def measured_variant_decode(scheme: str, num_tokens: int, num_experts: int, n: int, k: int, top_k: int) -> str | None:
    """The VARIANT_DECODE_MEASURED entry of the nearest measured M in the call's tile-height bucket, within a factor 2
    of the bucket's measured Ms, or None."""
    bucket = height_bucket(num_tokens, num_experts, top_k)
    measured = {m: decode for m, decode in VARIANT_DECODE_MEASURED.get((scheme, num_experts, n, k), {}).items()
                if height_bucket(m, num_experts, top_k) == bucket}
    if not measured or not min(measured) / 2 <= num_tokens < 2 * max(measured):
        return None
    return measured[nearest({m: m for m in measured}, num_tokens)]
