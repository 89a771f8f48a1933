"""``QuantizedWeight``: the common face of every quantized expert weight.

A quantized weight stands for a logical float weight ``[E, R, C]`` (w13: R = 2N, C = K; w2: R = K,
C = N), quantized along C, the reduction dim. Each scheme is a frozen dataclass holding the tensors of
its layout (the session-5 layouts every kernel reads, documented on each class) and whatever the tensors
alone cannot say (the block or group size, an odd C). Nothing here depends on a device.

Shapes: E experts, R rows (output features), C columns (input features, the reduction dim).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what dequantize computes into


def _dtype_error(dtype) -> Exception:
    """dequantize's error: a TypeError for what is no torch.dtype (a string), a ValueError for another dtype."""
    names = ", ".join(str(d) for d in DEQUANTIZE_DTYPES)
    error = ValueError if isinstance(dtype, torch.dtype) else TypeError
    return error(f"dtype must be a floating-point torch.dtype ({names}), got {dtype!r}")


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class QuantizedWeight:
    """Base of the per-scheme classes; never built directly.

    ``dtype`` is the logical dtype: the float dtype the weight had (or a model computes in), not the
    storage dtype. Backends never cast activations to it; ``MoE.quantize_`` records it.
    """

    scheme: ClassVar[str] = ""
    tensor_dtypes: ClassVar[dict[str, torch.dtype]] = {}  # each tensor field's dtype; no two schemes share one
    tensor_fields: ClassVar[tuple[str, ...]] = ()  # the dataclass fields that hold tensors, all with E leading

    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype (the logical dtype), got {self.dtype!r}")
        tensors = self.tensors()
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.scheme}: {name} must be a torch.Tensor, got {type(t).__name__}")
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(f"{self.scheme}: all tensors must be on one device, got {sorted(map(str, devices))}")
        self._check()

    def _check(self) -> None:
        """Scheme-specific shape and dtype checks (a clear error naming the tensor)."""
        raise NotImplementedError

    @property
    def shape(self) -> torch.Size:
        """The logical shape [E, R, C]."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight [E, R, C] in ``dtype``, one of ``DEQUANTIZE_DTYPES`` (computed in float32, or float64
        when asked); anything else (a string, an integer dtype) is refused naming them."""
        if dtype not in DEQUANTIZE_DTYPES:  # a tuple: compared by identity first, never hashed (~40 ns)
            raise _dtype_error(dtype)
        return self._dequantize(dtype)

    def dequantize_expert(self, expert: int, dtype: torch.dtype = torch.float32,
                          rows: slice = slice(None)) -> torch.Tensor:
        """w[expert, rows] [r, C] in ``dtype`` (as ``dequantize``'s): bit-identical to ``dequantize(dtype)[expert,
        rows]`` at the cost of those rows (the CPU inference loop dequantizes only the experts a call touches, a tile
        of rows at a time)."""
        if dtype not in DEQUANTIZE_DTYPES:
            raise _dtype_error(dtype)
        return self._dequantize_expert(expert, dtype, rows)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize_expert(self, expert: int, dtype: torch.dtype, rows: slice) -> torch.Tensor:
        """The weight-only schemes override it with a faster expression of the same per-element arithmetic."""
        return self.select_experts(slice(expert, expert + 1))._dequantize(dtype)[0, rows]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_fields}

    @property
    def device(self) -> torch.device:
        return getattr(self, self.tensor_fields[0]).device

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors, scales and zero points included (what a GEMM streams)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def nbytes_per_expert(self) -> int:
        """``nbytes`` of one expert: what a GEMM streams per touched expert (the byte model's unit)."""
        return self.nbytes // max(self.num_experts, 1)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with every tensor on ``device`` (self when already there). Never casts: a dtype is refused
        (torch's own error read "device() received an invalid combination of arguments")."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"{type(self).__name__}.to takes a device, got the dtype {device}: a quantized weight "
                            f"keeps its {self.scheme} storage; dequantize({device}) gives a float copy")
        if torch.device(device) == self.device:
            return self
        return dataclasses.replace(self, **{k: t.to(device) for k, t in self.tensors().items()})

    def select_experts(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the experts ``index`` picks (a slice or a 1-D index tensor along E)."""
        return dataclasses.replace(self, **{k: t[index] for k, t in self.tensors().items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def check_tensor(scheme: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """``t`` must have ``dtype`` and ``shape``; the error names the scheme, the tensor and both."""
    if t.dtype != dtype:
        raise TypeError(f"{scheme}: {name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{scheme}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def check_3d(scheme: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{scheme}: {name} must be a 3-D tensor [E, R, C], got {got}")


def check_float_weight(scheme: str, w: torch.Tensor) -> None:
    """The weight ``quantize`` takes: a floating-point [E, R, C] tensor with finite values."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor [E, R, C], got {type(w).__name__}")
    if not w.is_floating_point() or w.element_size() < 2:
        raise TypeError(f"{scheme}: w must be float16, bfloat16, float32 or float64, got {w.dtype}")
    check_3d(scheme, "w", w)
    if w.is_meta:  # torch's own error was "Tensor.item() cannot be called on meta tensors"
        raise ValueError(f"{scheme}: w is on the meta device: it has no values to quantize (materialize it first)")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{scheme}: w has NaN or infinite values; they cannot be quantized")


def pad_cols(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """w [..., C] -> [..., ceil(C/multiple)*multiple], zeros appended (zeros change no amax, min or max)."""
    extra = -w.shape[-1] % multiple
    return torch.nn.functional.pad(w, (0, extra)) if extra else w


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., C] (integers 0..15) -> [..., ceil(C/2)] uint8: element 2i in the low nibble, 2i+1 in the
    high nibble; an odd C's last high nibble is 0."""
    codes = pad_cols(codes.to(torch.uint8), 2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


_PAIR_WORDS = {2: torch.int32, 4: torch.int64}  # an element size -> the integer type holding two such elements


@functools.cache
def nibble_pair_table(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row b = (values[b & 15], values[b >> 4]) in ``dtype``, the two codes of byte b in element order
    (``pack_nibbles``): [256] of one integer word per pair where ``dtype`` has 2 or 4 bytes, else [256, 2]."""
    table = torch.tensor(values, dtype=torch.float64)
    byte = torch.arange(256)
    pairs = torch.stack([table[byte & 15], table[byte >> 4]], dim=1).to(dtype=dtype, device=device)  # [256, 2]
    word = _PAIR_WORDS.get(dtype.itemsize)
    return pairs if word is None else pairs.view(word).view(256)


def decode_nibbles(packed: torch.Tensor, values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """packed [R, B] uint8 -> [R, 2B] in ``dtype``, each code replaced by values[code]: one gather of a byte's two
    values (``nibble_pair_table``) per byte, as one integer word where it fits (~6x faster than unpacking)."""
    table = nibble_pair_table(values, dtype, packed.device)
    pairs = table.index_select(0, packed.reshape(-1).int())  # [R*B] words or [R*B, 2]
    return pairs.view(dtype).view(packed.shape[0], 2 * packed.shape[1])


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """packed [..., ceil(C/2)] uint8 -> codes [..., C] uint8 (0..15); the inverse of ``pack_nibbles``."""
    both = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # [..., ceil(C/2), 2]
    return both.flatten(-2)[..., :cols]
