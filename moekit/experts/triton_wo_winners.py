"""The weight-only decode and tile config measured fastest per (scheme, E, N, K, M) at mid and large
batches on the H200 (issue #16's M >= 1024 target; M = 64 rows; session 38's M = 128 / 512 rows on an H100), as data:
``benchmarks/wo_mid_device_check.py`` prints the rows of WO_WINNERS ready to paste; ``triton_wo_plan.choose_decode``
takes the decode and ``triton_wo_configs.wo_config`` the tile decode's config from here where the device's tuned file
has no entry as near the call (a row counts as one more entry of that file, under the file's own entry of its M).

    winner(scheme, E, N, K, M) -> the row of the measured M nearest to M (log2 distance, ties: the
    smaller) among those within a factor 2 (m/2 <= M < 2m) and m >= MIN_M; None where no row covers M

A row: ``WoWinner(decode, tile)``; decode "tile", "scratch" or "mma" (its config ``wo_config``'s), tile the fastest
tile decode config measured at that cell (a ``WoTileConfig``), or None for the usual lookup (the heuristic's for the
call's tile-height bucket). After a device run, the printed rows replace WO_WINNERS' (a data change; keep the run's
name in the comment above them). Shapes: E local experts, N intermediate, K hidden, M tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.experts.configs import GemmTile, KernelConfig


@dataclass(frozen=True)
class WoTileConfig(KernelConfig):
    """A tile-decode config with its AHEAD switch (``_kernels/gemm_wo``: the next step's weight tile
    loaded and dequantized while this step's ``tl.dot`` runs); both GEMMs share it. A plain
    ``KernelConfig`` runs with AHEAD off."""

    ahead: bool = False

    def to_dict(self) -> dict:
        return {**super().to_dict(), "ahead": self.ahead}


@dataclass(frozen=True)
class WoWinner:
    decode: str  # the decode measured fastest at this cell
    tile: KernelConfig | None = None  # the tile decode's fastest config there (None: wo_config's lookup)


def tile(block_m: int, up: tuple, down: tuple, ahead: bool = False) -> WoTileConfig:
    """A ``WoTileConfig`` from (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of each GEMM (the form
    the device check prints)."""
    return WoTileConfig(block_m, GemmTile(*up), GemmTile(*down), ahead=ahead)


MIN_M = 64  # the table's scope: rows of M >= MIN_M only (smaller ones are ignored), so calls below MIN_M / 2
# never take a row (``triton_wo.run_experts_wo`` skips the chooser's scratch test there)
# (scheme, E, N, K, M) -> WoWinner. H200, Triton 3.6, bf16 activations, µs: benchmarks/wo_mid_device_check.py
# on main at 384c0da (results/raw/NVIDIA_H200-2026-12-02-384c0da-wo_mid.log): the comment of a row gives the
# winner's, scratch's, the previous default's and bf16's time.
WO_WINNERS: dict[tuple[str, int, int, int, int], WoWinner] = {
    # mixtral-8x7b M=64 (~16 rows an expert), branch wo-decode2 at 3e6e2c6, benchmarks/wo_tall_decode_device_check.py,
    # µs: the tile decode's m64 (64 x 64 tiles, 4 warps, 4 stages) 824, default (32-row tile) 1032, register 16-row
    # 847, bf16 646; 1.28x bf16. mxfp4 there: m64 843 against 862, within the noise: not taken. Session 29 (branch
    # dec9, benchmarks/dec9_device_check.py CK1b at fdff4b0, graph µs, 5 interleaved rounds): the mma decode (16-row
    # blocks, 32 x 128 one-warp tiles) 474.0 against m64's 819.5, 0.578x in 5/5 rounds (0.73x bf16): taken
    ("int4_w4a16", 8, 14336, 4096, 64): WoWinner("mma"),
    # mixtral-8x7b int8 M=64 (~1.45 16-row blocks an expert): session 32 (branch wo32, benchmarks/wo32_device_check.py,
    # graph µs, 5 rounds timed by bench_rounds.settled): the tile decode's 16-row tiles of M=8 with GROUP_M 8 (an
    # expert's second block reads its weights from L2) 491.3 against the 32-row route's 530.0 (CK2 at e28dabb, every
    # round <= 0.957x; CK1 at 6f48529 471.7 against 532.9, 4/5: round 3 0.988x); GROUP_M 1 498.8, 2 503.4
    ("int8_w8a16", 8, 14336, 4096, 64): WoWinner("tile", tile(16, (64, 128, 8, 4, 4), (128, 128, 8, 4, 4))),
    # qwen3-30b-a3b µs: m64 501, scratch 770, default 579, bf16 371; 1.35x bf16
    ("int4_w4a16", 128, 768, 2048, 1024): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # qwen3-30b-a3b µs: m128 1324, scratch 1130, default 1130, bf16 738; 1.53x bf16
    ("int4_w4a16", 128, 768, 2048, 4096): WoWinner("scratch", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), False)),
    # qwen3-30b-a3b µs: m64 439, scratch 827, default 451, bf16 371; 1.19x bf16
    ("int8_w8a16", 128, 768, 2048, 1024): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # qwen3-30b-a3b µs: m128 1083, scratch 1188, default 1084, bf16 738; 1.47x bf16
    ("int8_w8a16", 128, 768, 2048, 4096): WoWinner("tile", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), False)),
    # qwen3-30b-a3b mxfp4 M=512 (32 rows an expert; session 39: benchmarks/wo38_device_check.py at 38ead07c, ONE H100
    # 80GB, PASS, 5/5 >= 3%): the mma decode in 32-row blocks (``triton_wo_configs.MMA_CONFIGS``) 328.3 against the
    # M=1024 row's m64 tile 371.1 µs (int4 at M=512: the m64 tile stays the fastest, 342.0). Serves 512..724 (nearest);
    # at 256..511 the decode and bucket config are what they were (the mma decode, 16-row blocks)
    ("mxfp4", 128, 768, 2048, 512): WoWinner("mma"),
    # qwen3-30b-a3b µs: m64 543, scratch 764, default 647, bf16 371; 1.46x bf16
    ("mxfp4", 128, 768, 2048, 1024): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # qwen3-30b-a3b µs: m128n256a 1508, scratch 1115, default 1115, bf16 738; 1.51x bf16
    ("mxfp4", 128, 768, 2048, 4096): WoWinner("scratch", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)),
    # mixtral-8x7b µs: m128n256a 3376, scratch 2548, default 3591, bf16 1477; 1.73x bf16
    ("int4_w4a16", 8, 14336, 4096, 1024): WoWinner("scratch", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)),
    # mixtral-8x7b µs: m256n64a 9868, scratch 5756, default 5756, bf16 5177; 1.11x bf16
    ("int4_w4a16", 8, 14336, 4096, 4096): WoWinner("scratch", tile(256, (64, 64, 8, 8, 3), (64, 64, 8, 8, 4), True)),
    # mixtral-8x7b µs: m128 2423, scratch 2614, default 2438, bf16 1477; 1.64x bf16
    ("int8_w8a16", 8, 14336, 4096, 1024): WoWinner("tile", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), False)),
    # mixtral-8x7b µs: m128 7762, scratch 6178, default 6178, bf16 5177; 1.19x bf16
    ("int8_w8a16", 8, 14336, 4096, 4096): WoWinner("scratch", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), False)),
    # mixtral-8x7b µs: m128n256a 3432, scratch 2461, default 4008, bf16 1477; 1.67x bf16
    ("mxfp4", 8, 14336, 4096, 1024): WoWinner("scratch", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)),
    # mixtral-8x7b µs: m256n64a 9689, scratch 5853, default 5853, bf16 5177; 1.13x bf16
    ("mxfp4", 8, 14336, 4096, 4096): WoWinner("scratch", tile(256, (64, 64, 8, 8, 3), (64, 64, 8, 8, 4), True)),
    # deepseek-v3 µs: m64 6139, scratch 14064, default 6135, bf16 5219; 1.18x bf16. Session 38 (below): the mma decode
    # 5691.6 against 6036.3 (5/5), the Gluon path 5569.2; session 39 the Gluon path won at 1448 / 2048 too and takes
    # M >= 1024 (``triton_gluon_wo.GLUON_WO_CELLS``): this row now serves 725..1023
    ("int4_w4a16", 256, 2048, 7168, 1024): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # deepseek-v3 µs: m128n256a 13895, scratch 15864, default 15864, bf16 7733; 1.80x bf16
    ("int4_w4a16", 256, 2048, 7168, 4096): WoWinner("tile", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)),
    # deepseek-v3 µs: m64 5011, scratch 14931, default 4828, bf16 5219; 0.96x bf16. From M = 1024 the Gluon path
    # (sessions 38 / 39, ``triton_gluon_wo.GLUON_WO_CELLS``): this row serves 725..1023
    ("int8_w8a16", 256, 2048, 7168, 1024): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # deepseek-v3 µs: m128s4 10967, scratch 16757, default 16757, bf16 7733; 1.42x bf16
    ("int8_w8a16", 256, 2048, 7168, 4096): WoWinner("tile", tile(128, (64, 64, 8, 8, 4), (128, 64, 8, 8, 4), False)),
    # deepseek-v3 µs: m64 6257, scratch 13938, default 6256, bf16 5219; 1.20x bf16. Session 38 (below): the mma decode
    # in 32-row blocks (``triton_wo_configs.MMA_CONFIGS``) 5100.6 against m64 6209.0
    ("mxfp4", 256, 2048, 7168, 1024): WoWinner("mma"),
    # deepseek-v3 mxfp4 M=1448 (45 rows an expert; session 39, wo38_device_check.py at 22a0d8b, ONE H100, the H200's
    # tables under its name, PASS, 5/5 >= 3%): the m64 tile 6192.0 against the M=1024 row's mma decode in 32-row blocks
    # 6952.4 (the Gluon path 6768.1); serves 1218..2047, from 2048 the Gluon path (``GLUON_WO_CELLS``; the m64 tile
    # 9064.5 against the M=4096 row's m128n256 9858.6 there too, for devices without it)
    ("mxfp4", 256, 2048, 7168, 1448): WoWinner("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), False)),
    # deepseek-v3 µs: m128n256a 14594, scratch 15586, default 15586, bf16 7733; 1.89x bf16
    ("mxfp4", 256, 2048, 7168, 4096): WoWinner("tile", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)),
    # Session 38 (benchmarks/wo38_device_check.py at d4f6eeb4, ONE H100 80GB, torch 2.11, Triton 3.6; graph µs, median
    # of 5 settled rounds, every call PASS against the twin, the taken >= 3% faster than the pick in 5/5 rounds): at
    # DeepSeek-V3 M=512 (16 rows an expert) the M=1024 rows above ran 64-row tiles; the M=256 pick's mma decode in
    # 16-row blocks int4 3611.7 / mxfp4 3376.7 against m64 5974.2 / 6044.4 (32-row blocks 6616.4 / 3823.7); int8 the
    # 32-row tile heuristic's (no tile here: ``wo_heuristic_config`` of the call's bucket) 4257.9 against m64 5755.5
    # (GROUP_M 8 4229.0, the register decode 4288.5, mma 4438.6-4671.0). A row covers 256..1023 (nearest: 512..724);
    # at 256..511 the chooser's decode and bucket config are what they were (mma 16-row, tile 16-row)
    ("int4_w4a16", 256, 2048, 7168, 512): WoWinner("mma"),
    ("mxfp4", 256, 2048, 7168, 512): WoWinner("mma"),
    ("int8_w8a16", 256, 2048, 7168, 512): WoWinner("tile"),
    # mixtral-8x7b mxfp4 M=128 (32 rows an expert; session 38 as above): the mma decode in 32-row blocks
    # (``MMA_CONFIGS``) 744.7 against the m64 tile heuristic's 833.9 (the halves 765.7, the Gluon path 895.2); from
    # M=256 the Gluon path (``triton_gluon_wo.GLUON_WO_CELLS``)
    ("mxfp4", 8, 14336, 4096, 128): WoWinner("mma"),
}


def winner(scheme: str, num_experts: int, n: int, k: int, num_tokens: int,
           table: dict | None = None) -> WoWinner | None:
    """The row of ``table`` (default WO_WINNERS) covering this call, see the module docstring."""
    rows = WO_WINNERS if table is None else table
    m = winner_m(scheme, num_experts, n, k, num_tokens, rows)
    return None if m is None else rows[(scheme, num_experts, n, k, m)]


def winner_m(scheme: str, num_experts: int, n: int, k: int, num_tokens: int, table: dict | None = None) -> int | None:
    """The measured M of ``winner``'s row (None where no row covers the call)."""
    rows = WO_WINNERS if table is None else table
    target = math.log2(max(num_tokens, 1))
    covering = [m for (s, e, nn, kk, m) in rows
                if (s, e, nn, kk) == (scheme, num_experts, n, k) and m >= MIN_M and m / 2 <= num_tokens < 2 * m]
    return min(covering, key=lambda m: (abs(math.log2(m) - target), m)) if covering else None
