"""The variants ``mid_tile_device_check.py`` times at issue 19's mid cells, derived from each cell's tuned
default (so a retuned file moves the sweep with it).

Skipped on purpose (measured before, ``benchmarks/triton-notes.md``, raw ridge-checkpoint log): BLOCK_M 256
with 128-wide gate-up tiles (two [256, 128] fp32 accumulators spill: 1.8-2.2 ms at Mixtral 512/1024),
gate-up BLOCK_K 128 at 8 warps and 3 stages with 128-row tiles (1.3x slower), 4 warps at 128 x 128
gate-up tiles (the same two accumulators in half the threads), persistent and sorted-layout schedules.
Measured in this branch's first H200 run and removed (``benchmarks/triton-notes.md``): the gate-up split-K at
Qwen3 M = 1 and warp-specialised main loops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moekit.experts.configs import GemmTile, KernelConfig


@dataclass(frozen=True)
class Variant:
    name: str
    config: KernelConfig
    part: str  # "up" / "down": only that GEMM's tile changed (a combo candidate); "both" otherwise


def _up(cfg: KernelConfig, **kw) -> KernelConfig:
    return replace(cfg, up=replace(cfg.up, **kw))


def _down(cfg: KernelConfig, **kw) -> KernelConfig:
    return replace(cfg, down=replace(cfg.down, **kw))


def _one_field(cfg: KernelConfig, part: str, field: str, values) -> list[Variant]:
    """One field of one GEMM's tile changed to each of ``values`` (its current value skipped)."""
    tile = getattr(cfg, part)
    change = _up if part == "up" else _down
    return [Variant(f"{part}_{_SHORT[field]}{v}", change(cfg, **{field: v}), part)
            for v in values if getattr(tile, field) != v]


_SHORT = dict(BLOCK_N="bn", BLOCK_K="bk", num_warps="w", num_stages="s", GROUP_M="g")


def _mid(cfg: KernelConfig) -> list[Variant]:
    """Mixtral 512 / 1024, Qwen3 1024 (8 warps at 128-row tiles), in the order they run (a cell's budget
    may cut the last): other row heights (not measured in these forms), down widths, then GROUP_M and
    stages (the ridge run measured some of them; the tuned files may have moved since)."""
    out = []
    # 64-row blocks: less padding (an expert's last block), 8 warps split along N; gate-up 256 wide
    # ([64, 256] x 2 fp32 = 128 registers a thread), down 256 wide
    out.append(Variant("bm64_bn256", KernelConfig(64, GemmTile(256, 64, cfg.up.GROUP_M, 8, 4),
                                                  GemmTile(256, 64, cfg.down.GROUP_M, 8, 4)), "both"))
    # 256-row blocks: each weight tile read once per expert (Mixtral 1024: ~256 rows an expert), gate-up
    # 64 wide so its two accumulators fit ([256, 64] x 2 fp32 = 128 registers a thread)
    out.append(Variant("bm256_up64", KernelConfig(256, GemmTile(64, 64, cfg.up.GROUP_M, 8, 3),
                                                  GemmTile(128, 64, cfg.down.GROUP_M, 8, 3)), "both"))
    out.append(Variant("bm64_bn128_w4", KernelConfig(64, GemmTile(128, 64, cfg.up.GROUP_M, 4, 4),
                                                     GemmTile(128, 64, cfg.down.GROUP_M, 4, 4)), "both"))
    out.append(Variant("down_w4_bn128", _down(cfg, num_warps=4, BLOCK_N=128), "down"))
    out += _one_field(cfg, "down", "BLOCK_K", (128,))
    out += _one_field(cfg, "down", "BLOCK_N", (128, 256))
    out += _one_field(cfg, "up", "GROUP_M", (1, 8, 32))
    out += _one_field(cfg, "down", "GROUP_M", (1, 4))
    out += _one_field(cfg, "up", "num_stages", (3, 5))
    out += _one_field(cfg, "down", "num_stages", (3, 4, 5))
    return out


def _decode(cfg: KernelConfig) -> list[Variant]:
    """Qwen3 M = 1: widths (the wider sweep of the notes found the space flat; kept as the noise check)."""
    out = []
    out += _one_field(cfg, "up", "BLOCK_N", (32, 128))
    out += _one_field(cfg, "down", "BLOCK_N", (32, 128))
    out += _one_field(cfg, "down", "BLOCK_K", (256,))
    return out


def _smoke(cfg: KernelConfig) -> list[Variant]:
    """Interpreter-sized stand-ins of each kind above."""
    return [Variant("up_bn64", _up(cfg, BLOCK_N=64), "up"), Variant("down_g4", _down(cfg, GROUP_M=4), "down"),
            Variant("bm32", replace(cfg, BLOCK_M=32), "both")]


def variants_for(preset: str, m: int, cfg: KernelConfig, *, smoke: bool = False) -> list[Variant]:
    """The variants of one cell (its default not included)."""
    if smoke:
        return _smoke(cfg)
    return _decode(cfg) if m == 1 else _mid(cfg)


def combine(default: KernelConfig, up: dict, down: dict) -> KernelConfig:
    """``default`` with the gate-up tile of one variant's config and the down tile of another's (dicts
    as ``KernelConfig.to_dict`` writes them; both keep the default's BLOCK_M)."""
    return replace(default, up=GemmTile(**up["up"]), down=GemmTile(**down["down"]))
