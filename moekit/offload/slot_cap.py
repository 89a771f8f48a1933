"""An expert cache's slot count capped at the experts that can ever register: a slot no expert can fill is GPU
memory held for nothing (``ExpertCache`` allocates every slot at its first layer's registration)."""

from __future__ import annotations

import warnings


def cap_slots(slots: int, most: int, asked: str) -> int:
    """``slots``, or ``most`` (E for one layer's private cache, E x blocks for a model's) when ``slots`` is larger,
    with one warning that says what ``asked`` (the argument as the caller gave it) would have held. A ``slots`` that
    is no int is returned as it is, for ``ExpertCache`` to refuse by name."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots <= most:
        return slots
    warnings.warn(f"{asked} asks for {slots} expert slots, more than the {most} experts that can register: the cache "
                  f"holds {most} (every expert resident; the rest would be GPU memory held for nothing)", stacklevel=3)
    return most
