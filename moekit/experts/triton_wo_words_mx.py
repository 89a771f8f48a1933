"""mxfp4 on the words decode, the host side (decode "gluon_words", issue #16 target 1, session 46; the kernel part:
``_kernels/words_mx.py``): the scales' range the decode holds exactly (``check_mx_scales``) and the decode's bit
operations in torch (``mx_pairs_torch``, ``mx_values_torch``) for the CPU tests.

The words path reads mxfp4 as ``moekit.quant.Mxfp4Weight`` stores it (gpt-oss's checkpoints load so through
``moekit.hf``): two e2m1 codes a byte, low nibble first, as int4's, so the int4 words, dot order and ``x_words`` carry
it with no packing of its own and no memory beside the weights. What it needs of the shapes is int4's (K and N
multiples of 256): gpt-oss's 2880 is not one, and is refused by name (``triton_wo_words.check_words``).

Shapes: words [...] int32; scales uint8 e8m0, one a 32 columns.
"""

from __future__ import annotations

import torch

from moekit._bounded import put_bounded
from moekit.experts._kernels.words_mx import M_FIELDS, MAGNITUDE_MASK, MX_MAX_SCALE, MX_SHIFTS, SIGN_MASK

_CHECKED: dict[tuple, bool] = {}  # (address, shape, strides, version) of scales whose bytes were read
MAX_CHECKED = 1024


def check_mx_scales(scale: torch.Tensor, name: str) -> None:
    """The decode's factor M = 2^(s - 1) is a normal bf16 for e8m0 bytes s <= MX_MAX_SCALE (``words_mx``): larger
    ones (a group reaching 12 in magnitude) are refused by name. The bytes are read once per tensor version (a
    device sync the first time); while a CUDA graph captures an unchecked tensor is refused too (check it eagerly
    first: one eager call)."""
    key = (scale.data_ptr(), tuple(scale.shape), scale.stride(), scale._version, scale.device)
    if key in _CHECKED:
        return
    if scale.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"decode='gluon_words' on mxfp4 reads {name}.scale's range once before it runs: make one "
                         "eager call before capturing a graph")
    top = int(scale.max()) if scale.numel() else 0
    if top > MX_MAX_SCALE:
        raise ValueError(f"decode='gluon_words' on mxfp4 needs {name}.scale e8m0 bytes <= {MX_MAX_SCALE} (groups below "
                         f"12 in magnitude: the decode's factor 2^(s - 1) in bf16), got {top}")
    put_bounded(_CHECKED, key, True, MAX_CHECKED)


def _shifted(words: torch.Tensor, shift: int) -> torch.Tensor:
    """words (int64 holding uint32) shifted left by ``shift`` (right for a negative one), kept to 32 bits."""
    return ((words << shift) if shift >= 0 else (words >> -shift)) & 0xFFFFFFFF


def mx_pairs_torch(words: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """``words_mx._MX_ASM`` in torch: words [...] (int64 holding their uint32 bits) and each word's e8m0 byte
    [...] -> pairs t = 0..3 as float64 [..., 2] (code t, code t + 4): the bits placed as the lop3s place them, read as
    bf16 (2^-126 times the value; code 1 a subnormal), times M = 2^(s - 1) read from ``M_FIELDS``' bits, each
    product asserted exact in bf16 (the fma.rn.bf16x2 rounds nothing)."""
    mul = _bf16_halves((scale.long() + 126) * M_FIELDS)
    pairs = []
    for magnitude, sign in MX_SHIFTS:
        placed = (_shifted(words, magnitude) & MAGNITUDE_MASK) | (_shifted(words, sign) & SIGN_MASK)
        value = _bf16_halves(placed) * mul
        assert torch.equal(value.float().bfloat16().double(), value), "a decoded value not exact in bf16"
        pairs.append(value)
    return pairs


def _bf16_halves(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding bf16x2 bits -> float64 [..., 2] (the low half first), subnormals included."""
    halves = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], -1)
    return (halves.to(torch.int32) << 16).view(torch.float32).double()


def mx_values_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One row's mxfp4 codes q [C / 2] uint8 (C a multiple of 8) and scales [C / 32] -> its C values (float64) in
    column order, through ``mx_pairs_torch``: word i's pair t holds columns 8 i + t and 8 i + t + 4."""
    words = q.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [C / 8]
    per_word = scale.repeat_interleave(4)[: words.numel()]  # a group is 4 words
    pairs = torch.stack(mx_pairs_torch(words, per_word), 1)  # [C / 8, t, 2]
    return pairs.permute(0, 2, 1).reshape(-1)  # column 8 i + 4 h + t
