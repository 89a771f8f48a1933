"""Experts' parts as byte blocks: what one copy moves, and the typed views the experts backends read.

    parts {name: [E, ...]}  --BlockLayout.of-->  blocks [E, B_g] uint8, one per group g
    group 0: w13 (or w13.q)                      one part, B_0 = its bytes: the view is the plain tensor
    group 1: w2 (or w2.q)                        one part, likewise
    group 2: scales, zero points, biases         every small part at a 256-byte aligned offset

A fetch of one expert is one ``copy_`` per group (2 for float experts without biases, 3 for every
quantized scheme, int4's zero points and biases included), and a run of r consecutive slots filled
from r consecutive host experts is still one copy per group (rows ``[s, s + r)`` of each block).

Why not one block per expert: a part's view over C slots has the slot stride as its dim-0 stride. Were
w13 and w2 interleaved in one block, w13 [C, 2N, K] would have dim-0 stride B / 2 instead of 2N * K:
still a strided tensor, but no longer contiguous, and the Triton paths that build TMA descriptors from
a contiguous weight (``triton_plan``, ``triton_fp8_plan``) would silently fall back. The two weight
parts therefore keep their own blocks, so their views are exactly the tensors the slots were before;
only the small parts (read through their strides by every backend) share one block per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: every part of the shared block starts at a multiple of this in each row
_WEIGHT_PARTS = ("w13", "w2", "w13.q", "w2.q")  # the parts that keep a block of their own


@dataclass(frozen=True)
class PartView:
    """Where one part lies: its group's block, byte offset in a row of it, dtype and per-expert shape."""

    group: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BlockLayout:
    """The groups' row bytes and each part's place; built from one layer's parts (``of``)."""

    row_bytes: tuple[int, ...]  # [G]: bytes of one expert's row in each group's block
    views: dict[str, PartView]  # part name -> its place, in the parts' order

    @classmethod
    def of(cls, parts: dict[str, torch.Tensor]) -> "BlockLayout":
        rows: list[int] = []
        views: dict[str, PartView] = {}
        small = [name for name in parts if name not in _WEIGHT_PARTS]
        for name in [n for n in parts if n in _WEIGHT_PARTS]:
            views[name] = PartView(len(rows), 0, parts[name].dtype, tuple(parts[name].shape[1:]))
            rows.append(_row_nbytes(parts[name]))
        if small:
            offset = 0
            for name in small:
                views[name] = PartView(len(rows), offset, parts[name].dtype, tuple(parts[name].shape[1:]))
                offset += -(-_row_nbytes(parts[name]) // ALIGN) * ALIGN
            rows.append(offset)
        return cls(tuple(rows), {name: views[name] for name in parts})

    @property
    def payload_bytes(self) -> int:
        """One expert's bytes over its parts, without the shared block's alignment padding."""
        return sum(_nbytes(v) for v in self.views.values())

    @property
    def padded_bytes(self) -> int:
        """One expert's bytes over its blocks' rows, padding included: what a slot holds and a fetch copies."""
        return sum(self.row_bytes)

    def allocate(self, rows: int, device: torch.device, *, pin: bool = False) -> list[torch.Tensor]:
        """Empty blocks [rows, B_g] uint8, one per group."""
        return [torch.empty((rows, b), dtype=torch.uint8, device=device, pin_memory=pin) for b in self.row_bytes]

    def pack(self, parts: dict[str, torch.Tensor], *, pin: bool) -> list[torch.Tensor]:
        """Host blocks holding ``parts`` (CPU, contiguous; pinned already when ``pin``): a weight part's
        block is the part itself seen as bytes (no copy: it may be most of host memory); the small parts
        are copied into one new block (pinned when ``pin``)."""
        num = next(iter(parts.values())).shape[0]
        blocks: list[torch.Tensor | None] = [None] * len(self.row_bytes)
        for name, view in self.views.items():
            if name in _WEIGHT_PARTS:
                blocks[view.group] = parts[name].reshape(num, -1).view(torch.uint8)
        if None in blocks:
            shared = blocks.index(None)
            blocks[shared] = torch.zeros((num, self.row_bytes[shared]), dtype=torch.uint8, pin_memory=pin)
            typed = self.typed(blocks)
            for name, view in self.views.items():
                if view.group == shared:
                    typed[name].copy_(parts[name])
        return blocks

    def typed(self, blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each part as a typed view [rows, *shape] over ``blocks`` (no copy)."""
        out = {}
        for name, v in self.views.items():
            block = blocks[v.group]
            if _nbytes(v) == 0:  # an empty part (the what-if's weightless experts): nothing to view
                out[name] = block.new_empty((block.shape[0], *v.shape), dtype=v.dtype)
                continue
            out[name] = block[:, v.offset: v.offset + _nbytes(v)].view(v.dtype).view(block.shape[0], *v.shape)
        return out


def _row_nbytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _nbytes(v: PartView) -> int:
    count = 1
    for d in v.shape:
        count *= d
    return count * v.dtype.itemsize


def slots_device(device: torch.device | str) -> torch.device:
    """The device an ``ExpertCache``'s slots are allocated on. ``"cuda"`` where torch sees no GPU is refused naming
    the argument (a CPU build failed later, in ``torch.cuda.Stream``, with no word of ``device``)."""
    slots = torch.device(device)
    if slots.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r}: the expert cache's slots live on a CUDA GPU and this torch sees "
                           f"none (CUDA build: {torch.version.cuda is not None}); device='cpu' runs the same code "
                           "with the slots in host memory (a test: nothing crosses a link)")
    return slots
