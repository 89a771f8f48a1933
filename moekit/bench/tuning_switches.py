"""The switches of an fp8 tuned entry as candidates of ``moekit tune --dtype fp8_block`` (``tuning_quant.fp8_scheme``).

An fp8 entry may name, beside its tiles, the weight loads ("weight_tma"), gate and up in one dot a K-step
("pair_dot"), the persistent GEMMs ("persistent") and the swapped product ("swap_ab", a ``KernelConfig`` field);
``triton_fp8_plan.read_entries`` reads them. The packaged H200 entries of the mid batches (Qwen3-30B-A3B M = 8-1024)
carry them, set by hand from A/Bs; a tuner that timed the tiles alone could not reach them, and an entry it tuned
dropped them (session 51, issues 15 / 19). Here they are candidates like the tiles:

    Fp8Candidate: a KernelConfig with the switches; ``to_dict`` is the file's entry, switches and all
    switch_variants(M, shape, config) -> the same tiles with other switches, those the plan takes (timed together)
    current_fp8(M, shape, device) -> the entry the lookups take at M today, as a candidate (the search's seed)
    candidate_of(Fp8Entry, M, shape) -> an entry of a file as the candidate that runs it at M

Which combinations the plan takes is the plan's own answer: ``triton_fp8_plan.build_plan`` on meta tensors of the
shape (no memory, no kernel compiled): a ValueError (``choose_pair_dot``, ``choose_persistent``) leaves a combination
out, and so does weight_tma that the plan would not honour (no TMA descriptors: the same launches as without it).
``x_in_gate_up`` is not searched: it applies to eager calls only, and the tuner times CUDA-graph replay up to M = 1024.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch

from moekit.bench.cells import Shape
from moekit.bench.tuning import tiles_of
from moekit.experts.configs import KernelConfig
from moekit.experts.triton_fp8_persistent import Persistent
from moekit.experts.triton_fp8_plan import Fp8Entry, build_plan, fp8_entry
from moekit.experts.triton_launch import LaunchOptions
from moekit.quant.fp8_block import DEFAULT_BLOCK_SHAPE

# The persistent GEMMs searched (programs per SM of gate-up, of down): the packaged entries' two (Qwen3 512: both,
# 1024: down only) and gate-up alone; session 26 measured a down GEMM at one program an SM 1.12x slower.
PERSISTENT_CHOICES = (Persistent(1, 2), Persistent(0, 2), Persistent(1, 0))
SWAP_AB_MAX_BLOCK_M = 16  # swap_ab is searched at decode heights only (the MMA's N side the tile's rows)


@dataclass(frozen=True)
class Switches:
    """What ``fused_experts_fp8_launch`` takes beside the config: a plain config's are the defaults."""

    weight_tma: bool | None = None  # None: the plan's rule (``TMA_MAX_BLOCK_M``)
    pair_dot: bool = False
    persistent: Persistent | None = None  # None: one program a tile


@dataclass(frozen=True)
class Fp8Candidate(KernelConfig):
    """A tile config with an fp8 entry's switches; made by ``with_switches``, which gives a plain ``KernelConfig``
    where no switch is set (so one tile config is one candidate, not two)."""

    switches: Switches = Switches()

    def to_dict(self) -> dict:
        d, s = super().to_dict(), self.switches
        if s.weight_tma is not None:
            d["weight_tma"] = s.weight_tma
        if s.pair_dot:
            d["pair_dot"] = True
        if s.persistent is not None:
            d["persistent"] = {"up_per_sm": s.persistent.up_per_sm, "down_per_sm": s.persistent.down_per_sm}
        return d


def switches_of(config: KernelConfig) -> Switches:
    return config.switches if isinstance(config, Fp8Candidate) else Switches()


def with_switches(config: KernelConfig, switches: Switches) -> KernelConfig:
    """``config``'s tiles with ``switches``: an ``Fp8Candidate``, or the plain ``KernelConfig`` where none is set."""
    tiles = tiles_of(config)
    if switches == Switches():
        return tiles
    return Fp8Candidate(tiles.BLOCK_M, tiles.up, tiles.down, tiles.swap_ab, switches)


@functools.lru_cache(maxsize=64)
def _meta_call(num_tokens: int, shape: Shape) -> tuple:
    """Meta tensors of one call of ``shape`` at M = ``num_tokens`` (``build_plan``'s arguments): no memory."""
    meta, (gn, gk) = torch.device("meta"), DEFAULT_BLOCK_SHAPE
    e, n, k = shape.num_experts, shape.n, shape.k
    x = torch.empty(num_tokens, k, dtype=torch.bfloat16, device=meta)  # [M, K]
    w13 = torch.empty(e, 2 * n, k, dtype=torch.float8_e4m3fn, device=meta)  # [E, 2N, K]
    s13 = torch.empty(e, -(-2 * n // gn), -(-k // gk), device=meta)
    w2 = torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=meta)  # [E, K, N]
    s2 = torch.empty(e, -(-k // gn), -(-n // gk), device=meta)
    ids = torch.empty(num_tokens, shape.top_k, dtype=torch.int32, device=meta)  # [M, k]
    return x, w13, s13, w2, s2, ids


def _plan(num_tokens: int, shape: Shape, config: KernelConfig):
    """The fp8 plan of ``config`` with its switches asked for, on meta tensors of the call; None where it refuses."""
    x, w13, s13, w2, s2, ids = _meta_call(num_tokens, shape)
    s = switches_of(config)
    try:
        return build_plan(x, w13, s13, w2, s2, ids, None, DEFAULT_BLOCK_SHAPE, tiles_of(config), LaunchOptions(),
                          weight_tma=s.weight_tma, persistent=s.persistent, pair_dot=s.pair_dot)
    except ValueError:
        return None


def plan_takes(num_tokens: int, shape: Shape, config: KernelConfig) -> bool:
    """Whether the fp8 plan builds ``config`` with its switches as asked: no ValueError, and TMA descriptors where
    weight_tma is True (pointer loads where False)."""
    plan, weight_tma = _plan(num_tokens, shape, config), switches_of(config).weight_tma
    return plan is not None and (weight_tma is None or (plan.descriptor_key is not None) == weight_tma)


def switch_variants(num_tokens: int, shape: Shape, config: KernelConfig) -> list[KernelConfig]:
    """``config``'s tiles with every other combination of the switches that the plan takes: the weight loads (TMA
    where the plan's rule says pointers), pair_dot, swap_ab at decode heights, the persistent GEMMs
    (``PERSISTENT_CHOICES``). Timed in one stage, so their kernels compile together."""
    base = _plan(num_tokens, shape, tiles_of(config))
    loads = (None,) if base is None or base.descriptor_key is not None else (None, True)
    swaps = (False, True) if config.BLOCK_M <= SWAP_AB_MAX_BLOCK_M else (config.swap_ab,)
    out = []
    for tma, pair, swap, persistent in itertools.product(loads, (False, True), swaps, (None, *PERSISTENT_CHOICES)):
        variant = with_switches(replace(tiles_of(config), swap_ab=swap), Switches(tma, pair, persistent))
        if variant != config and variant not in out and plan_takes(num_tokens, shape, variant):
            out.append(variant)
    return out


def candidate_of(entry: Fp8Entry, num_tokens: int, shape: Shape) -> KernelConfig:
    """A tuned entry as the candidate that runs it at M, with the switches the plan honours there (as ``build_plan``
    reads an entry: a switch it cannot take at this M is left out; the eager-only "x_in_gate_up" too)."""
    persistent = entry.persistent if entry.persistent is not None and entry.persistent.on else None
    switches = Switches(entry.weight_tma if plan_takes(num_tokens, shape, with_switches(
        entry.config, Switches(entry.weight_tma))) else None)
    for extra in (dict(pair_dot=bool(entry.pair_dot)), dict(persistent=persistent)):
        wider = replace(switches, **extra)
        if plan_takes(num_tokens, shape, with_switches(entry.config, wider)):
            switches = wider
    return with_switches(entry.config, switches)


def current_fp8(num_tokens: int, shape: Shape, device: str) -> KernelConfig:
    """The entry the fp8 lookups take at M on ``device`` (a device key) today (``candidate_of``); the heuristic where
    no file serves the shape (then the same candidate as the default)."""
    entry = fp8_entry(num_tokens, shape.num_experts, shape.n, shape.k, shape.top_k, DEFAULT_BLOCK_SHAPE[1], device)
    return candidate_of(entry, num_tokens, shape)
