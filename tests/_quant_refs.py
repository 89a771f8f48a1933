"""Independent float64 references for the quantization tests: value tables built from the bit formats,
round-to-nearest quantizers and layout decoders written from the session-5 layout text, never from
moekit.quant's code."""

from __future__ import annotations

import torch


def e4m3_magnitudes() -> torch.Tensor:
    """The non-negative finite float8_e4m3fn values in code order (code 0..126), float64, from the bits:
    4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; code 127 (S.1111.111) is NaN."""
    values = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        values.append(man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(values, dtype=torch.float64)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest(a: torch.Tensor, magnitudes: torch.Tensor) -> torch.Tensor:
    """Each element of a (float64) rounded to the nearest signed value of a format whose non-negative
    values, in code order, are ``magnitudes`` (saturating); an exact tie goes to the even code (the
    mantissa's last bit 0), IEEE's round-half-to-even."""
    mag = a.abs()
    idx = torch.searchsorted(magnitudes, mag).clamp(1, len(magnitudes) - 1)
    lo, hi = magnitudes[idx - 1], magnitudes[idx]
    pick_lo = ((mag - lo) < (hi - mag)) | (((mag - lo) == (hi - mag)) & ((idx - 1) % 2 == 0))
    out = torch.where(pick_lo, lo, hi)
    return torch.where(a < 0, -out, out)


def rtn_fp8_block(w: torch.Tensor, br: int = 128, bc: int = 128) -> torch.Tensor:
    """DeepSeek-style RTN: per (br x bc) block s = amax/448, value = s * nearest_e4m3(w/s)."""
    w = w.double()
    out = torch.empty_like(w)
    table = e4m3_magnitudes()
    for r0 in range(0, w.shape[1], br):
        for c0 in range(0, w.shape[2], bc):
            blk = w[:, r0:r0 + br, c0:c0 + bc]
            s = blk.abs().amax(dim=(1, 2), keepdim=True) / 448
            s = torch.where(s > 0, s, torch.ones_like(s))
            out[:, r0:r0 + br, c0:c0 + bc] = nearest(blk / s, table) * s
    return out


def fake_fp8_rows(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per row per ``block`` columns: s = amax/448, x -> s * nearest_e4m3(x/s) (float64)."""
    x = x.double()
    out = torch.empty_like(x)
    table = e4m3_magnitudes()
    for c0 in range(0, x.shape[1], block):
        blk = x[:, c0:c0 + block]
        s = blk.abs().amax(dim=1, keepdim=True) / 448
        s = torch.where(s > 0, s, torch.ones_like(s))
        out[:, c0:c0 + block] = nearest(blk / s, table) * s
    return out


def rtn_int8(w: torch.Tensor) -> torch.Tensor:
    w = w.double()
    s = w.abs().amax(dim=2, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(w / s).clamp(-127, 127) * s


def rtn_int4(w: torch.Tensor, g: int, symmetric: bool) -> torch.Tensor:
    """GPTQ-style RTN per group of g columns (the last group may be short): asymmetric with the range
    widened to include 0, or symmetric amax/7 around 8."""
    w = w.double()
    out = torch.empty_like(w)
    for c0 in range(0, w.shape[2], g):
        blk = w[:, :, c0:c0 + g]
        if symmetric:
            s = blk.abs().amax(dim=2, keepdim=True) / 7
            s = torch.where(s > 0, s, torch.ones_like(s))
            z = torch.full_like(s, 8.0)
        else:
            lo = blk.amin(dim=2, keepdim=True).clamp(max=0)
            hi = blk.amax(dim=2, keepdim=True).clamp(min=0)
            s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
            z = torch.round(-lo / s)
        out[:, :, c0:c0 + g] = (torch.clamp(torch.round(blk / s) + z, 0, 15) - z) * s
    return out


def rtn_mxfp4(w: torch.Tensor, exponent_shift: int = 0) -> torch.Tensor:
    """OCP MX RTN per 32 columns: X = 2**(floor(log2 amax) - 2 + exponent_shift), values nearest e2m1 of
    w/X, saturating at 6 (exponent_shift=1 is the no-clipping variant)."""
    w = w.double()
    table = torch.tensor(E2M1, dtype=torch.float64)
    out = torch.empty_like(w)
    for c0 in range(0, w.shape[2], 32):
        blk = w[:, :, c0:c0 + 32]
        amax = blk.abs().amax(dim=2, keepdim=True)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + exponent_shift, torch.zeros_like(amax))
        x = 2.0 ** e
        out[:, :, c0:c0 + 32] = nearest(blk / x, table) * x
    return out


def unpack_nibbles_by_hand(q: torch.Tensor, cols: int) -> torch.Tensor:
    """[.., ceil(C/2)] uint8 -> [.., C] int64: element 2i the low nibble, 2i+1 the high one."""
    out = torch.empty(*q.shape[:-1], 2 * q.shape[-1], dtype=torch.int64)
    out[..., 0::2] = (q & 15).long()
    out[..., 1::2] = (q >> 4).long()
    return out[..., :cols]


def pack_nibbles_by_hand(codes: torch.Tensor) -> torch.Tensor:
    """[.., C] ints 0..15 -> [.., ceil(C/2)] uint8, element 2i low; an odd C's last high nibble 0."""
    c = codes.shape[-1]
    padded = torch.zeros(*codes.shape[:-1], c + c % 2, dtype=torch.int64)
    padded[..., :c] = codes
    return (padded[..., 0::2] + 16 * padded[..., 1::2]).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    mags = torch.tensor(E2M1, dtype=torch.float64)[codes % 8]
    return torch.where(codes >= 8, -mags, mags)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).square().mean().sqrt())
