"""Checkpoint tensors -> QuantizedWeights, tensor in, tensor out (no files, no network).

Accepted formats:

| format                       | tensors (per Linear, or with a leading E)                        | becomes          |
| ---------------------------- | ---------------------------------------------------------------- | ---------------- |
| DeepSeek-V3 fine-grained fp8 | weight [R, C] e4m3, weight_scale_inv [ceil(R/128), ceil(C/128)]  | Fp8BlockWeight,  |
|                              |   (float32, bfloat16 or float8_e8m0fnu scales, kept exactly)     |   as is          |
| gpt-oss MXFP4                | *_blocks [E, R, C/32, 16] uint8, *_scales [E, R, C/32] uint8     | Mxfp4Weight, the |
|                              |                                                                  |   same bytes     |
| GPTQ int4 (v1 and v2)        | qweight [C/8, R] int32, qzeros [C/g, R/8] int32, scales [C/g, R] | Int4Weight,      |
|                              |                                                                  |   repacked once  |
| AWQ int4 (GEMM packing)      | qweight [C, R/8] int32, qzeros [C/g, R/8] int32, scales [C/g, R] | Int4Weight,      |
|                              |                                                                  |   repacked once  |

The int32 packings differ: GPTQ packs 8 codes along the input dim (C) of qweight, code i of a word
at bits 4i; AWQ packs along the output dim (R) in the order AWQ_ORDER (the word's nibble i holds
column 8p + AWQ_ORDER[i]); both pack qzeros along R, each in its own order. GPTQ v1 stores zero - 1
(``gptq_version=1`` adds the 1 back, as its kernels do; a stored 15 then reads 16); GPTQ v2 stores
the zero. Act-order GPTQ (a g_idx that is not c // g) and group_size -1 are refused. R, C here are
the logical [E, R, C] of moekit (R = out_features, C = in_features).

``cat_rows`` joins a gate and an up projection into w13; ``stack_experts`` joins per-expert weights.
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.quant.base import QuantizedWeight, cdiv, pack_nibbles
from moekit.quant.fp8_block import DEFAULT_BLOCK_SHAPE, Fp8BlockWeight
from moekit.quant.int4 import Int4Weight, check_group_size
from moekit.quant.mxfp4 import MX_BLOCK, Mxfp4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8p + AWQ_ORDER[i]
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def _leading_e(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-Linear tensor gets E = 1 in front; one with E already is kept."""
    return t.unsqueeze(0) if t.dim() == dims else t


def from_deepseek_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, block_shape=DEFAULT_BLOCK_SHAPE,
                      dtype: torch.dtype = torch.bfloat16) -> Fp8BlockWeight:
    """DeepSeek-V3 fp8: weight [R, C] or [E, R, C] float8_e4m3fn and its weight_scale_inv (dequantized =
    weight * scale per block). Scales in bfloat16 or e8m0 are widened to float32, exactly."""
    if not isinstance(weight_scale_inv, torch.Tensor) or weight_scale_inv.dtype not in _SCALE_DTYPES:
        got = getattr(weight_scale_inv, "dtype", type(weight_scale_inv).__name__)
        raise TypeError(f"weight_scale_inv must be one of {_SCALE_DTYPES}, got {got}")
    block_shape = tuple(block_shape)
    return Fp8BlockWeight(q=_leading_e(weight, 2), scale=_leading_e(weight_scale_inv, 2).float(),
                          block_shape=block_shape, dtype=dtype)


def from_gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *,
                       dtype: torch.dtype = torch.bfloat16) -> Mxfp4Weight:
    """gpt-oss: blocks [E, R, C/32, 16] uint8 (32 e2m1 values per block, low nibble first), scales
    [E, R, C/32] uint8 e8m0 -> the same bytes as q [E, R, C/2]. gate_up_proj's rows stay interleaved
    (gate row 2i, up row 2i+1): run it with an interleaved ActivationSpec."""
    if blocks.dim() != 4 or blocks.shape[-1] != MX_BLOCK // 2 or blocks.dtype != torch.uint8:
        raise ValueError(f"blocks must be uint8 [E, R, C/32, 16], got {blocks.dtype} {list(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"scales must have shape {list(blocks.shape[:3])} (blocks' first 3 dims), got "
                         f"{list(scales.shape)}")
    e, r, g = scales.shape
    return Mxfp4Weight(q=blocks.reshape(e, r, g * MX_BLOCK // 2), scale=scales, cols=g * MX_BLOCK, dtype=dtype)


def _unpack_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    """words int32 with a packed dim ``dim`` (>= 0) -> codes uint8 with that dim 8 times longer: code i of
    word p sits at bits 4i and lands at position 8p + i."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed int4 tensors must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)  # [8]
    codes = ((words.unsqueeze(-1) >> shifts) & 0xF).movedim(-1, dim + 1)  # the 8 codes right after their word
    return codes.flatten(dim, dim + 1).to(torch.uint8)


def _awq_unorder(codes: torch.Tensor) -> torch.Tensor:
    """Columns unpacked from AWQ words in nibble order -> logical column order, along the last dim."""
    undo = [AWQ_ORDER.index(j) for j in range(8)]  # column 8p + j sits in nibble undo[j]
    return codes.unflatten(-1, (-1, 8))[..., undo].flatten(-2)


def _int4_from_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> Int4Weight:
    """codes [E, C, R], zeros [E, G, R], scales [E, G, R] (checkpoint orientation) -> moekit's Int4Weight."""
    e, c, r = codes.shape
    if tuple(scales.shape) != (e, cdiv(c, group_size), r) or tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"scales and qzeros must unpack to [E, C/g={cdiv(c, group_size)}, R={r}], "
                         f"got {list(scales.shape)} and {list(zeros.shape)}")
    return Int4Weight(q=pack_nibbles(codes.transpose(1, 2)), scale=scales.transpose(1, 2).float().contiguous(),
                      zero=zeros.transpose(1, 2).contiguous(), group_size=group_size, cols=c, dtype=dtype)


def from_gptq(qweight, qzeros, scales, *, group_size: int, g_idx=None, gptq_version: int = 1,
              dtype: torch.dtype = torch.float16) -> Int4Weight:
    """GPTQ int4 (per Linear, or with a leading E): qweight [C/8, R], qzeros [G, R/8], scales [G, R]."""
    check_group_size(group_size)
    if gptq_version not in (1, 2):
        raise ValueError(f"gptq_version must be 1 (zeros stored minus 1) or 2, got {gptq_version!r}")
    codes = _unpack_int32(_leading_e(qweight, 2), 1)  # [E, C, R]
    if g_idx is not None:
        trivial = torch.arange(codes.shape[1], device=g_idx.device) // group_size
        if g_idx.shape != trivial.shape or not torch.equal(g_idx.long(), trivial):
            raise ValueError("g_idx is not c // group_size (act-order GPTQ): moekit's groups are contiguous along C")
    zeros = _unpack_int32(_leading_e(qzeros, 2), 2) + (1 if gptq_version == 1 else 0)  # [E, G, R]
    return _int4_from_codes(codes, zeros, _leading_e(scales, 2), group_size, dtype)


def from_awq(qweight, qzeros, scales, *, group_size: int, dtype: torch.dtype = torch.float16) -> Int4Weight:
    """AWQ int4, GEMM packing (per Linear, or with a leading E): qweight [C, R/8], qzeros [G, R/8], scales [G, R]."""
    check_group_size(group_size)
    codes = _awq_unorder(_unpack_int32(_leading_e(qweight, 2), 2))  # [E, C, R]
    zeros = _awq_unorder(_unpack_int32(_leading_e(qzeros, 2), 2))  # [E, G, R]
    return _int4_from_codes(codes, zeros, _leading_e(scales, 2), group_size, dtype)


def _same_kind(weights: list[QuantizedWeight]) -> dict:
    """The non-tensor fields every weight shares (class, block or group size, dtype), or a clear error."""
    first = weights[0]
    if not isinstance(first, QuantizedWeight):
        raise TypeError(f"expected QuantizedWeights, got {type(first).__name__}")
    meta = {f.name: getattr(first, f.name) for f in dataclasses.fields(first) if f.name not in first.tensor_fields}
    for w in weights[1:]:
        if type(w) is not type(first) or any(getattr(w, k) != v for k, v in meta.items() if k != "cols"):
            raise ValueError(f"cannot join {w!r} with {first!r}: scheme, block/group size and dtype must match")
    return meta


def stack_experts(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-expert weights (each with E = 1, or any E) -> one weight, experts in list order."""
    meta = _same_kind(list(weights))
    if any(w.shape[1:] != weights[0].shape[1:] for w in weights):
        raise ValueError(f"every expert weight must have the shape [*, R, C] of the first, {list(weights[0].shape)}")
    return type(weights[0])(**meta,
                            **{k: torch.cat([w.tensors()[k] for w in weights]) for k in weights[0].tensor_fields})


def cat_rows(gate: QuantizedWeight, up: QuantizedWeight) -> QuantizedWeight:
    """w13 [E, 2N, C] from gate [E, N, C] then up [E, N, C] (moekit's gate-then-up order)."""
    meta = _same_kind([gate, up])
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {list(gate.shape)} and {list(up.shape)}")
    if isinstance(gate, Fp8BlockWeight) and gate.shape[1] % gate.block_shape[0]:
        raise ValueError(f"fp8_block: gate's rows ({gate.shape[1]}) must be a multiple of the block rows "
                         f"({gate.block_shape[0]}) to join it with up in one block grid")
    return type(gate)(**meta, **{k: torch.cat([gate.tensors()[k], up.tensors()[k]], dim=1) for k in gate.tensor_fields})
