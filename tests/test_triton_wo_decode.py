"""The weight-only path's two decodes of packed weights and the choice between them, on the CPU under
Triton's interpreter: the register decode's bit placement for every byte, the chooser against the H200
measurements, the override, and where the inline PTX may run. (Both decodes' kernels against the twin
and a float64 loop: ``test_triton_wo.py``, every kernel test once per decode.)
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

triton = pytest.importorskip("triton")

from moekit.experts.configs import KernelConfig  # noqa: E402
from test_triton_wo import e2m1_value, problem, rel, wo  # noqa: E402, F401  (wo: fixture)

# H200 (Triton 3.6, bf16 activations, CUDA graph) µs per call of (tile, register), both decodes in one run:
# benchmarks/results/raw/NVIDIA_H200-2026-12-01-a13647b-wo_device_check-wo-choice.log (the earlier pair of
# logs, b6a5c5f and 87bfd3a, picked the same decode in each of these cells). int8 left out: both decodes
# run the same whole-tile dot there. (E, N, K, top_k) -> {(scheme, M): (tile, register)}
MEASURED = {
    (128, 768, 2048, 8): {("int4_w4a16", 1): (38.6, 32.4), ("int4_w4a16", 8): (154.5, 119.7),
                          ("int4_w4a16", 64): (346.2, 248.5), ("int4_w4a16", 1024): (577.1, 2739.2),
                          ("mxfp4", 1): (37.3, 36.9), ("mxfp4", 8): (134.5, 141.0), ("mxfp4", 64): (290.4, 280.9),
                          ("mxfp4", 1024): (647.3, 2508.1)},
    (256, 2048, 7168, 8): {("int4_w4a16", 1): (255.5, 145.6), ("int4_w4a16", 8): (1522.5, 958.0),
                           ("int4_w4a16", 64): (5119.7, 3391.0), ("int4_w4a16", 1024): (6111.7, 23526.2),
                           ("mxfp4", 1): (210.2, 214.5), ("mxfp4", 8): (1202.3, 1188.2),
                           ("mxfp4", 64): (4024.1, 3925.3), ("mxfp4", 1024): (6227.3, 16934.1)},
    (8, 14336, 4096, 2): {("int4_w4a16", 1): (248.4, 150.7), ("int4_w4a16", 8): (724.2, 483.6),
                          ("int4_w4a16", 64): (1023.4, 1695.1), ("int4_w4a16", 1024): (3405.0, 15651.3),
                          ("mxfp4", 1): (200.3, 193.9), ("mxfp4", 8): (586.5, 621.9), ("mxfp4", 64): (853.4, 1819.8),
                          ("mxfp4", 1024): (3719.0, 14614.3)},
}


# The gemv decode's µs where it beat both (session 9 checkpoint, benchmarks/wo_speed_device_check.py at
# 19af4d7; the same run's tile / register: DeepSeek M=1 253.7 / 143.1, M=8 1504.2 / 949.1, Mixtral M=1
# 243.8 / 148.8). It lost every other measured cell (mxfp4, int8, 2-row blocks).
# Qwen3 int4 (final run at 226019a, wo_speed_device_check; the same run's tile / register: M=1 39.2 / 32.9,
# M=8 153.1 / 118.3, the aligned layout there: 4A > E).
GEMV_MEASURED = {(256, 2048, 7168, 8): {("int4_w4a16", 1): 113.7, ("int4_w4a16", 8): 669.7},
                 (8, 14336, 4096, 2): {("int4_w4a16", 1): 129.8},
                 (128, 768, 2048, 8): {("int4_w4a16", 1): 31.6, ("int4_w4a16", 8): 88.1}}
# the packed-half word decode at its heuristic tile (branch wo-decode, b067aca; gemv 31.5 in the same run)
HALF_MEASURED = {(128, 768, 2048, 8): {("int4_w4a16", 1): 27.8},
                 (256, 2048, 7168, 8): {("mxfp4", 1): 184.2}}  # e68bcde: tile 211.4 in the same run
# the word decodes with split reductions (triton_wo_word_winners; benchmarks/wo_decode2_device_check.py at
# e320f4b): (scheme, M) -> (decode, µs); the same run's picks before: Qwen3 int4 M=1 gemv_half 29.9, M=8 gemv
# 88.2, mxfp4 M=1 register 36.4; DeepSeek-V3 int4 M=1 gemv 134.9, mxfp4 M=1 gemv_half 184.4, M=8 register
# 1196.1; Mixtral int4 M=1 gemv 130.3
SPLIT_MEASURED = {(128, 768, 2048, 8): {("int4_w4a16", 1): ("gemv", 22.5), ("int4_w4a16", 8): ("gemv", 81.2),
                                        ("mxfp4", 1): ("gemv_half", 30.7)},
                  (256, 2048, 7168, 8): {("int4_w4a16", 1): ("gemv", 99.7), ("mxfp4", 1): ("gemv", 160.8),
                                         ("mxfp4", 8): ("gemv", 1100.0)},  # run 2 (34d17b2): unsplit; register 1193
                  (8, 14336, 4096, 2): {("int4_w4a16", 1): ("gemv", 99.3)}}  # run 2: down split 8; old 129.8
# the gemv with the x tile (session 21, benchmarks/wo_ahead_device_check.py run 2 at 470c186; gemv_half 28.8 there)
XTILE_MEASURED = {(128, 768, 2048, 8): {("mxfp4", 1): ("gemv", 25.9)}}
# the word MMA decode (session 26, benchmarks/wo_mma_device_check.py at 8bac90b, graph µs; the same run's pick, the
# swapped register decode, 422.3; it lost every other cell of that run: DeepSeek-V3 / Qwen3 int4 M=1, 8, mxfp4 M=1, 8;
# on merged main b32c0fb: int4 M=64 against register 2742.0 / 196.7, mxfp4 Mixtral M=8 against tile 589.6)
# session 29 (benchmarks/mx9_device_check.py CK1 / CK1b, mxfp4 with the multiply placement; the same runs' picks:
# Mixtral M=1 register 190.4, M=8 mma 558.1, M=64 tile 856.5, DeepSeek-V3 M=1 gemv 144.0, M=8 gemv 1010.4, M=64
# register 3936.8); session 38 (benchmarks/wo38_device_check.py at d4f6eeb4, ONE H100, graph µs; the same run's picks:
# Qwen3 mxfp4 M=8 tile 130.5, M=64 register 278.6)
MMA_MEASURED = {(8, 14336, 4096, 2): {("int4_w4a16", 8): ("mma", 343.0), ("mxfp4", 8): ("mma", 336.4),
                                      ("mxfp4", 1): ("mma", 168.1), ("mxfp4", 64): ("mma", 763.1)},
                (256, 2048, 7168, 8): {("int4_w4a16", 64): ("mma", 2309.5),  # merged main b32c0fb
                                       ("mxfp4", 1): ("mma", 104.1), ("mxfp4", 8): ("mma", 866.5),
                                       ("mxfp4", 64): ("mma", 3156.3)},
                (128, 768, 2048, 8): {("int4_w4a16", 64): ("mma", 162.5), ("mxfp4", 8): ("mma", 96.7),
                                      ("mxfp4", 64): ("mma", 170.7)}}


_KERNELS = {}  # the interpreted gemm_wo_reg module, for decode_kernel (a Triton kernel reads module globals only)


@triton.jit
def decode_kernel(raw_ptr, low_ptr, high_ptr, SCHEME: triton.language.constexpr, DTYPE: triton.language.constexpr):
    i = triton.language.arange(0, 16)[:, None] * 16 + triton.language.arange(0, 16)[None, :]  # [16, 16]: byte i
    low, high = _KERNELS["gemm_wo_reg"]._decode(triton.language.load(raw_ptr + i), DTYPE, SCHEME, False)
    triton.language.store(low_ptr + i, low.to(triton.language.float32))
    triton.language.store(high_ptr + i, high.to(triton.language.float32))


@pytest.mark.parametrize("scheme", ["int4_w4a16", "mxfp4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_register_decode_every_byte(wo, scheme, dtype):
    # each of the 256 bytes -> the exact values of its low and high nibble in the activations' dtype
    # (int4: base + code, base 1024 in fp16 else 128; mxfp4: the e2m1 value, the sign kept on 0)
    # as the fixture decorated it
    _KERNELS["gemm_wo_reg"] = importlib.import_module("moekit.experts._kernels.gemm_wo_reg")
    raw = torch.arange(256, dtype=torch.uint8)
    low, high = torch.empty(256), torch.empty(256)
    decode_kernel[(1,)](raw, low, high, 1 if scheme == "int4_w4a16" else 2, getattr(triton.language, dtype))
    if scheme == "int4_w4a16":
        base = 1024.0 if dtype == "float16" else 128.0
        expected = [(base + (b & 15), base + (b >> 4)) for b in range(256)]
    else:
        expected = [(e2m1_value(b & 15), e2m1_value(b >> 4)) for b in range(256)]
    assert torch.equal(low, torch.tensor([e[0] for e in expected]))
    assert torch.equal(high, torch.tensor([e[1] for e in expected]))
    signs = torch.tensor([bool(b & 8) for b in range(256)])
    assert scheme == "int4_w4a16" or torch.equal(torch.signbit(low), signs)


def test_chooser_picks_what_the_h200_measured_faster():
    from moekit.experts.triton_wo_plan import choose_decode
    from moekit.experts.triton_wo_winners import winner

    assert sum(len(cells) for cells in MEASURED.values()) == 24  # every 4-bit cell of the run
    for (e, n, k, top_k), cells in MEASURED.items():
        for (scheme, m), (tile_us, register_us) in cells.items():
            times = {"tile": tile_us, "register": register_us}
            if (scheme, m) in GEMV_MEASURED.get((e, n, k, top_k), {}):
                times["gemv"] = GEMV_MEASURED[(e, n, k, top_k)][(scheme, m)]
            if (scheme, m) in HALF_MEASURED.get((e, n, k, top_k), {}):
                times["gemv_half"] = HALF_MEASURED[(e, n, k, top_k)][(scheme, m)]
            for later in (SPLIT_MEASURED, XTILE_MEASURED, MMA_MEASURED):
                if (scheme, m) in later.get((e, n, k, top_k), {}):
                    decode, us = later[(e, n, k, top_k)][(scheme, m)]
                    times[decode] = min(times.get(decode, us), us)
            if winner(scheme, e, n, k, m) is not None:  # a later run's row decides there (test_triton_wo_mid.py)
                continue
            assert choose_decode(scheme, m, e, n, k, top_k) == min(times, key=times.get), (e, n, k, scheme, m)
    # int8: the tile and register decodes run the same whole-tile dot: the tile decode, but DeepSeek-V3 and Mixtral at
    # M <= 2 on the mma decode (session 28; ``test_triton_wo_mma``)
    assert {choose_decode("int8_w8a16", m, 256, 2048, 7168, 8) for m in (8, 16, 64, 1024)} == {"tile"}
    assert {choose_decode("int8_w8a16", m, 8, 14336, 4096, 2) for m in (8, 64)} == {"tile"}
    assert {choose_decode("int8_w8a16", m, 128, 768, 2048, 8) for m in (1, 8, 64)} == {"tile"}


def test_a_measured_shape_takes_its_nearest_m_in_the_same_tile_height(monkeypatch):
    from moekit.experts import triton_wo_plan as plans

    from moekit.experts import triton_wo_winners

    monkeypatch.setattr(triton_wo_winners, "WO_WINNERS", {})  # the fused decodes' own table alone
    # a made-up table for DeepSeek's shape (E=256, top_k=8: 16-row tiles below M=512, 64 rows at M=1024)
    monkeypatch.setattr(plans, "DECODE_MEASURED", {("mxfp4", 256, 2048, 7168): {1: "register", 64: "tile",
                                                                                1024: "register"}})
    picks = {m: plans.choose_decode("mxfp4", m, 256, 2048, 7168, 8, fused=True)  # the fused decodes' table
             for m in (1, 4, 16, 256, 384, 512, 1024, 4096)}
    assert picks == {1: "register", 4: "register", 16: "tile", 256: "tile", 384: "tile",
                     512: "tile",  # 32-row tiles: no measured M there, DECODE_RULE (mxfp4: tile)
                     1024: "register", 4096: "tile"}  # 4096: 128-row tiles, DECODE_RULE again
    assert plans.choose_decode("int4_w4a16", 1, 256, 2048, 7168, 8) == "register"  # other schemes: the rule


def test_gemv_only_on_the_tiny_batch_shortcut():
    from moekit.experts.triton_wo_plan import choose_decode

    deepseek = (256, 2048, 7168, 8)
    assert choose_decode("int4_w4a16", 8, *deepseek) == "gemv"  # A = 64, 4A <= E: the shortcut
    assert choose_decode("int4_w4a16", 8, *deepseek, shortcut=False) == "register"  # an expert map: aligned
    assert choose_decode("int4_w4a16", 16, *deepseek) == "register"  # nearest measured M = 8, but 4A > E
    assert choose_decode("mxfp4", 1, *deepseek) == "mma"  # session 29: the mma's multiply placement (104 vs gemv 144)
    assert choose_decode("mxfp4", 1, 128, 768, 2048, 8) == "gemv"  # Qwen3: x tile, split in 2 (25.9 vs gemv_half 28.8)


def test_gemv_on_the_aligned_layout_only_at_or_below_where_measured():
    from moekit.experts.triton_wo_plan import choose_decode

    qwen3 = (128, 768, 2048, 8)
    assert choose_decode("int4_w4a16", 8, *qwen3) == "gemv"  # A = 64, 4A > E: aligned, measured faster
    assert choose_decode("int4_w4a16", 6, *qwen3, shortcut=False) == "gemv"  # below the measured M
    assert choose_decode("int4_w4a16", 16, *qwen3) == "register"  # nearest measured M = 8, but above it
    assert choose_decode("int4_w4a16", 64, *qwen3) == "mma"  # its own measured entry (session 26)


@pytest.mark.parametrize("decode,gate_up,down", [("tile", "gate_up_wo_kernel", "down_wo_kernel"),
                                                 ("register", "gate_up_wo_reg_kernel", "down_wo_reg_kernel")])
def test_decode_override_picks_the_kernels(wo, decode, gate_up, down):
    from moekit.experts.triton_wo_configs import wo_heuristic_config
    from moekit.experts.triton_wo_plan import build_wo_plan

    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=5, k=2, seed=40)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    plan = build_wo_plan(x, *args, ids, None, "int4_w4a16", "silu", None, wo.LaunchOptions(), decode=decode)
    assert plan.decode == decode and plan.gate_up.kernel.fn.__name__ == gate_up
    assert plan.down.kernel.fn.__name__ == down
    assert plan.config == wo_heuristic_config(5, 4, 64, 100, 2, "int4_w4a16", decode)
    constexprs = dict(zip(plan.gate_up.kernel.arg_names[10:], plan.gate_up.tail))  # after the 10 pointers (b13 last)
    assert constexprs.get("ASM", "none") == (False if decode == "register" else "none")  # no PTX in the interpreter
    out = wo.fused_experts_wo(x, w13, w2, ids, weights, decode=decode)  # through the custom op
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3


def test_bad_decode_is_refused_by_name(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=1, seed=41)
    with pytest.raises(ValueError, match="decode must be one of"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, decode="registers")
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    with pytest.raises(ValueError, match="decode must be one of"):
        wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", decode="fast")


def test_inline_asm_only_on_compiled_nvidia_sm80(monkeypatch):
    from moekit.experts import triton_wo_plan as plans

    assert not plans.inline_asm_ok(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    assert not plans.inline_asm_ok(cuda)  # the interpreter (conftest sets TRITON_INTERPRET=1)
    monkeypatch.setattr(plans, "interpreting", lambda: False)
    for capability, ok in (((9, 0), True), ((8, 0), True), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert plans.inline_asm_ok(cuda) is ok
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not plans.inline_asm_ok(cuda)


def test_register_heuristic_splits_the_wide_down_tiles():
    from moekit.experts.triton_wo_configs import MIN_PROGRAMS, wo_heuristic_config
    from moekit.experts.triton_wo_plan import decode_split_k

    # the packed down tiles are 128 wide at decode and split where the touched experts' tiles are few
    for (e, n, hidden, top_k), splits in [((256, 2048, 7168, 8), 1), ((8, 14336, 4096, 2), 4),
                                          ((128, 768, 2048, 8), 2)]:
        config = wo_heuristic_config(1, e, n, hidden, top_k, "mxfp4", "register")
        assert config.down.BLOCK_N == 128 and decode_split_k(config, 1, top_k, e, n, hidden) == splits
        assert min(e, top_k) * hidden // 128 * splits >= MIN_PROGRAMS
    # taller tiles: the packed gate-up 32 wide (register pressure); int8 as the tile decode's
    assert wo_heuristic_config(1024, 8, 14336, 4096, 2, "int4_w4a16", "register").up.BLOCK_N == 32
    for m in (1, 64, 1024):
        assert (wo_heuristic_config(m, 8, 14336, 4096, 2, "int8_w8a16", "register")
                == wo_heuristic_config(m, 8, 14336, 4096, 2, "int8_w8a16", "tile"))


def test_register_heuristic_swaps_int4_at_decode_heights_only():
    from moekit.experts.triton_wo_configs import wo_heuristic_config

    # session 24: swapped int4 won Mixtral M = 8 (420 vs 482 µs); mxfp4 lost swapped; taller tiles unmeasured
    assert wo_heuristic_config(8, 8, 14336, 4096, 2, "int4_w4a16", "register").swap_ab
    assert not wo_heuristic_config(8, 8, 14336, 4096, 2, "mxfp4", "register").swap_ab
    assert not wo_heuristic_config(1024, 8, 14336, 4096, 2, "int4_w4a16", "register").swap_ab
    assert not wo_heuristic_config(8, 8, 14336, 4096, 2, "int4_w4a16", "tile").swap_ab


def test_each_decode_reads_its_own_tuned_file(wo, user_config_dir):
    from moekit.experts import triton_wo_configs as plans

    tile = {"BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    entry = {"BLOCK_M": 32, "up": tile, "down": tile}
    (user_config_dir / "E4_N64_K100_int4_w4a16_register_cpu.json").write_text(json.dumps({"configs": {"8": entry}}))
    assert plans.wo_config(5, 4, 64, 100, 2, "int4_w4a16", "cpu", "register") == KernelConfig.from_dict(entry)
    assert plans.wo_config(5, 4, 64, 100, 2, "int4_w4a16", "cpu", "tile") == plans.wo_heuristic_config(
        5, 4, 64, 100, 2, "int4_w4a16", "tile")
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=5, k=2, seed=42)
    out = wo.fused_experts_wo(x, w13, w2, ids, weights, decode="register")  # on the file's config
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3
