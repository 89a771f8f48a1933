"""mxfp4's word MMA decode with the operand placed by one multiply (``_kernels/wo_mma_values``, the launch's ASM) on
the CPU: its two PTX listings run in ``test_gluon_wo_fast``'s emulator for every code in every nibble and every e8m0
scale the placement is exact for (66 .. 192), against a float64 loop (e2m1 * 2^(s - 127), times the decode's 2^-64)
rounded to bf16; the bf16x2 scale's multiply-add; the per-group split's MMA order under the interpreter (its float
twin) against a decoder written here; the tuned configs. The kernels ran on the GPU in
session 29's ``mx9_device_check.py`` (against the torch twin; removed:
``git show 87f368f6:benchmarks/mx9_device_check.py``)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_gluon_wo_fast import MASK, _bf16_bits, _bf16_value, run_ptx  # noqa: E402
from test_triton_wo_mma import wo  # noqa: E402, F401  (the interpreted-kernels fixture)

from moekit.experts._kernels.wo_mma_values import _MXFP4_MUL_EVEN_ASM, _MXFP4_MUL_ODD_ASM  # noqa: E402

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALES = range(66, 193)  # the e8m0 bytes the placement is exact for (module doc of ``wo_mma_values``)
# word c holds code (c + i) % 16 in nibble i: every code in every nibble; two more mixed words
WORDS = [sum(((c + i) % 16) << 4 * i for i in range(8)) for c in range(16)] + [0x9D2F04E6, 0x1B8C73A5]


def value64(code: int, e8m0: int) -> float:
    """The decoded weight: e2m1(code) * 2^(e8m0 - 127), times the decode's 2^-64 (float64, exact)."""
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0 ** (e8m0 - 127 - 64)


def scale_pair(e8m0: int) -> int:
    """The kernel's bf16x2 multiplier of the multiply placement: s * 0x00800080 + 62 * 0x00800080 (int32)."""
    return (e8m0 * 0x00800080 + 62 * 0x00800080) & MASK


def int32_shift(word: int, bits: int) -> int:
    """word (uint32) >> bits as the kernel's int32 shift (arithmetic), as uint32."""
    return (((word ^ 0x80000000) - 0x80000000) >> bits) & MASK


def test_scale_pair_is_the_power_twice():
    for e8m0 in range(194):  # no carry from the low half into the high one up to s = 193
        assert scale_pair(e8m0) == ((e8m0 + 62) << 7) * 0x10001
    for e8m0 in SCALES:
        assert _bf16_value(scale_pair(e8m0) & 0xFFFF) == 2.0 ** (e8m0 - 65)


def test_mxfp4_pairs_decode_exactly():
    # pair t: values t and t + 4 of the word (low and high half), read from the word (t < 2) or the word >> 8 (the
    # kernel's int32 shift), by the even or odd listing
    for e8m0 in SCALES:
        for word in WORDS:
            for t in range(4):
                asm = (_MXFP4_MUL_EVEN_ASM if t % 2 == 0 else _MXFP4_MUL_ODD_ASM).value
                src = word if t < 2 else int32_shift(word, 8)
                got = run_ptx(asm, [None, src, scale_pair(e8m0)], outputs=1)[0]
                want = [_bf16_bits(value64(word >> 4 * v & 0xF, e8m0)) for v in (t, t + 4)]
                assert got == want[0] | want[1] << 16, (hex(word), t, e8m0)


_KERNELS = {}  # the interpreted wo_mma_values module (a Triton kernel reads module globals only)


@triton.jit
def mul_order_kernel(w_ptr, s_ptr, v_out, PAIRS: triton.language.constexpr):
    tl = triton.language
    i = tl.arange(0, 8)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [8, 16]: 8 rows of 16 words
    g = tl.arange(0, 8)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [8, 4]: their groups' e8m0 bytes
    v = _KERNELS["mma"].mxfp4_mul_operand(tl.load(w_ptr + i), tl.load(s_ptr + g), 8, PAIRS, tl.float32, False)
    tl.store(v_out + tl.arange(0, 8)[:, None] * 128 + tl.arange(0, 128)[None, :], v)


@pytest.mark.parametrize("pairs", [1, 2])
def test_mul_operand_keeps_the_mma_order(wo, pairs):  # noqa: F811  (the fixture)
    # the per-group split and joins put value T = 2h + g + 4p of word 4b + q at logical k = 32b + 16h + 8g + 2q + p
    # (PAIRS 1) or 32b + 16h + 4q + 2g + p (PAIRS 2), as ``x_operand`` puts activation column 8j + T: each weight
    # e2m1 * 2^(s - 191) with s its row's byte of group b
    import importlib

    _KERNELS["mma"] = importlib.import_module("moekit.experts._kernels.wo_mma_values")  # under the interpreter
    g = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32, generator=g)
    words[0, :4] = torch.tensor([0x76543210, -0x01234568, 0, -1], dtype=torch.int32)
    scales = torch.randint(100, 150, (8, 4), dtype=torch.int32, generator=g)
    v_out = torch.empty(8, 128)
    mul_order_kernel[(1,)](words, scales, v_out, pairs)
    for k in range(128):
        b, h, p = k // 32, (k // 16) % 2, k % 2
        gg, q = ((k // 8) % 2, (k // 2) % 4) if pairs == 1 else ((k // 2) % 2, (k // 4) % 4)
        j, t = 4 * b + q, 2 * h + gg + 4 * p
        want = [value64((int(w) >> 4 * t) & 0xF, int(s)) for w, s in zip(words[:, j].tolist(), scales[:, b].tolist())]
        assert v_out[:, k].double().tolist() == want, (k, pairs)


def test_mxfp4_mma_tuned_steps():
    # the winners' configs: tuned files (32 rows in 1 warp, 3 stages; 256-column steps, Mixtral M = 8 and DeepSeek-V3
    # M = 64 128), M <= 2 with the gate-up split in 2 (``triton_wo_mma.MMA_UP_SPLITS``); the multiply placement the mma
    # decode's default; other devices: the heuristic's 128-column steps; Mixtral M = 64..127: MMA_CONFIGS' 32-row
    # blocks with the halves at 128 columns (session 32), M = 32 the file's
    from moekit.experts.configs import GemmTile, KernelConfig
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_gemv import WordConfig

    k256, k128 = GemmTile(32, 256, 1, 1, 3), GemmTile(32, 128, 1, 1, 3)
    mixtral = {m: wo_config(m, 8, 14336, 4096, 2, "mxfp4", "NVIDIA_H200", "mma") for m in (1, 8, 32, 64, 127)}
    split, tall = WordConfig(16, k256, k256, up_split=2), WordConfig(32, k128, k128, halves=True)
    assert mixtral == {1: split, 8: KernelConfig(16, k128, k128), 32: KernelConfig(16, k256, k256), 64: tall,
                       127: tall}
    deepseek = {m: wo_config(m, 256, 2048, 7168, 8, "mxfp4", "NVIDIA_H200", "mma") for m in (1, 2, 3, 8, 32, 64)}
    assert deepseek == {1: split, 2: split, 3: KernelConfig(16, k256, k256), 8: KernelConfig(16, k256, k256),
                        32: KernelConfig(16, k128, k128), 64: KernelConfig(16, k128, k128)}
    assert wo_config(8, 8, 14336, 4096, 2, "mxfp4", "other", "mma").up.BLOCK_K == 128
