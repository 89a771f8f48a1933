"""What ``m1_device_check.py`` measures: its cells (dtype, preset, M) and each cell's variants.

"default" is the backend as users call it (``experts_triton``: bf16, fp8_block and int4_w4a16 weights alike), timed
twice ("default again": the rounds' noise). The other variants are the tuned config with the gate-up ("u ...") and /
or down ("d ...") GEMM's tile changed (n BLOCK_N, k BLOCK_K, s stages), through ``fused_experts``; "gate-up only"
rows are that config's gate-up launch alone (a prefix of the call: what the down GEMM and the k-sum add is the whole
call minus it; its output is h, not checked).

Run 1 (be148bc, raw/NVIDIA_H200-2026-12-03-be148bc-m1-ck1.*) measured the down GEMM + k-sum over a token's slots in
one launch (``_kernels/down_slots.py``, removed after: 1.27-1.8x slower at Qwen3 M = 1, 1.03-1.79x at DeepSeek-V3 and
Mixtral M = 1): per-step time, not bytes in flight, set the narrow tiles' rate, and the widest K step (BK 256) was
the best of every family, gate-up included. Run 2: BK 256 for both GEMMs of Qwen3's tiny-batch entry (M = 1-2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

Q3, DS3, MIX = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
# Qwen3 first (timing stops at the deadline), then the guards
CELLS = (("bf16", Q3, 1), ("bf16", Q3, 2), ("fp8", Q3, 1), ("int4", Q3, 1), ("bf16", DS3, 1), ("bf16", MIX, 1),
         ("bf16", Q3, 8), ("fp8", Q3, 8))
SMOKE_CELLS = (("bf16", Q3, 1), ("fp8", Q3, 1), ("int4", Q3, 1))
SCHEME = {"fp8": "fp8_block", "int4": "int4_w4a16"}


@dataclass(frozen=True)
class Variant:
    name: str
    up: tuple = ()  # (field, value) pairs replaced in the tuned gate-up tile
    down: tuple = ()  # the same for the down tile
    prefix: bool = False  # the config's gate-up launch alone
    again: bool = False  # the default, timed as a row of its own
    # the k-sum in the down GEMM's launch with kept counters passed in (as a caller capturing its own graph may):
    # "fold" (KSUM, the last slot's program sums) or "after" (SUM_AFTER, sum programs after the GEMM's); "" none
    ksum: str = ""

    @property
    def is_default(self) -> bool:
        return self.name == "default" or self.again

    @property
    def exact(self) -> bool:
        """Must equal the default bit for bit: tiles and stages of the same reduction order (BLOCK_K 256 sums the
        same products as two 128 steps: the MMA walks K in 16-wide pieces in order either way)."""
        return not self.prefix


def _tile(fields: dict) -> tuple:
    return tuple(fields.items())


def _v(up: dict | None = None, down: dict | None = None, prefix: bool = False) -> Variant:
    def part(tag, fields):
        return f"{tag} " + " ".join(f"{k.removeprefix('BLOCK_').removeprefix('num_')[0].lower()}{v}"
                                    for k, v in fields.items()) if fields else ""

    name = " + ".join(p for p in (part("u", up), part("d", down)) if p)
    return Variant(("gate-up only " + name).strip() if prefix else name, _tile(up or {}), _tile(down or {}), prefix)


K256_3, K256_4 = dict(BLOCK_K=256, num_stages=3), dict(BLOCK_K=256, num_stages=4)


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    ends = [Variant("default"), Variant("default again", again=True)]
    if dtype != "bf16" or preset != Q3 or m > 2:
        return ends  # figures of the other decode cells (their entries are not changed here)
    gate_ups = [_v(K256_3), _v(dict(BLOCK_N=32, **K256_4)), _v(dict(BLOCK_N=32, BLOCK_K=256, num_stages=5))]
    downs = [_v(down=K256_3), _v(down=K256_4), _v(down=dict(BLOCK_N=128, **K256_3)),
             _v(down=dict(BLOCK_N=32, BLOCK_K=256, num_stages=5))]
    both = [_v(K256_3, K256_3), _v(K256_3, K256_4), _v(dict(BLOCK_N=32, **K256_4), K256_4)]
    prefixes = [_v(prefix=True), _v(K256_3, prefix=True), _v(dict(BLOCK_N=32, **K256_4), prefix=True)]
    ksums = [Variant("k-sum fold (counters)", ksum="fold"), Variant("k-sum after (counters)", ksum="after")]
    return ends + gate_ups + downs + both + ksums + (prefixes if m == 1 else [])


def run(v: Variant, dtype: str, t, w, config=None, eager: bool = False) -> torch.Tensor:
    """One call of ``v`` on inputs ``t`` (x, topk_ids, topk_weights) and weights ``w`` (w13, w2; quantized for
    fp8 / int4). ``config``: the real shape's tuned config passed explicitly (compile workers on small-E weights).
    ``eager``: unused here (every variant is bf16)."""
    if v.is_default:
        if config is not None and dtype == "bf16":
            from moekit.experts.triton import fused_experts

            return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
        from moekit.experts.triton import experts_triton

        return experts_triton(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
    base = config or tuned_config(t, w)
    config = replace(base, up=replace(base.up, **dict(v.up)), down=replace(base.down, **dict(v.down)))
    if v.prefix:
        return gate_up_only(t, w, config)
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_launch import LaunchOptions

    if v.ksum:
        options = LaunchOptions(sum_fold_max=8 if v.ksum == "fold" else 0, sum_tail_max=64)
        return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config, options=options,
                             counters=kept_counters(t.x.device))
    return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)


_COUNTERS: dict = {}


def kept_counters(device) -> torch.Tensor:
    """int32 zeros, allocated once outside any capture (every call leaves them at 0)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1 << 14, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def tuned_config(t, w):
    """The tuned bf16 config of these weights' shape."""
    from moekit.experts.configs import device_key, get_config

    x, e, n, k, top_k = t.x, w[0].shape[0], w[1].shape[2], w[1].shape[1], t.topk_ids.shape[1]
    return get_config(x.shape[0], e, n, k, top_k, x.dtype, device_key(x.device))


def gate_up_only(t, w, config=None) -> torch.Tensor:
    """The plan's gate-up launch alone (tiny-batch shortcut, TMA weights): h [A, N]."""
    from moekit.experts import triton as tri
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_plan import plan_for

    ids, weights = t.topk_ids.contiguous(), t.topk_weights.contiguous()
    plan = plan_for(t.x, w[0], w[1], ids, weights, None, "silu", config, LaunchOptions())
    b = tri._WORKSPACES.buffers(plan.workspace, t.x.device)
    pair = tri._DESCRIPTORS.get(w[0], w[1], plan.descriptor_key)
    plan.gate_up(t.x, pair.w13, pair.w13_up, None, b["h"], ids, None, None, None, None)
    return b["h"]
