"""Two tensor ops of the offloaded forward: the expert counts (one histogram, read back to the host in one copy)
and the sum of the partial outputs (hits, fetched misses, CPU misses)."""

from __future__ import annotations

import torch


def expert_counts(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """[bins] float32: bin b counts the ids equal to b - 1 (ids in [-1, bins - 2]; -1, a dropped
    assignment, lands in bin 0). A histogram with fixed edges, each id mid-bin (exact in float32 for
    any id below 2**23): ``torch.bincount`` on CUDA reads the ids' min and max back to the host first,
    two more syncs per layer than the one the caller needs. Under ``torch.use_deterministic_algorithms``
    (where CUDA's histc raises, its float atomics being flagged) the counts come from bincount."""
    if torch.are_deterministic_algorithms_enabled():
        return torch.bincount(ids.long() + 1, minlength=bins)[:bins].float()
    return torch.histc(ids.float(), bins=bins, min=-1.5, max=bins - 1.5)


def sum_partials(partials: list[torch.Tensor], x2d: torch.Tensor) -> torch.Tensor:
    """The sum of the partial outputs in x2d's dtype, added in float32 and rounded once. Two partials
    take one add in their own dtype (its arithmetic is float32, rounded once: the same result); more
    accumulate in a float32 tensor."""
    if not partials:
        return torch.zeros_like(x2d)
    if len(partials) == 1:
        return partials[0]
    if len(partials) == 2:
        return partials[0] + partials[1]
    total = partials[0].float()
    for p in partials[1:]:
        total.add_(p)
    return total.to(x2d.dtype)
