"""``CpuRate``: the CPU's seconds per missed expert, estimated online from the CPU branches that ran.

    per forward with CPU misses:  sample = (branch seconds - cpu_step_s - tokens x cpu_token_s) / experts
    estimate:                     the first sample, then estimate + weight x (sample - estimate)

The calibration measures the rate once, on cold experts; the host's rate then drifts (other work on
the machine, memory traffic from the link's copies, frequency): the cpu mode's branches ran 0.85-1.53x
the first calibration's model across one H200 benchmark run.
An ``OffloadedMoE`` given a ``CpuRate`` updates it after each CPU branch (``CpuPhases``) and "auto"
splits its next forward's misses with ``cpu_expert_s`` replaced by the estimate (``apply``); layers that
share one ``CpuRate`` share the estimate. The fixed step and per-token costs stay as calibrated: a
decode step's CPU experts are few tokens each, so the per-expert weight read is what drifts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moekit.offload.cost import MissCosts
from moekit.offload.cpu_path import CpuPhases


@dataclass
class CpuRate:
    """An exponential average of the measured CPU seconds per expert (module docstring)."""

    weight: float = 0.25  # how far one sample moves the estimate
    expert_s: float | None = None  # the estimate; None before the first sample
    samples: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")

    def update(self, phases: CpuPhases, costs: MissCosts) -> None:
        """Take one CPU branch's measured phases (``experts`` > 0), the fixed and per-token parts
        removed at ``costs``' calibrated values; a negative sample counts as 0."""
        if phases.experts < 1:
            raise ValueError(f"phases must cover at least one expert, got experts={phases.experts}")
        sample = max(0.0, (phases.total_s - costs.cpu_step_s - phases.tokens * costs.cpu_token_s) / phases.experts)
        self.expert_s = sample if self.expert_s is None else self.expert_s + self.weight * (sample - self.expert_s)
        self.samples += 1

    def apply(self, costs: MissCosts) -> MissCosts:
        """``costs`` with ``cpu_expert_s`` the estimate (unchanged before the first sample)."""
        return costs if self.expert_s is None else dataclasses.replace(costs, cpu_expert_s=self.expert_s)
