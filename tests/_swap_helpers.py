"""What the ``use_moekit_blocks`` tests read of a swapped model: its blocks' swaps, and a count of their MoE calls."""

from __future__ import annotations

from moekit.hf.swap import SWAP_ATTR


def swaps(model) -> list:
    """Every swapped block's ``BlockSwap``, in module order."""
    return [m.__dict__[SWAP_ATTR] for m in model.modules() if SWAP_ATTR in m.__dict__]


def count_moe_calls(model) -> list:
    """A list that grows by one per swapped block's MoE call (its forward and traced_forward, a compiled block's
    call, wrapped on the instance)."""
    calls = []
    for swap in swaps(model):
        for name in ("forward", "traced_forward"):
            fn = getattr(swap.moe, name)
            setattr(swap.moe, name, lambda x, *a, _f=fn, **k: calls.append(1) or _f(x, *a, **k))
    return calls
