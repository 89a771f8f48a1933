"""The CPU's rate among a group's steps: a probe of the CPU branch on cold experts right after the turn
of a run that computes on the CPU (one probe per such run), that run's floor's CPU side scaled by it.

    per timed step:  one branch of n cold experts x r rows (the run's mean CPU branch in the replay),
                     the link idle on even steps and busy (``link_busy``) on odd ones
    scale(state):    sum of its measured seconds / sum of the model's (``MissCosts.cpu_side_s``) for the
                     same work, per link state

Why among the steps and not before them: the recalibration before each group (``calibrate.recalibrate_cpu``,
8 and 32 experts a call, link busy, three rounds) read 1.7-4.6x the calibration in the first groups of one
H200 run (c5d7ce5) and 0.86-0.98x in later ones, while the cpu mode's own branches ran 1.4-2.7x and
0.64-0.76x: the host's rate moves within a minute, the pre-group sample is a few calls at one moment, and
its shape (8-32 experts, link busy) is not a decode step's (1-6 experts a layer at M = 1, the link
mostly idle: a cpu-mode layer queues only its admissions). The probe's work is the run's own shape at
the same moments as its steps (the all-hit reference does the same for the fixed cost, ``offload_cells``);
its experts are cold (consecutive probes share none while 2n <= E), as the calibration's, so it is no fit of the
cells' steps. Right after the run's turn: its host state (threads awake, caches holding other experts)
is that run's own, and the carry-over design of the turns is kept (every stack still follows it, probe
included, equally often).

The floor prices a layer's CPU branch at the busy rate while the link moves that layer's fetches and
admissions, at the idle rate after (``offload_floor.timeline_s``'s ``idle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moekit.offload import MissCosts, OffloadedMoE
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CPU_GEMMS

STATES = ("idle", "busy")


@dataclass
class CpuProbe:
    """One group's probe (module docstring); ``run`` once per timed step."""

    layer: OffloadedMoE  # whose host weights and CPU path the branch runs (a 1-slot cache: never read)
    costs: MissCosts  # the model its timings are set against (the group's costs)
    experts: int  # CPU experts a probe call computes
    rows: int  # rows each
    start: int = 0  # the first cold-expert group
    samples: dict = field(default_factory=lambda: {s: [] for s in STATES})  # state -> [(measured s, model s)]

    def __post_init__(self) -> None:
        if self.experts < 1 or self.rows < 1:
            raise ValueError(f"a probe needs experts >= 1 and rows >= 1, got {self.experts}, {self.rows}")
        k = max(self.layer.config.top_k, 2)
        self._groups = cold_groups(self.layer.config.num_experts, max(self.experts, k), self.start)
        self._size = max(self.experts, k)

    def run(self, step: int, rows: list[int] | None = None) -> None:
        """Time one branch: the link idle on even ``step``s, busy on odd ones; its work ``rows`` (one count
        per CPU expert: the run's latest CPU branch, so the probe prices the work the floor prices) or
        else the probe's shape, on cold experts."""
        state = STATES[step % 2]
        threads, gemm = self.costs.cpu_threads, self.costs.cpu_gemm or CPU_GEMMS[0]
        rows = list(rows) if rows else [self.rows] * self.experts
        k = max(self.layer.config.top_k, 2)
        group = next(self._groups)
        if len(group) < max(len(rows), k):  # a wider branch than the shape: a group of its own width
            group = next(cold_groups(self.layer.config.num_experts, max(len(rows), k), self.start + step))
        seconds = branch(self.layer, group[:max(len(rows), k)], len(rows), 1, threads, gemm, busy=state == "busy",
                         rows=rows)
        self.samples[state].append((seconds, self.costs.cpu_side_s(rows)))

    def scale(self, state: str) -> float | None:
        """Measured over modelled seconds of the ``state`` probes (a ratio of sums); None without any."""
        got = self.samples[state]
        model = sum(m for _, m in got)
        return sum(t for t, _ in got) / model if got and model > 0 else None

    def floor_costs(self) -> tuple[MissCosts, MissCosts | None]:
        """(the CPU model with the link busy, with it idle) for the floor: ``costs`` scaled by each state's
        probes; a state without probes takes the other's scale (both missing: ``costs`` and None)."""
        busy, idle = self.scale("busy"), self.scale("idle")
        busy = busy if busy is not None else idle
        idle = idle if idle is not None else busy
        if busy is None:
            return self.costs, None
        return self.costs.scaled(busy), self.costs.scaled(idle)

    def summary(self) -> dict:
        """The row's fields: each state's scale and probe count, the probe's shape."""
        return {"probe_busy": self.scale("busy") or 0.0, "probe_idle": self.scale("idle") or 0.0,
                "probes": len(self.samples["busy"]) + len(self.samples["idle"]),
                "probe_shape": f"{self.experts}x{self.rows}"}


def probe_shape(cpu_experts: int, cpu_tokens: int, forwards: int) -> tuple[int, int]:
    """(experts, rows) of a probe call: the mean CPU experts of a forward with CPU work (``forwards`` of
    them) and their mean rows, rounded, at least 1."""
    experts = max(1, round(cpu_experts / forwards)) if forwards else 1
    return experts, max(1, round(cpu_tokens / cpu_experts)) if cpu_experts else 1
