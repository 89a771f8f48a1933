"""Argument checks shared by every public entry point: each raises a clear error that names the
argument and says what was expected. Python's bool is an int; none of these accept it as a number."""

from __future__ import annotations

import math
import reprlib
from typing import Any


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    """``value`` must be an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {reprlib.repr(value)}")  # a long string cut (a config's "2" * N)


def check_positive_finite(name: str, value: Any) -> None:
    """``value`` must be a finite real number (int or float, not a bool) > 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 and finite (an int or float), got {value!r}")


def check_renorm(renorm_eps: Any, renorm_clamp: Any, renormalize: bool) -> None:
    """``MoEConfig``'s renormalisation: eps (w / (sum + eps)) or clamp (w / max(sum, c)), finite and >= 0, not both.
    A clamp needs ``renormalize``: without it the weights are the scores, with no sum to clamp (an eps is left alone
    there: the readers keep a family's eps, DeepSeek-V3's 1e-20, whether or not its checkpoint renormalises)."""
    for name, value in (("renorm_eps", renorm_eps), ("renorm_clamp", renorm_clamp)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0 (0: the exact w / sum(w)), got {value!r}")
    if renorm_eps and renorm_clamp:  # one family's formula or the other
        raise ValueError(f"renorm_eps and renorm_clamp exclude each other, got {renorm_eps!r}, {renorm_clamp!r}")
    if renorm_clamp and not renormalize:
        raise ValueError(f"renorm_clamp clamps the renormalised weights' sum: it needs renormalize=True, got "
                         f"renorm_clamp={renorm_clamp!r} with renormalize=False")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_module(name: str, value: Any) -> None:
    """``value`` must be a torch ``nn.Module`` (a model or block; None and others read .modules() and failed there)."""
    import torch

    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    """``value`` must be one of ``allowed`` (an option's values, e.g. ``("sum", "average")``)."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def input_error(name: str, x: Any, hidden_size: int, rows: bool = False) -> Exception:
    """The error for a layer input ``x`` that is not a floating-point tensor [..., hidden_size] (``rows``: [M,
    hidden_size]); the caller tests the cheap conditions inline and builds this only to raise it."""
    import torch

    if not isinstance(x, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        return TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if rows:
        return ValueError(f"{name} must be [M, hidden_size={hidden_size}], got shape {tuple(x.shape)}")
    return ValueError(f"{name} must have last dim hidden_size={hidden_size}, got shape {tuple(x.shape)}")
