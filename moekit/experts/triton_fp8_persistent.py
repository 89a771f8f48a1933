"""The persistent fp8 GEMM launches (``_kernels/gemm_fp8_persistent``) of an fp8 plan (``triton_fp8_plan``): a grid
of a few programs per SM that loop over the block-aligned layout's tiles, for the byte-bound cells 8 <= M <= 1024
(issue #15) where ``gemm_fp8``'s one-tile programs pay a fixed cost each (session 25's breakdown: the same tiles
stream at 92% of the copy rate on DeepSeek-V3's 1.8 MB programs, 58-79% on Qwen3's 96-512 KB ones).

Where the tuned file takes them (H200, Qwen3-30B-A3B fp8, CUDA-graph µs, persistent default / one program a tile,
5 of 5 rounds >= 3% faster, merged run raw/NVIDIA_H200-2026-12-04-b32c0fb-fp8mid-merged.*): M = 512 both GEMMs 201.3
/ 211.6; M = 1024 the down GEMM 242.9 / 251.1 (both: 251.5); M = 2048 (entry 1024) 384.0 / 397.7. Not taken: the
16-row tiles of M <= 256 (gate-up persistent 1.09-1.32x slower: their one-tile programs run two an SM, balanced by
the hardware; down 1.00-1.01x), DeepSeek-V3 (1.02-1.03x slower: 56 K-steps a tile already stream at ~100% of copy),
the loops not flattened (1.02-1.04x slower than flattened), a down GEMM at one program an SM (1.12x) or on 8 warps
(1.21x); 3 down stages within 0.5%. ``benchmarks/triton-notes.md`` ("persistent fp8 GEMMs") has the tables.

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, G the scale group (BLOCK_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts.configs import KernelConfig
from moekit.experts.triton_launch import cdiv, kernels
from moekit.triton_bind import BoundLaunch

INTERPRETER_SMS = 2  # "SMs" under the CPU interpreter: few programs, so each loops over several tiles


@dataclass(frozen=True)
class Persistent:
    """Programs per SM of the persistent gate-up and down GEMMs (0: that GEMM keeps one program a tile; both 0:
    ``OFF``). A tuned fp8 entry names it as "persistent": {"up_per_sm": .., "down_per_sm": ..} (``from_dict``)."""

    up_per_sm: int = 1
    down_per_sm: int = 2

    def __post_init__(self):
        for name in ("up_per_sm", "down_per_sm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 8:
                raise ValueError(f"Persistent.{name} must be an int in [0, 8] (programs per SM), got {value!r}")

    @property
    def on(self) -> bool:
        return bool(self.up_per_sm or self.down_per_sm)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Persistent":
        if not isinstance(d, dict) or set(d) - {"up_per_sm", "down_per_sm"}:
            raise ValueError(f"{where}: 'persistent' must be an object with up_per_sm, down_per_sm; got {d!r}")
        return cls(**d)


OFF = Persistent(0, 0)  # one program a tile, both GEMMs (an A/B's explicit "no", whatever the tuned entry says)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_persistent(asked: Persistent | None, from_entry: Persistent | None, folded_or_naive: bool, h_fp32: bool,
                      x_raw: bool, swap_ab: bool, plain: bool = True,
                      interleaved_pointers: bool = False) -> Persistent | None:
    """The persistent GEMMs a plan runs (None: one program a tile): the caller's (``asked``; refused by name where
    the plan cannot take them), else the tuned entry's where it can and the call is ``plain`` (no expert biases, the
    plain SiLU: ``triton_fp8_variant.Fp8Variant``; a variant call takes them only where asked, session 41: measured
    on no device yet). They need the block-aligned layout with its own launch, whole scale groups per gate-up tile, x
    quantized by its own kernel, no SWAP_AB, and interleaved gate/up rows through TMA (not ``interleaved_pointers``)."""
    refused = ("the alignment folded into gate-up or the tiny-batch shortcut (no layout launch)" if folded_or_naive
               else "a gate-up tile narrower than a scale group (h float32)" if h_fp32
               else "x quantized inside gate-up" if x_raw else "swap_ab" if swap_ab
               else "interleaved gate/up rows on pointer loads" if interleaved_pointers else None)
    if asked is not None and asked.on and refused:
        raise ValueError(f"persistent fp8 GEMMs do not take {refused}")
    chosen = asked if asked is not None else None if refused or not plain else from_entry
    return chosen if chosen is not None and chosen.on else None


def gate_up_persistent_launch(w13_q, w13_scale, num_assignments: int, top_k: int, config: KernelConfig,
                              num_pid_m: int, shared: dict, programs_per_sm: int, device) -> BoundLaunch:
    """Pointers as ``triton_fp8_plan``'s gate-up launch: x_q, x_s, w13 (or its descriptor), w13_scale, h_q, h_s,
    ids (unread), sorted_ids, expert_ids, num_padded, expert_map (unread), b13 (None)."""
    (_, _, hidden), n, up = w13_q.shape, w13_q.shape[1] // 2, config.up
    grid = min(num_pid_m * cdiv(n, up.BLOCK_N), programs_per_sm * sm_count(device))
    return BoundLaunch(
        kernels("gemm_fp8_persistent").gate_up_fp8_persistent_kernel, (grid,), 12,
        (n, hidden, num_assignments, top_k, hidden, cdiv(hidden, up.BLOCK_K), *w13_q.stride(), *w13_scale.stride(),
         n, cdiv(n, up.BLOCK_K)),
        BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, GROUP_M=up.GROUP_M, num_warps=up.num_warps,
        num_stages=up.num_stages, **shared)


def down_persistent_launch(w2_q, w2_scale, num_assignments: int, config: KernelConfig, num_pid_m: int,
                           shared: dict, programs_per_sm: int, device) -> BoundLaunch:
    """Pointers as ``triton_fp8_plan``'s down launch: h_q, h_s, w2 (or its descriptor), w2_scale, y, weights,
    ids (unread), sorted_ids, expert_ids, num_padded, then three unread Nones, b2 (None)."""
    (_, hidden, n), down = w2_q.shape, config.down
    grid = min(num_pid_m * cdiv(hidden, down.BLOCK_N), programs_per_sm * sm_count(device))
    return BoundLaunch(
        kernels("gemm_fp8_persistent").down_fp8_persistent_kernel, (grid,), 14,
        (hidden, n, num_assignments, n, cdiv(n, down.BLOCK_K), *w2_q.stride(), *w2_scale.stride(), hidden),
        BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, GROUP_M=down.GROUP_M, num_warps=down.num_warps,
        num_stages=down.num_stages, **shared)


def persistent_constexprs(shared: dict, gate_up: bool) -> dict:
    """The plan's shared constexprs and options, less what the persistent kernels do not take."""
    drop = {"NAIVE", "H_FP32", "AHEAD", "X_RAW", "SWAP_AB"} | ({"EMULATE"} if not gate_up else set())
    return {k: v for k, v in shared.items() if k not in drop}


def persistent_gemms(persistent: Persistent, launches: tuple, w13_q, w13_scale, w2_q, w2_scale, num_assignments: int,
                     top_k: int, config: KernelConfig, num_pid_m: int, up_shared: dict, down_shared: dict,
                     device) -> tuple:
    """The plan's (gate_up, down, down_sum) launches with the GEMMs ``persistent`` names replaced by persistent
    ones; a persistent down GEMM has no k-sum in it (down_sum None: the k-sum in a launch of its own)."""
    gate_up, down, down_sum = launches
    if persistent.up_per_sm:
        gate_up = gate_up_persistent_launch(w13_q, w13_scale, num_assignments, top_k, config, num_pid_m,
                                            persistent_constexprs(up_shared, True),
                                            persistent.up_per_sm, device)
    if persistent.down_per_sm:
        down = down_persistent_launch(w2_q, w2_scale, num_assignments, config, num_pid_m,
                                      persistent_constexprs(down_shared, False),
                                      persistent.down_per_sm, device)
        down_sum = None
    return gate_up, down, down_sum
