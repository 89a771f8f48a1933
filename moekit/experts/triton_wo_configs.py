"""Launch configurations of the weight-only fused decodes (``triton_wo_plan``): the heuristic defaults,
the tuned-file lookup, the measured winners (``triton_wo_winners``) and the shared-memory fit.

    wo_config(call) -> the mma decode's measured config (``MMA_CONFIGS``), else the entry of the nearest M among the
    device's tuned files' and the winners table's covering row (tile decode, measured cells), else for the word
    decodes their heuristic tiles with the measured splits (``triton_wo_word_winners``), else ``wo_heuristic_config``

``triton_wo_winners.WoTileConfig``: a ``KernelConfig`` of the tile decode with ``ahead`` (``ahead_of``).

Shapes: M tokens, k slots, E local experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import replace

from moekit.experts.configs import GemmTile, KernelConfig, load_configs, nearest
from moekit.experts.triton_wo_gemv import WordConfig, gemv_heuristic_config
from moekit.experts.triton_wo_mma import mma_split
from moekit.experts.triton_wo_winners import WoTileConfig, winner, winner_m
from moekit.experts.triton_wo_word_winners import word_config

MIN_PACKED_K = 32  # packed schemes: a step reads >= 16 bytes of each weight row
MIN_PROGRAMS = 256  # decode: about two programs per SM of an H200 (132 SMs), as the bf16 heuristic
# (scheme, E, N, K) -> {M: the gate-up's tile} where the mma decode's gate-up with its gate rows and up rows in
# separate programs (``WordConfig.halves``: 122 registers, 16 one-warp programs an SM against the two-sided tile's 168
# and 12, offline sm_90, Triton 3.6; the split_glu launch activates its float32 halves) measured faster than the
# two-sided gate-up; a call on the mma decode takes the row of such an M within a factor 2 (nearest in log2). H200,
# session 29 (benchmarks/dec9_device_check.py, graph µs, 5 interleaved rounds): DeepSeek-V3 int4 M=64 32 x 128 in 1
# warp 2214.7 against 2300.3 (CK1 at 99118a9, 5/5 rounds <= 0.968x); CK1b (fdff4b0) against the two-sided "k128":
# M=32 / 64 / 128 1615.7 / 2172.2 / 2504.5 against 1695.6 / 2272.8 / 2630.0 (every round >= 3.6%). Mixtral int4 M=8
# 64 x 128 in 2 warps 319.2 against 334.2 (CK1b, 5/5 rounds <= 0.960x; 32 x 128 in 1 warp 334.9 against 339.9 at CK1,
# not a win). Not taken: Qwen3 int4 M=64 165.1 against 160.4; 4 stages (1.03-1.10x); 256-column steps (1.5-2.0x).
MMA_HALVES: dict[tuple[str, int, int, int], dict[int, GemmTile]] = {
    ("int4_w4a16", 256, 2048, 7168): {64: GemmTile(32, 128, 1, 1, 3)},
    ("int4_w4a16", 8, 14336, 4096): {8: GemmTile(64, 128, 1, 2, 3)},
}

_T128, _T256 = GemmTile(32, 128, 1, 1, 3), GemmTile(32, 256, 1, 1, 3)  # 32 weight rows a program, 1 warp, 3 stages
# (scheme, E, N, K, M) -> the mma decode's config measured fastest there, ahead of the tuned files and the heuristic,
# for calls of M / 2 .. 2M in M's tile-height bucket (``height_bucket``). H200, Triton 3.6, session 32
# (benchmarks/wo32_device_check.py CK1 at 6f48529, graph µs, 5 rounds, each >= 3% faster than the route in 5/5,
# PASS): Mixtral int8 M = 1 the 128-column steps with the down GEMM split in 4 (2 experts x 128 one-warp programs
# unsplit: 2 an SM) 98.8 against the 256-column unsplit route's 122.1 (85% of the packed floor against 68%; the split
# alone 109.9, the 128-byte read at those splits 94.8); Mixtral mxfp4 M = 64 32-row blocks (one an expert against
# ~1.45 of 16 rows) with the halves at 128 columns 498.2 against the 16-row 256-column route's 528.0
# Session 38 (benchmarks/wo38_device_check.py at d4f6eeb4, ONE H100 80GB, Triton 3.6, 5 settled rounds, PASS, 5/5 >= 3%
# against the pick; the decode taken by ``triton_wo_winners.WO_WINNERS``): 32-row blocks, two-sided gate-up, at
# Mixtral mxfp4 M = 128 744.7 against the m64 tile's 833.9 (16-row blocks 829.3, the halves 765.7), DeepSeek-V3 mxfp4
# M = 1024 5100.6 against m64 6209.0 (16-row blocks 5452.4, the halves 5344.5). Session 39 (the same check at 38ead07c,
# ONE H100, as above): Qwen3 mxfp4 M = 512 328.3 against the m64 tile's 371.1 (16-row blocks 339.8, the halves 352.8)
MMA_CONFIGS: dict[tuple[str, int, int, int, int], KernelConfig] = {
    ("int8_w8a16", 8, 14336, 4096, 1): WordConfig(16, _T128, _T128, down_split=4),
    ("mxfp4", 8, 14336, 4096, 64): WordConfig(32, _T128, _T128, halves=True),
    ("mxfp4", 8, 14336, 4096, 128): KernelConfig(32, _T128, _T128),
    ("mxfp4", 256, 2048, 7168, 1024): KernelConfig(32, _T128, _T128),
    ("mxfp4", 128, 768, 2048, 512): KernelConfig(32, _T128, _T128),
}


def ahead_of(config: KernelConfig) -> bool:
    """The AHEAD switch ``config`` launches the tile decode with (off for a plain ``KernelConfig``)."""
    return isinstance(config, WoTileConfig) and config.ahead


def height_bucket(num_tokens: int, num_experts: int, top_k: int) -> int:
    """The heuristics' tile height: 16, 32, 64, then 128 from 64 mean rows per expert (M*k/E), as the
    bf16 heuristic (``configs.heuristic_config``)."""
    rows_per_expert = num_tokens * top_k / num_experts
    return next((b for b in (16, 32, 64) if rows_per_expert < b), 128)


def config_name(scheme: str, decode: str) -> str:
    """The dtype part of the config file names of ``scheme``'s kernels with ``decode``."""
    return scheme if decode == "tile" else f"{scheme}_{decode}"


def wo_heuristic_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str,
                        decode: str = "tile") -> KernelConfig:
    """The default without a tuned file (``moekit tune --dtype SCHEME`` tunes on the device and writes the
    files, ``benchmarks/wo_device_check.py`` times this); ``decode`` "register": ``_register_heuristic``.
    The tile height is ``height_bucket`` (128 from 64 rows per expert, where the GEMMs are
    compute-bound and tall tiles reuse each dequantized weight tile 128 times). Decode sizes: reduction
    steps of 128 weights (64 packed bytes a row), 4 stages in flight, and output tiles as wide as still
    give each GEMM >= MIN_PROGRAMS programs over the touched experts (so every SM streams weights);
    packed tiles stay <= 64 wide so that the dequantized [BN, 128] tile (float32 on its way to bf16)
    fits in registers next to the gate and up accumulators (ptxas for sm_90, Triton 3.6: decode gate-up
    128-168 registers, no spills)."""
    if decode == "register":
        return _register_heuristic(num_tokens, num_experts, n, k, top_k, scheme)
    if decode == "gemv":
        return gemv_heuristic_config(num_tokens, num_experts, n, k, top_k, scheme)
    if decode == "mma":
        return _mma_heuristic(num_tokens, num_experts, n, k, top_k, scheme)
    widest = 128 if scheme == "int8_w8a16" else 64
    bucket = height_bucket(num_tokens, num_experts, top_k)
    if bucket == 16:
        blocks = max(1, min(num_experts, num_tokens * top_k))  # ~ one block per touched expert
        up = GemmTile(_decode_width(blocks, n, widest=64), 128, 1, 4, 4)  # gate and up: two weight tiles
        return KernelConfig(16, up, GemmTile(_decode_width(blocks, k, widest=widest), 128, 1, 4, 4))
    if bucket == 32:
        return KernelConfig(32, GemmTile(64, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 3))
    if bucket == 64:
        return KernelConfig(64, GemmTile(64, 64, 1, 4, 4), GemmTile(64, 64, 1, 4, 4))
    return KernelConfig(128, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))  # gate-up 128 wide: spills


def _register_heuristic(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str) -> KernelConfig:
    """The register decode's default (branch wo-fast-2 as measured). Decode sizes: the gate-up tiles as
    wide (64, else 32) as still give >= MIN_PROGRAMS programs; the packed down tiles 128 wide always
    (the group scale on each chunk's partial product is per output column: narrow tiles pay it on fewer
    weights; sm_90 SASS 3.4 instructions a weight at 128 wide, 11 at 32 with mxfp4) and
    ``decode_split_k`` splits the reduction for the programs instead. Taller tiles: the packed gate-up
    32 wide and down <= 64 (ptxas sm_90: int4 spills 900 bytes a thread at 64 x 64); int8 as the tile
    decode's. int4 at decode heights swaps the operands (``swap_ab``: the weight tile the MMA's M side, wgmma):
    H200 graph µs (session 24, ``benchmarks/wo_tc_device_check.py`` at 0bdc803) Mixtral-8x7B M = 8 420.4
    against 482.4 unswapped (5/5 rounds >= 3%), DeepSeek-V3 M = 8 857.1 against 943.1; mxfp4 lost swapped
    (DeepSeek-V3 M = 1 257.4 against 208.6, M = 8 1492.5 against 1186.4)."""
    packed, bucket = scheme != "int8_w8a16", height_bucket(num_tokens, num_experts, top_k)
    if bucket == 16:
        blocks = max(1, min(num_experts, num_tokens * top_k))  # ~ one block per touched expert
        up = GemmTile(_decode_width(blocks, n, widest=64), 128, 1, 4, 4)
        down_width = 128 if packed else _decode_width(blocks, k, widest=128)
        return KernelConfig(16, up, GemmTile(down_width, 128, 1, 4, 4), swap_ab=scheme == "int4_w4a16")
    up_width = 32 if packed else 64  # packed: the chunks' partial products take registers
    if bucket == 32:
        return KernelConfig(32, GemmTile(up_width, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 3))
    if bucket == 64:
        return KernelConfig(64, GemmTile(up_width, 64, 1, 4, 4), GemmTile(64, 64, 1, 4, 4))
    return KernelConfig(128, GemmTile(up_width, 64, 8, 8, 3), GemmTile(64 if packed else 128, 64, 8, 8, 3))


def _mma_heuristic(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str) -> KernelConfig:
    """The mma decode's default: 16-row blocks, steps of 128 columns, 32 weight rows a program in 1 warp (gate and up:
    64), 3 stages, both GEMMs: many small programs an SM to hide the loads' and the dots' latency (sm_90 SASS,
    ``benchmarks/wo_mma_sass_cpu.py``, int4: gate-up 2.50 instructions a weight, ~205 registers, 9 programs an SM;
    down 2.97, 138 registers, 14 programs an SM; 64 x 128 in 2 warps 2.53 / 3.03 at 4 / 7 programs an SM). The gate
    and up rows in separate programs (``WordConfig.halves``) where MMA_HALVES measured them faster."""
    tile = GemmTile(32, 128, 1, 1, 3)
    rows = {m: up for m, up in MMA_HALVES.get((scheme, num_experts, n, k), {}).items() if m / 2 <= num_tokens <= 2 * m}
    if rows:
        return WordConfig(16, rows[nearest({m: m for m in rows}, num_tokens)], tile, halves=True)
    return KernelConfig(16, tile, tile)


def _decode_width(blocks: int, cols: int, widest: int) -> int:
    """The widest BLOCK_N up to ``widest`` (128, 64, 32) that makes blocks x cols / BLOCK_N >= MIN_PROGRAMS,
    else 32."""
    return next((bn for bn in (128, 64) if bn <= widest and blocks * cols / bn >= MIN_PROGRAMS), 32)


def wo_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str, device: str,
              decode: str = "tile") -> KernelConfig:
    """For the mma decode the ``MMA_CONFIGS`` row covering the call (``mma_config``); else the entry of the nearest
    M among the tuned files' for (E, N, K, ``config_name(scheme, decode)``, device) (``moekit tune`` measured them on
    this device, or a sibling device's where it has none, ``configs.tuned_files``; overlaid per M, ``configs.overlay``)
    and, for the tile decode, the winners table's row covering the
    call (``triton_wo_winners``: one H200 run's; the files' own entry of its M over it), so a file tuned at a few M
    leaves the table's rows at the other M; else for the word decodes their heuristic tiles with the measured splits
    (``triton_wo_word_winners.word_config``); else ``wo_heuristic_config``."""
    measured = mma_config(num_tokens, num_experts, n, k, top_k, scheme) if decode == "mma" else None
    if measured is not None:
        return measured
    configs = load_configs(num_experts, n, k, config_name(scheme, decode), device) or {}  # the scheme as the dtype
    won_at = winner_m(scheme, num_experts, n, k, num_tokens) if decode == "tile" else None
    won = None if won_at is None else winner(scheme, num_experts, n, k, num_tokens)
    if won is not None and won.tile is not None:  # one more entry, under the tuned file's own entry of its M
        configs = {won_at: won.tile, **configs}
    if configs:  # the mma decode: a measured gate-up split on top (``triton_wo_mma.MMA_UP_SPLITS``)
        cfg = nearest(configs, num_tokens)
        return mma_split(cfg, scheme, num_experts, n, k, num_tokens) if decode == "mma" else cfg
    if decode == "gemv":  # the heuristic tiles with the measured splits (``triton_wo_word_winners``)
        return word_config(num_tokens, num_experts, n, k, top_k, scheme, decode)
    return wo_heuristic_config(num_tokens, num_experts, n, k, top_k, scheme, decode)


def mma_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str) -> KernelConfig | None:
    """The ``MMA_CONFIGS`` row covering the call (M / 2 <= num_tokens <= 2M, the same ``height_bucket``), or None."""
    bucket = height_bucket(num_tokens, num_experts, top_k)
    rows = [m for (s, e, nn, kk, m) in MMA_CONFIGS if (s, e, nn, kk) == (scheme, num_experts, n, k)
            and m / 2 <= num_tokens <= 2 * m and height_bucket(m, num_experts, top_k) == bucket]
    return MMA_CONFIGS[(scheme, num_experts, n, k, rows[0])] if rows else None


def wo_shared_memory_bytes(block_m: int, tile: GemmTile, scheme: str, itemsize: int, weight_tiles: int) -> int:
    """An estimate of one GEMM's shared memory: ``num_stages - 1`` buffered steps of the activation tile
    [BM, BK] and the packed weight tiles [BN, BK] (1 byte or half a byte a weight), plus one 16-bit copy
    of the dequantized tiles, which ``tl.dot`` reads from shared memory on Hopper."""
    weight_bytes = tile.BLOCK_K * tile.BLOCK_N * weight_tiles
    packed = weight_bytes if scheme == "int8_w8a16" else weight_bytes // 2
    return max(tile.num_stages - 1, 1) * (block_m * tile.BLOCK_K * itemsize + packed) + weight_bytes * itemsize


def fit_wo_shared_memory(config: KernelConfig, scheme: str, itemsize: int, limit_bytes: int) -> KernelConfig:
    """``config`` with each GEMM shrunk until the estimate fits ``limit_bytes``: fewer stages (to 2), then
    a halved BLOCK_K (to 32 packed, 16 int8). A config that fits comes back unchanged."""
    least_k = 16 if scheme == "int8_w8a16" else MIN_PACKED_K

    def fit(tile: GemmTile, weight_tiles: int) -> GemmTile:
        while wo_shared_memory_bytes(config.BLOCK_M, tile, scheme, itemsize, weight_tiles) > limit_bytes:
            if tile.num_stages > 2:
                tile = replace(tile, num_stages=tile.num_stages - 1)
            elif tile.BLOCK_K > least_k:
                tile = replace(tile, BLOCK_K=tile.BLOCK_K // 2)
            else:
                break  # the smallest tile we make; let Triton report what it needs
        return tile

    return replace(config, up=fit(config.up, 2), down=fit(config.down, 1))


