"""The weight-only decode and tile config measured fastest per (scheme, E, N, K, M) at mid and large
batches on the H200 (issue #16's M >= 1024 target), as data: ``benchmarks/wo_mid_device_check.py``
prints the rows of WO_WINNERS ready to paste; ``triton_wo_plan.choose_decode`` takes the decode and
``triton_wo_configs.wo_config`` the tile decode's config from here.

    winner(scheme, E, N, K, M) -> the row of the measured M nearest to M (log2 distance, ties: the
    smaller) among those within a factor 2 (m/2 <= M < 2m) and m >= MIN_M; None where no row covers M

A row: ``WoWinner(decode, tile)``; decode "tile" or "scratch" (or "register"), tile the fastest tile
decode config measured at that cell (a ``WoTileConfig``), or None for the usual
lookup. After a device run, the printed rows replace WO_WINNERS' (a data change; keep the run's name in
the comment above them). Shapes: E local experts, N intermediate, K hidden, M tokens.
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
    return WoTileConfig(block_m, GemmTile(*up), GemmTile(*down), ahead)


MIN_M = 1024  # the table's scope: rows of M >= MIN_M only (smaller ones are ignored), so calls below MIN_M / 2
# never take a row (``triton_wo.run_experts_wo`` skips the chooser's scratch test there)
# (scheme, E, N, K, M) -> WoWinner. H200, Triton 3.6, bf16 activations, µs (results/raw).
# Qwen3-30B-A3B int8 M=4096 (87d0e52-wo_large): fused tile 1084 µs (heuristic config), scratch 1215,
# bf16 733.
WO_WINNERS: dict[tuple[str, int, int, int, int], WoWinner] = {
    ("int8_w8a16", 128, 768, 2048, 4096): WoWinner("tile"),
}


def winner(scheme: str, num_experts: int, n: int, k: int, num_tokens: int,
           table: dict | None = None) -> WoWinner | None:
    """The row of ``table`` (default WO_WINNERS) covering this call, see the module docstring."""
    rows = WO_WINNERS if table is None else table
    target = math.log2(max(num_tokens, 1))
    covering = [m for (s, e, nn, kk, m) in rows
                if (s, e, nn, kk) == (scheme, num_experts, n, k) and m >= MIN_M and m / 2 <= num_tokens < 2 * m]
    if not covering:
        return None
    m = min(covering, key=lambda m: (abs(math.log2(m) - target), m))
    return rows[(scheme, num_experts, n, k, m)]
