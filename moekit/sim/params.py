"""``SimParams``: one simulator run's settings, their defaults (the lesson's) and their limits.

The CLI, the JSON API and the page share these names, defaults and bounds; every bound is checked in
``__post_init__`` with a message that names the parameter, so the server can answer 400 with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

BALANCE_METHODS = ("none", "aux-loss", "bias")

# name -> (min, max), inclusive; bounds keep one run well under a second on a laptop CPU.
LIMITS: dict[str, tuple[float, float]] = {
    "experts": (2, 512),
    "top_k": (1, 16),
    "tokens": (1, 4096),
    "capacity_factor": (0.01, 64.0),
    "skew": (0.0, 1.0),
    "seed": (0, 2**31 - 1),
    "gpus": (1, 512),
    "spare_slots": (0, 512),
    "aux_steps": (0, 1000),
    "bias_batches": (0, 2000),
}


@dataclass(frozen=True)
class SimParams:
    """Settings of one run. Defaults are the lesson's "Try it" simulator (balancing off)."""

    experts: int = 64  # E
    top_k: int = 2  # k
    tokens: int = 128  # M, tokens in the batch
    capacity_factor: float = 1.25  # capacity C = ceil(cf·M·k/E) per expert
    skew: float = 0.55  # router skew in [0, 1], see moekit.sim.router
    balance: str = "none"  # "none", "aux-loss" or "bias"
    seed: int = 5
    gpus: int = 8  # G, for the expert-parallel what-if
    spare_slots: int = 8  # redundant expert slots EPLB may fill with replicas
    aux_steps: int = 100  # Adam steps of aux-loss training
    bias_batches: int = 200  # batches of DeepSeek bias updates

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in LIMITS:
                _check_range(f.name, getattr(self, f.name), f.type == "int")
        if self.balance not in BALANCE_METHODS:
            raise ValueError(f"balance must be one of {', '.join(BALANCE_METHODS)}; got {self.balance!r}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k must be <= experts ({self.experts}); got {self.top_k}")
        if self.gpus > self.experts:
            raise ValueError(f"gpus must be <= experts ({self.experts}); got {self.gpus}")
        if self.spare_slots > self.experts * (self.gpus - 1):
            raise ValueError(
                f"spare_slots must be <= experts·(gpus-1) = {self.experts * (self.gpus - 1)} "
                f"(an expert has at most one replica per GPU); got {self.spare_slots}"
            )

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "SimParams":
        """Parse query-string values; unknown names and unparsable numbers raise ``ValueError``."""
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown parameter(s): {', '.join(unknown)}; expected some of {', '.join(known)}")
        parsed: dict[str, Any] = {}
        for name, text in values.items():
            kind = known[name]
            try:
                parsed[name] = int(text) if kind == "int" else float(text) if kind == "float" else text
            except ValueError:
                raise ValueError(f"{name} must be {'an integer' if kind == 'int' else 'a number'}; "
                                 f"got {text!r}") from None
        return cls(**parsed)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_range(name: str, value: Any, integer: bool) -> None:
    lo, hi = LIMITS[name]
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or (integer and not isinstance(value, int)) or value != value:
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}; got {value!r}")
    if not lo <= value <= hi:
        bounds = f"[{lo}, {hi}]" if integer else f"[{lo:g}, {hi:g}]"  # an int bound whole (seed's 2147483647)
        raise ValueError(f"{name} must be in {bounds}; got {value!r}")
