"""The FAST decode's inline PTX (``moekit/experts/_kernels/gluon_wo_fast.py``) on the CPU: its two PTX listings run
by a small emulator of the instructions they use (written here from the PTX ISA's definitions of mov, and, shl,
shr, mul.lo, lop3, prmt, fma, add and cvt; ``test_gluon_wo_swap`` runs the swapped GEMM's int8 pair in it too and
``test_wo_mxfp4_mul`` the mma decode's mxfp4 listings), word by word, against the values the decode must produce:
mxfp4 e2m1 * 2^(e8m0 - 127) rounded to bf16 for every byte and every e8m0 0 .. 254, int4 the session-27 decode's
float32 fma(128 + code, scale, -(128 + zero) * scale) rounded to bf16, pairs in K order (weight 2j the low half).
The kernel itself needs a Hopper GPU
(session 28's ``wo8_device_check.py`` checked its decoded bits there; removed:
``git show 87f368f6:benchmarks/wo8_device_check.py``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moekit.experts._kernels.gluon_wo_fast import _INT4_ASM, _MXFP4_ASM

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MASK = 0xFFFFFFFF


def _bf16_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def _bf16_value(bits: int) -> float:
    return float(torch.tensor(bits - (1 << 16) if bits >= 1 << 15 else bits, dtype=torch.int16).view(torch.bfloat16))


def _f32_value(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _f32_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])  # one rounding of the exact float64 x


def _prmt(a: int, b: int, c: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # sign mode: the selected byte's top bit replicated
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))


def _bf16x2_fma(a: int, b: int, c: int) -> int:
    lanes = [_bf16_bits(_bf16_value(a >> s & 0xFFFF) * _bf16_value(b >> s & 0xFFFF) + _bf16_value(c >> s & 0xFFFF))
             for s in (0, 16)]  # the bf16 product is exact in float64: one rounding
    return lanes[0] | lanes[1] << 16


def _bf16x2_add(a: int, b: int) -> int:
    lanes = [_bf16_bits(_bf16_value(a >> s & 0xFFFF) + _bf16_value(b >> s & 0xFFFF)) for s in (0, 16)]
    return lanes[0] | lanes[1] << 16


def run_ptx(asm: str, args: list[int], outputs: int = 4) -> list[int]:
    """Run ``asm`` (one ``{ ... }`` block) with $i bound to ``args`` (``outputs`` outputs first, None), 32-bit
    values."""
    regs = {f"${i}": v for i, v in enumerate(args)}

    def val(x: str) -> int:
        return regs[x] if x in regs else int(x, 0) & MASK

    for line in asm.strip().strip("{}").splitlines():
        m = re.match(r"\s*([\w.]+)\s+(.*);", line)
        if not m or m.group(1) == ".reg":
            continue
        op, ops = m.group(1), [o.strip() for o in m.group(2).split(",")]
        x = [val(o) for o in ops[1:]]
        if op.startswith("mov"):
            r = x[0]
        elif op == "cvt.u32.u16":
            r = x[0] & 0xFFFF
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & MASK
        elif op == "shr.u32":
            r = x[0] >> x[1]
        elif op == "mul.lo.u32":
            r = (x[0] * x[1]) & MASK
        elif op == "lop3.b32":
            r = _lop3(*x)
        elif op == "prmt.b32":
            r = _prmt(*x)
        elif op == "add.rn.bf16x2":
            r = _bf16x2_add(*x)
        elif op == "fma.rn.bf16x2":
            r = _bf16x2_fma(*x)
        elif op == "fma.rn.f32":
            r = _f32_bits(_f32_value(x[0]) * _f32_value(x[1]) + _f32_value(x[2]))
        elif op == "cvt.rn.bf16x2.f32":  # d = {a (high half), b (low half)}
            r = _bf16_bits(_f32_value(x[0])) << 16 | _bf16_bits(_f32_value(x[1]))
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[ops[0]] = r
    return [regs[f"${i}"] for i in range(outputs)]


def _word_pairs(words: int, expected) -> list[int]:
    """The 4 bf16x2 registers a word must decode to: weight 2j the low half of register j."""
    return [_bf16_bits(expected(words >> 8 * j & 0xF)) | _bf16_bits(expected(words >> 8 * j + 4 & 0xF)) << 16
            for j in range(4)]


def _e8m0_pair(e8m0: int) -> int:  # ``gluon_wo_fast.e8m0_pair``'s arithmetic
    bits = 0x40 if e8m0 == 0 else e8m0 << 7
    return bits | bits << 16


@pytest.mark.parametrize("e8m0", [0, 1, 100, 118, 127, 128, 129, 150, 200, 254])
def test_mxfp4_words_decode_exactly(e8m0):
    g = np.random.default_rng(e8m0)
    words = [int(w) for w in g.integers(0, 1 << 32, 24, dtype=np.uint64)] + [0x76543210, 0xFEDCBA98]  # every code
    for word in words:
        def value(code: int) -> float:
            return (-1 if code & 8 else 1) * E2M1[code & 7] * 2.0 ** (e8m0 - 127)

        got = run_ptx(_MXFP4_ASM.value, [None] * 4 + [word, _e8m0_pair(e8m0)])
        assert got == _word_pairs(word, value), (hex(word), e8m0)


@pytest.mark.parametrize("zero", [0, 3, 8, 15])
def test_int4_words_decode_as_the_session_27_formula(zero):
    g = np.random.default_rng(zero)
    for word, scale in zip(g.integers(0, 1 << 32, 16, dtype=np.uint64), g.random(16) / 97 + 1e-4):
        scale = float(np.float32(scale))
        add = float(np.float32(-(128.0 + zero) * scale))  # float32, as ``_group_scales`` makes it

        def value(code: int, s=scale, a=add) -> float:
            return _f32_value(_f32_bits((128.0 + code) * s + a))  # the fma: one float32 rounding

        got = run_ptx(_INT4_ASM.value, [None] * 4 + [int(word), _f32_bits(scale), _f32_bits(add), 0x43000000])
        assert got == _word_pairs(int(word), value), (hex(int(word)), scale, zero)
