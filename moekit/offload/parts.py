"""An expert's weights as named per-expert tensors ("parts"), so the cache moves float and quantized experts alike.

    float:      w13 [E, 2N, K], w2 [E, K, N]                      -> parts "w13", "w2"
    quantized:  w13 = QuantizedWeight(q, scale[, zero]), w2 = ... -> parts "w13.q", "w13.scale"(, "w13.zero"),
                                                                     "w2.q", ...
    biases:     b13 [E, 2N], b2 [E, K] (gpt-oss)                  -> parts "b13", "b2"

Every part has E leading, so expert e of a part is ``part[e]`` and a slot is ``slot_part[s]``; the
cache keeps the parts as views over byte blocks (``blocks.BlockLayout``) and rebuilds the weights the
experts signature takes from the slot parts
(``ExpertWeights.rebuild``: a quantized weight of C experts whose tensors are the slot tensors, no copy).
An expert's bytes are the sum over its parts: the packed tensors, scales and zero points of a quantized
scheme (what a fetch moves), not the logical float size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moekit.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts as parts, and how to rebuild the signature's weights from parts."""

    parts: dict[str, torch.Tensor]  # name -> [E, ...]; names as in the module docstring
    w13_template: Weight  # the layer's w13; for a quantized one, its scheme and options (block, group, cols)
    w2_template: Weight

    @classmethod
    def of(cls, w13: Weight, w2: Weight, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        if isinstance(w13, QuantizedWeight) != isinstance(w2, QuantizedWeight):
            raise TypeError(f"w13 and w2 must both be float tensors or both QuantizedWeights, got "
                            f"{type(w13).__name__} and {type(w2).__name__}")
        parts = {**_split("w13", w13), **_split("w2", w2)}
        parts.update({name: b for name, b in (("b13", b13), ("b2", b2)) if b is not None})
        return cls(parts, w13, w2)

    @property
    def scheme(self) -> str | None:
        """The quantization scheme, None for float experts."""
        return self.w13_template.scheme if isinstance(self.w13_template, QuantizedWeight) else None

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert over all its parts: what one fetch copies."""
        return sum(p[0].numel() * p.element_size() for p in self.parts.values())

    def signature(self) -> tuple:
        """What must agree between layers sharing slots: each part's per-expert shape and dtype, and the
        scheme with its options (two int4 layers with different group sizes cannot share a slot)."""
        shapes = tuple((name, tuple(p.shape[1:]), p.dtype) for name, p in self.parts.items())
        return (self.scheme, _options(self.w13_template), _options(self.w2_template), shapes)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {list(p.shape[1:])} {str(p.dtype).removeprefix('torch.')}"
                          for name, p in self.parts.items())
        options = {k: v for k, v in _options(self.w13_template).items() if k != "dtype"}
        return f"{self.scheme or 'float'} experts{f' {options}' if options else ''} ({parts})"

    def rebuild(self, parts: dict[str, torch.Tensor]) -> tuple[Weight, Weight, torch.Tensor | None,
                                                               torch.Tensor | None]:
        """(w13, w2, b13, b2) over ``parts`` (same names, any number of experts), as the signature takes them."""
        return (_join(self.w13_template, "w13", parts), _join(self.w2_template, "w2", parts),
                parts.get("b13"), parts.get("b2"))

    def select(self, experts: list[int]) -> tuple[Weight, Weight, torch.Tensor | None, torch.Tensor | None]:
        """(w13, w2, b13, b2) of ``experts`` only, in that order (copies of those experts' parts)."""
        index = torch.tensor(experts, dtype=torch.long, device=next(iter(self.parts.values())).device)
        return self.rebuild({name: p.index_select(0, index) for name, p in self.parts.items()})


def _split(name: str, w: Weight) -> dict[str, torch.Tensor]:
    if isinstance(w, QuantizedWeight):
        return {f"{name}.{field}": t for field, t in w.tensors().items()}
    return {name: w}


def _join(template: Weight, name: str, parts: dict[str, torch.Tensor]) -> Weight:
    if isinstance(template, QuantizedWeight):
        return dataclasses.replace(template, **{field: parts[f"{name}.{field}"] for field in template.tensor_fields})
    return parts[name]


def _options(w: Weight) -> dict:
    """A quantized weight's non-tensor fields (block_shape, group_size, cols, dtype); {} for a tensor."""
    if not isinstance(w, QuantizedWeight):
        return {}
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name not in w.tensor_fields}
