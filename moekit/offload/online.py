"""``CpuRate``: how much slower (or faster) than its calibrated model the CPU branch runs now, estimated
online from the CPU branches that ran.

    per forward with CPU misses:  sample = branch seconds / MissCosts.cpu_side_s(its experts' rows),
                                  clipped to [estimate / clip, estimate x clip]
    estimate:                     estimate + weight x (sample - estimate), from 1 (the calibrated model)

The calibration measures the branch once, on cold experts (``calibrate.measure_costs``: a call cost
and a per-expert time at each row count); the host's rate then drifts (other work on the machine,
memory traffic from the link's copies, frequency): the cpu mode's branches ran 0.85-1.53x the first
calibration's model across one H200 benchmark run. An ``OffloadedMoE`` given a ``CpuRate`` updates
it after each CPU branch (``CpuPhases``) and "auto" splits its next forward's misses with the whole
CPU model scaled by the estimate (``apply``: ``MissCosts.scaled``), the same model the benchmark's
floor prices the CPU by; layers that share one ``CpuRate`` share the estimate.

The estimate starts at the calibration (1), not at the first sample: one H200 run's first CPU branch of
a bench cell ran 1.4-5x its model at M = 32 (compute alone; the same cells' later branches mostly 0.8-1.3x), and
taken whole it priced that cell's CPU side up to 2x for the rest of the run. A sample is clipped to
``clip`` (2) times the estimate either way: single branches ran 6-17x their model in one H200 run (a
thread team stalled), and one such sample taken whole moved the estimate 1.5-4x, so "auto" fetched
what it should have split for many forwards after; a lasting change still moves it (x1.25 a sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moekit.offload.cost import MissCosts
from moekit.offload.cpu_path import CpuPhases


@dataclass
class CpuRate:
    """An exponential average of the CPU branch's measured over modelled time (module docstring)."""

    weight: float = 0.25  # how far one sample moves the estimate
    clip: float | None = 2.0  # a sample is taken at most this many times the estimate, at least 1 / it (None: whole)
    scale: float | None = None  # the estimate; None before the first sample (then 1: the calibrated model)
    samples: int = 0
    _last: tuple = field(default=(), repr=False, compare=False)  # (costs, scale, scaled): ``apply``'s latest answer

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")
        if self.clip is not None and not self.clip >= 1.0:
            raise ValueError(f"clip must be >= 1 or None, got {self.clip!r}")

    def update(self, phases: CpuPhases, costs: MissCosts, rows: list[int]) -> None:
        """Take one CPU branch's measured phases and its experts' rows (one count per CPU expert, at
        least one), against ``costs``' calibrated model of that work; a model of 0 s gives no sample."""
        if not rows:
            raise ValueError("rows must hold one count per CPU expert, got none")
        model = costs.cpu_side_s(rows)
        if model <= 0.0:
            return
        prior = 1.0 if self.scale is None else self.scale
        sample = phases.total_s / model
        if self.clip is not None:
            sample = min(max(sample, prior / self.clip), prior * self.clip)
        self.scale = prior + self.weight * (sample - prior)
        self.samples += 1

    def apply(self, costs: MissCosts) -> MissCosts:
        """``costs`` with the CPU side scaled by the estimate (unchanged before the first sample). Asked
        again with the same costs and estimate (every forward between CPU branches, every layer sharing
        the rate), the same answer without building it again (a decode step's host time is the step)."""
        if self.scale is None or self.scale <= 0.0:
            return costs
        if self._last and self._last[0] is costs and self._last[1] == self.scale:
            return self._last[2]
        scaled = costs.scaled(self.scale)
        self._last = (costs, self.scale, scaled)
        return scaled
