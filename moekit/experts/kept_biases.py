"""The expert biases a kept eager call was made with (``triton_fast``'s and ``triton_quant_fast``'s entries): held
weakly, as the weights are, with what a replay must find unchanged.

    kept:  b13 [E, 2N] | None, b2 [E, K] | None (weak references), and each one's data_ptr, shape, strides, dtype
           and _version when kept (as the weights' state, ``triton_fast._weight_state``, plus the version)
    holds: the call's b13 and b2 are those objects (None where the entry had none) in that state: a new tensor, a
           move, ``.data`` swapped or an in-place update (the version moves) each misses; the full path then runs
           and keeps the call again

Unlike a weight's, a bias's in-place update misses: a replay never runs on bias values other than those of a call
the full path ran (the kernels would read the new ones; the miss costs one full call).
"""

from __future__ import annotations

import weakref

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _none() -> None:
    return None


def _state(bias: torch.Tensor | None) -> tuple | None:
    """What a replay compares: a move or ``.data`` swapped (address, shape, strides, dtype; a ``.data`` swap leaves the
    version as it was), an in-place update (the version). Not the device: the address tells a move apart, as for the
    weights."""
    if bias is None:
        return None
    return bias.data_ptr(), bias.shape, bias.stride(), bias.dtype, bias._version


class KeptBiases:
    """b13 and b2 of a kept call, weakly, with their state then."""

    __slots__ = ("b13", "b2", "state")

    def __init__(self, b13: torch.Tensor | None, b2: torch.Tensor | None) -> None:
        self.b13 = _none if b13 is None else weakref.ref(b13)
        self.b2 = _none if b2 is None else weakref.ref(b2)
        self.state = (_state(b13), _state(b2))

    def holds(self, b13: torch.Tensor | None, b2: torch.Tensor | None) -> bool:
        """Whether ``b13`` and ``b2`` are the kept ones, unchanged (see the module)."""
        return self.b13() is b13 and self.b2() is b2 and self.state[0] == _state(b13) and self.state[1] == _state(b2)


def keepable(b13: torch.Tensor | None, b2: torch.Tensor | None) -> bool:
    """Whether a call's biases can be kept: plain tensors with a version counter (not inference-mode ones), contiguous
    (the kernels read them so; a strided one is copied per call), needing no gradient where autograd records."""
    grad = torch.is_grad_enabled()
    for bias in (b13, b2):
        if bias is not None and (bias.__class__ not in _PLAIN or bias.is_inference() or not bias.is_contiguous()
                                 or (grad and bias.requires_grad)):
            return False
    return True


def kept_biases(b13: torch.Tensor | None, b2: torch.Tensor | None) -> KeptBiases | None:
    """What an entry keeps of its call's biases: None where it has none."""
    return None if b13 is None and b2 is None else KeptBiases(b13, b2)


def fits(kept: KeptBiases | None, b13: torch.Tensor | None, b2: torch.Tensor | None) -> bool:
    """Whether a call with ``b13`` / ``b2`` may replay an entry that kept ``kept`` (``kept_biases``'s)."""
    if kept is None:
        return b13 is None and b2 is None
    if torch.is_grad_enabled() and ((b13 is not None and b13.requires_grad) or (b2 is not None and b2.requires_grad)):
        return False
    return kept.holds(b13, b2)
