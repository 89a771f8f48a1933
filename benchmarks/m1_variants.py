"""What ``m1_device_check.py`` measures: its cells (dtype, preset, M) and each cell's variants.

"default" is the backend as users call it (``experts_triton``: bf16, fp8_block and int4_w4a16 weights alike);
"slots ..." is the tuned config with ``KernelConfig.down_slots`` set to that tile (gate-up, then
``_kernels/down_slots.py``: the down GEMM and the k-sum in one launch, each program walking its token's slots);
"separate" the tuned config with it None (gate-up, down, k-sum); "gate-up only" is the default's gate-up launch alone
(a prefix: what the down GEMM and the k-sum add is the default minus it; its output is h, not checked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.experts.configs import GemmTile

Q3, DS3, MIX = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
# Qwen3 first (timing stops at the deadline), then the guards
CELLS = (("bf16", Q3, 1), ("bf16", Q3, 2), ("fp8", Q3, 1), ("int4", Q3, 1), ("bf16", DS3, 1), ("bf16", MIX, 1),
         ("bf16", Q3, 8), ("fp8", Q3, 8))
SMOKE_CELLS = (("bf16", Q3, 1), ("fp8", Q3, 1), ("int4", Q3, 1))
SCHEME = {"fp8": "fp8_block", "int4": "int4_w4a16"}


@dataclass(frozen=True)
class Variant:
    name: str
    tile: GemmTile | None = None  # KernelConfig.down_slots of the tuned config set to this (with ``slots``)
    slots: bool = False  # the tuned config with down_slots = tile (None: the separate down GEMM and k-sum)
    prefix: bool = False  # the default's gate-up launch alone
    up: tuple = ()  # (field, value) pairs replaced in the tuned gate-up tile

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    @property
    def exact(self) -> bool:
        """Must equal the default bit for bit: the same products summed in the same order (the slot sum of
        ``down_slots`` is the ordered k-sum's)."""
        return self.slots


def _slots(n: int, k: int = 128, w: int = 4, s: int = 8) -> Variant:
    return Variant(f"slots n{n} k{k} w{w} s{s}", GemmTile(n, k, num_warps=w, num_stages=s), slots=True)


SEPARATE = Variant("separate", slots=True)


def _up(**fields) -> Variant:
    """The default's gate-up launch alone with its tuned tile changed: what the gate-up GEMM's tile does to it."""
    name = "gate-up only " + " ".join(f"{k.removeprefix('BLOCK_').removeprefix('num_').lower()}={v}"
                                      for k, v in fields.items())
    return Variant(name, prefix=True, up=tuple(fields.items()))


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    ends = [Variant("default")]
    if dtype == "int4" or m * {Q3: 8, DS3: 8, MIX: 2}[preset] * 4 > {Q3: 128, DS3: 256, MIX: 8}[preset]:
        return ends  # the tiny-batch shortcut only (A*4 <= E), bf16 and fp8_block
    if dtype == "fp8":  # Qwen3 M = 1 (tuned: gate-up 64 wide, so h float32 quantized in down; down BK 128 = group)
        return ends + [SEPARATE, _slots(16), _slots(16, s=12), _slots(16, s=16), _slots(32), _slots(32, s=12),
                       replace(_slots(16, s=16), name="slots n16 s16 + up n128 (h_q)", up=(("BLOCK_N", 128),))]
    if preset == Q3 and m == 1:  # K = 2048: 128 programs at 16 columns, 64 at 32; stages: the bytes in flight
        return ends + [SEPARATE, Variant("gate-up only", prefix=True), _slots(16), _slots(16, s=12),
                       _slots(16, s=16), _slots(16, 256, s=6), _slots(16, 256, s=10), _slots(16, w=2), _slots(32),
                       _slots(32, 256, s=5), _slots(64, s=4),
                       _up(BLOCK_N=32), _up(BLOCK_N=32, num_stages=8), _up(BLOCK_N=16, num_stages=8),
                       _up(num_stages=6), _up(BLOCK_N=128, num_stages=3), _up(num_warps=8),
                       _up(BLOCK_K=256, num_stages=3), replace(_slots(16), name="slots n16 + up n32 s6",
                                                               up=(("BLOCK_N", 32), ("num_stages", 6)))]
    if preset == Q3:  # M = 2
        return ends + [SEPARATE, _slots(16), _slots(16, 256, s=6), _slots(32)]
    if preset == DS3:  # K = 7168, N = 2048: 448 / 224 / 112 programs
        return ends + [Variant("gate-up only", prefix=True), _slots(16), _slots(32, s=6), _slots(64, s=4)]
    return ends + [Variant("gate-up only", prefix=True), _slots(16), _slots(32, s=6), _slots(64, s=4)]  # Mixtral


def run(v: Variant, dtype: str, t, w, config=None, eager: bool = False) -> torch.Tensor:
    """One call of ``v`` on inputs ``t`` (x, topk_ids, topk_weights) and weights ``w`` (w13, w2; quantized for
    fp8 / int4). ``config``: the real shape's tuned config passed explicitly (compile workers on small-E weights).
    ``eager``: an fp8 variant quantizes x where the tuned entry says for eager calls (the default's rule; under a
    graph capture x is quantized in its own kernel either way)."""
    if v.is_default:
        if config is not None and dtype == "bf16":
            from moekit.experts.triton import fused_experts

            return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
        from moekit.experts.triton import experts_triton

        return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
    entry = tuned_entry(dtype, t, w)
    config = replace(config or entry.config, up=replace((config or entry.config).up, **dict(v.up)))
    if v.slots:
        config = replace(config, down_slots=v.tile)
    if v.prefix:
        return gate_up_only(t, w, config)
    if dtype == "fp8":
        from moekit.experts.triton_fp8 import fused_experts_fp8_launch

        return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                        config=config, x_in_gate_up=entry.x_in_gate_up if eager else None)
    from moekit.experts.triton import fused_experts

    return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)


def tuned_entry(dtype: str, t, w):
    """The tuned entry of these weights' shape (``Fp8Entry``-like: .config, .x_in_gate_up)."""
    from moekit.experts.configs import device_key, get_config
    from moekit.experts.triton_fp8_plan import Fp8Entry, fp8_entry

    x, e, n, k, top_k = t.x, w[0].shape[0], w[1].shape[2], w[1].shape[1], t.topk_ids.shape[1]
    if dtype == "fp8":
        return fp8_entry(x.shape[0], e, n, k, top_k, 128, device_key(x.device))
    return Fp8Entry(get_config(x.shape[0], e, n, k, top_k, x.dtype, device_key(x.device)))


def gate_up_only(t, w, config=None) -> torch.Tensor:
    """The default plan's gate-up launch alone (tiny-batch shortcut, TMA weights): h [A, N]."""
    from moekit.experts import triton as tri
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_plan import plan_for

    ids, weights = t.topk_ids.contiguous(), t.topk_weights.contiguous()
    plan = plan_for(t.x, w[0], w[1], ids, weights, None, "silu", config, LaunchOptions())
    b = tri._WORKSPACES.buffers(plan.workspace, t.x.device)
    pair = tri._DESCRIPTORS.get(w[0], w[1], plan.descriptor_key)
    plan.gate_up(t.x, pair.w13, pair.w13_up, None, b["h"], ids, None, None, None, None)
    return b["h"]
