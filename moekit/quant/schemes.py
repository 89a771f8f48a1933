"""The scheme names and the two ways to get a ``QuantizedWeight``: ``quantize`` a float weight, or
wrap a layout's tensors as they are (``from_tensors``, never requantized).

| scheme         | class           | options (``quantize``)                      | layout tensors      |
| -------------- | --------------- | ------------------------------------------- | ------------------- |
| ``fp8_block``  | Fp8BlockWeight  | block_shape=(128, 128) (cols 16/32/64/128)  | q, scale            |
| ``int8_w8a16`` | Int8Weight      | (none)                                      | q, scale            |
| ``int4_w4a16`` | Int4Weight      | group_size=128 (32/64/128), symmetric=False | q, scale, zero      |
| ``mxfp4``      | Mxfp4Weight     | (none)                                      | q, scale            |
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from moekit.quant.base import QuantizedWeight
from moekit.quant.formats import stack_experts
from moekit.quant.fp8_block import Fp8BlockWeight, quantize_fp8_block
from moekit.quant.int4 import Int4Weight, quantize_int4
from moekit.quant.int8 import Int8Weight, quantize_int8
from moekit.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4

SCHEME_CLASSES: dict[str, type[QuantizedWeight]] = {
    cls.scheme: cls for cls in (Fp8BlockWeight, Int8Weight, Int4Weight, Mxfp4Weight)
}
SCHEMES = tuple(SCHEME_CLASSES)
CHUNK_ELEMENTS = 1 << 27  # 128M weights per quantizer call: ~0.5 GB per float32 temporary
_QUANTIZERS = {
    "fp8_block": quantize_fp8_block,
    "int8_w8a16": quantize_int8,
    "int4_w4a16": quantize_int4,
    "mxfp4": quantize_mxfp4,
}


def check_scheme(scheme) -> str:
    if scheme not in SCHEME_CLASSES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    return scheme


def scheme_options(scheme: str) -> list[str]:
    """The options ``quantize(w, scheme, **options)`` takes for ``scheme``."""
    return [p for p in inspect.signature(_QUANTIZERS[check_scheme(scheme)]).parameters if p != "w"]


def scheme_defaults(scheme: str) -> dict:
    """Each option of ``scheme_options(scheme)`` with its default value."""
    params = inspect.signature(_QUANTIZERS[check_scheme(scheme)]).parameters
    return {name: params[name].default for name in scheme_options(scheme)}


def quantize(w: torch.Tensor, scheme: str, **options) -> QuantizedWeight:
    """Quantize a float weight w [E, R, C] (reduction dim last) with ``scheme``, round to nearest.

    Options per scheme: see the module table; an option the scheme does not take raises here. Experts
    are quantized independently, in chunks of at most CHUNK_ELEMENTS weights (whole experts), so the
    float32 temporaries stay bounded for a DeepSeek-V3 layer (7.5e9 weights) too."""
    taken = scheme_options(scheme)
    unknown = sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"{unknown} are not options of scheme {scheme!r}; it takes {taken}")
    fn = _QUANTIZERS[scheme]
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.numel() <= CHUNK_ELEMENTS:
        return fn(w, **options)  # the quantizer checks w
    per_chunk = max(1, CHUNK_ELEMENTS // max(w[0].numel(), 1))
    return stack_experts([fn(w[e:e + per_chunk], **options) for e in range(0, w.shape[0], per_chunk)])


def from_tensors(scheme: str, **fields) -> QuantizedWeight:
    """Wrap a layout's tensors without requantizing: the fields of the scheme's class (``q``, ``scale``,
    ``zero``, ``block_shape``, ``group_size``, ``cols``, ``dtype``; see each class). ``cols`` defaults to
    2 * q.shape[-1] for the packed schemes (pass it for an odd C)."""
    cls = SCHEME_CLASSES[check_scheme(scheme)]
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"{unknown} are not fields of {cls.__name__} ({scheme!r}); it takes {names}")
    if "cols" in names and "cols" not in fields and isinstance(fields.get("q"), torch.Tensor):
        fields["cols"] = 2 * fields["q"].shape[-1]
    missing = [n for n in cls.tensor_fields if n not in fields]
    if missing:
        raise ValueError(f"{cls.__name__} ({scheme!r}) needs the tensors {missing}")
    return cls(**fields)


def scheme_of_tensors(tensors: dict[str, torch.Tensor]) -> str | None:
    """The scheme whose layout ``tensors`` (field name -> tensor, e.g. a state_dict's ``w13.q``, ``w13.scale``) are:
    the one with those field names and dtypes (``tensor_dtypes``), or None."""
    dtypes = {name: t.dtype for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    return next((scheme for scheme, cls in SCHEME_CLASSES.items() if cls.tensor_dtypes == dtypes), None)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)
