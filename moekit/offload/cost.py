"""Where a forward's missed experts are cheapest: copied over the host link to the GPU, computed on the
CPU, or split between the two.

    GPU side:  max(hits x read_one, F x fetch_one) + F x read_one      (the hits compute while the F
               (+ gpu_call_s with hits and F > 0)                      fetched misses travel; those
               at least hits x read_one + fetch_layer_s when F > 0     compute once they land, in a call
                                                                       of their own; at the link's rate
                                                                       during CPU work when the CPU side
                                                                       runs, ``fetch_rate``)
               or, where the hits' reads cost less than a second call (``one_call``): F x fetch_one +
               (hits + F) x read_one, one call for both once the fetches land (then never dearer)
    CPU side:  cpu_margin x (cpu_step_s + sum over the CPU misses e of cpu_time(tokens_e))
               + F x issue_s                                       (the CPU branch starts once the host
               (0 when no miss runs on the CPU: no staging either)  has issued the F fetches' copies)
    forward:   max(GPU side, CPU side)                                 (the two run at once)
    chosen by: forward + sum over the CPU experts of p x fetch_one     (they stay uncached: refetches;
                                                                       p: the chance one is touched again
                                                                       while cached, ``split_misses``)

``fetch_one`` = expert bytes / link rate, ``read_one`` = expert bytes / the GPU's read rate (infinite
by default: the GPU's share is then the link alone). The CPU computes its experts one after another,
each streaming its weights from host memory once (``cpu_expert_s``, measured on cold experts: a
warm expert repeated in a timing loop sits in the CPU's caches and looks 2-3x faster than a miss
really is) plus its tokens' FLOPs (``cpu_token_s``); ``cpu_step_s`` is the fixed price of any CPU
work in a forward: the inputs copied to the host, the host waiting for them, the CPU call's own
overhead, the result copied back. With ``cpu_rows_s`` (what ``calibrate`` measures) an expert's time is
read from a table by its row count instead of the line ``cpu_expert_s + tokens x cpu_token_s``; both are
fitted (``fit_cpu_grid``) to timings of the layer's whole CPU branch (``cpu_path.CpuPath``) on cold
experts over a grid of expert counts per call and rows per expert.

``cpu_margin`` (>= 1) prices the CPU side pessimistically: "auto" sends a miss to the CPU only where
the model promises a win even with the CPU side that much slower, and otherwise fetches. It comes from
measurement: the worst repeats over the medians of the calibration's own timings (``margin_of``), raised
by a benchmark to the ratio of the CPU branch's measured to predicted time on real steps
(``MissCosts.observed``). ``split_misses`` finds the split with the smallest cost exactly (not greedily),
and keeps it only where it beats fetching every miss (``gpu_only``) by ``hysteresis``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import torch

REFETCH = ("reuse", "hit_rate")  # per expert, by its reuse in the cache's history; session 8's: this forward's hit rate


_FOR_PLAN: list = [None, None]  # ``MissCosts.for_plan``'s latest (costs, answer)


@dataclass(frozen=True)
class MissCosts:
    """The rates the split decides by (seconds, bytes per second)."""

    link_bytes_per_s: float  # host -> GPU copy rate from pinned memory, large copies
    cpu_expert_s: float  # CPU seconds per cold expert computed, whatever its tokens (its weights read once)
    cpu_token_s: float  # CPU seconds per routed token of an expert, on top
    cpu_step_s: float = 0.0  # CPU seconds per forward that computes any miss on the CPU (staging, sync)
    gpu_bytes_per_s: float = math.inf  # the GPU's expert read rate (hits and fetched misses computed)
    cpu_margin: float = 1.0  # the CPU side is priced at this multiple of its model (module docstring)
    cpu_threads: int | None = None  # torch threads the CPU costs were measured at (and layers run at)
    cpu_gemm: str | None = None  # the CPU GEMM they were measured with (``cpu_path.CPU_GEMMS``; likewise)
    refetch: str = "reuse"  # how a CPU expert's later refetch is priced (``REFETCH``; ``split_misses``)
    link_cpu_bytes_per_s: float | None = None  # the link's rate while the CPU branch computes (None: unknown)
    # a split with CPU experts must cost this fraction less than fetching all (``split_misses``)
    hysteresis: float = 0.0
    # (rows, CPU seconds per expert at that many rows), rows ascending (``cpu_time``)
    cpu_rows_s: tuple[tuple[int, float], ...] = ()
    # a second GPU experts call: a forward with hits and fetched misses makes two (``gpu_side_s``)
    gpu_call_s: float = 0.0
    fetch_layer_s: float = 0.0  # the least a forward with any fetch takes over an all-hit one (``gpu_side_s``)
    issue_s: float = 0.0  # host seconds to issue one fetched expert's copies, before the CPU branch can start
    # what a CPU branch adds on average over its model (``cpu_side_s``): its rare stalls, priced by "auto" on every
    # split's CPU side (``for_plan``), never by the floor (the model of what a step cannot beat)
    cpu_tail_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cpu_margin >= 1.0:
            raise ValueError(f"cpu_margin must be >= 1, got {self.cpu_margin!r}")
        if not self.gpu_call_s >= 0.0:
            raise ValueError(f"gpu_call_s must be >= 0, got {self.gpu_call_s!r}")
        if not self.fetch_layer_s >= 0.0:
            raise ValueError(f"fetch_layer_s must be >= 0, got {self.fetch_layer_s!r}")
        if not self.issue_s >= 0.0:
            raise ValueError(f"issue_s must be >= 0, got {self.issue_s!r}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis!r}")
        if self.refetch not in REFETCH:
            raise ValueError(f"refetch must be one of {REFETCH}, got {self.refetch!r}")
        rows = [r for r, _ in self.cpu_rows_s]
        if any(not isinstance(r, int) or r < 1 for r in rows) or rows != sorted(set(rows)) or any(
                not s >= 0.0 for _, s in self.cpu_rows_s):
            raise ValueError(f"cpu_rows_s must be (rows >= 1, seconds >= 0) pairs, rows strictly ascending, "
                             f"got {self.cpu_rows_s!r}")

    def cpu_time(self, tokens: int) -> float:
        """CPU seconds of one expert with ``tokens`` routed assignments (rows; without ``cpu_step_s``):
        with ``cpu_rows_s``, linear between its points, its first point's time below them, its last
        segment extended above (never below the last point's time; a one-point table adds ``cpu_token_s``
        a row above its point); else ``cpu_expert_s + tokens x cpu_token_s``."""
        table = self.cpu_rows_s
        if not table:
            return self.cpu_expert_s + tokens * self.cpu_token_s
        r0, s0 = table[0]
        if tokens <= r0:
            return s0
        if len(table) == 1:
            return s0 + (tokens - r0) * self.cpu_token_s
        for (r0, s0), (r1, s1) in zip(table, table[1:]):
            if tokens <= r1:
                return s0 + (s1 - s0) * (tokens - r0) / (r1 - r0)
        return max(s1, s1 + (s1 - s0) * (tokens - r1) / (r1 - r0))

    def scaled(self, factor: float) -> "MissCosts":
        """These costs with the whole CPU side (``cpu_step_s``, per expert, per token, ``cpu_rows_s``)
        ``factor`` times as long: the host's drift (``calibrate.recalibrate_cpu``, ``online.CpuRate``)."""
        if not factor > 0.0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        return dataclasses.replace(self, cpu_step_s=self.cpu_step_s * factor, cpu_expert_s=self.cpu_expert_s * factor,
                                   cpu_token_s=self.cpu_token_s * factor,
                                   cpu_rows_s=tuple((r, s * factor) for r, s in self.cpu_rows_s))

    def cpu_side_s(self, tokens: list[int]) -> float:
        """Predicted CPU seconds of a forward computing experts with these token counts on the CPU (0 for
        none), without the margin."""
        return self.cpu_step_s + sum(self.cpu_time(t) for t in tokens) if tokens else 0.0

    def for_plan(self) -> "MissCosts":
        """These costs as "auto" decides by: ``cpu_tail_s`` moved into ``cpu_step_s``, so every price of a CPU
        side (the split's search, its bounds, ``cpu_never_wins``) holds it; the same object where it is 0, and
        the same answer for the same costs again (one entry kept: every forward asks)."""
        if self.cpu_tail_s == 0.0:
            return self
        if _FOR_PLAN[0] is not self:
            tailed = dataclasses.replace(self, cpu_step_s=self.cpu_step_s + self.cpu_tail_s, cpu_tail_s=0.0)
            _FOR_PLAN[:] = [self, tailed]
        return _FOR_PLAN[1]

    def observed(self, measured_s: float, predicted_s: float) -> "MissCosts":
        """These costs with ``cpu_margin`` raised to ``measured_s / predicted_s`` (the CPU branch's real
        time on steps against ``cpu_side_s`` of the same steps) if that is larger."""
        ratio = measured_s / predicted_s if predicted_s > 0 else 1.0
        return dataclasses.replace(self, cpu_margin=max(self.cpu_margin, ratio))


@dataclass(frozen=True)
class MissSplit:
    """Which missed experts go where, and the predicted time of each side."""

    fetch: list[int]  # experts copied to the GPU
    cpu: list[int]  # experts computed on the CPU
    gpu_s: float  # predicted GPU side: the hits and ``fetch`` (their copies, then their compute)
    cpu_s: float  # predicted CPU side: ``cpu_step_s`` and each of ``cpu``, times ``cpu_margin``, after ``fetch``'s
    # issue (``issue_s`` each; 0: ``cpu`` empty)
    link_s: float  # the link's busy time for ``fetch`` alone
    refetch_s: float = 0.0  # the expected later cost of leaving ``cpu`` uncached (``split_misses``)

    @property
    def step_s(self) -> float:
        """The forward's predicted time: both sides run at once."""
        return max(self.gpu_s, self.cpu_s)

    @property
    def cost_s(self) -> float:
        """What the split is chosen by: the forward's time and the refetches it leaves to later forwards."""
        return self.step_s + self.refetch_s


def one_call(hits: int, expert_bytes: int, costs: MissCosts) -> bool:
    """Whether a forward with ``hits`` cached experts and fetches computes them all in one experts call
    once the fetches land, rather than the hits first (while the copies travel) and the fetched ones in a
    second call: where the hits' reads take less than that second call (``gpu_call_s``, measured; never
    with its default 0), overlapping them cannot win back the call (a decode step's few rows: the call's
    launches, not the reads, cost; with no hits there is one call anyway). Then the one call costs
    min(F x fetch_one, hits x read_one) - gpu_call_s < 0 more than two, whatever F."""
    return hits * expert_bytes / costs.gpu_bytes_per_s < costs.gpu_call_s


def gpu_side_s(hits: int, fetched: int, expert_bytes: int, costs: MissCosts, cpu_busy: bool = False) -> float:
    """Predicted GPU seconds of ``hits`` cached experts and ``fetched`` fetched ones (module docstring),
    plus ``gpu_call_s`` when there are both (the fetched experts' own call, once they land; or one call
    for both after the fetches where ``one_call`` says so), and with any fetch at least the hits' reads
    and ``fetch_layer_s`` (what a forward with one fetch took over an all-hit one, measured: its copy's
    latency, its bookkeeping and calls, whatever the link's rate);
    ``cpu_busy``: the CPU computes misses meanwhile, so the fetches travel at ``fetch_rate``'s busy rate."""
    read_one, link = expert_bytes / costs.gpu_bytes_per_s, fetched * expert_bytes / fetch_rate(costs, cpu_busy)
    if one_call(hits, expert_bytes, costs):
        side = link + (hits + fetched) * read_one
    else:
        side = max(hits * read_one, link) + fetched * read_one + (costs.gpu_call_s if hits and fetched else 0.0)
    return max(side, hits * read_one + costs.fetch_layer_s) if fetched else side


def fetch_rate(costs: MissCosts, cpu_busy: bool) -> float:
    """Bytes/s a fetch travels at: ``link_cpu_bytes_per_s`` while the CPU computes misses (host memory
    serves both; when measured), else ``link_bytes_per_s``."""
    return (costs.link_cpu_bytes_per_s or costs.link_bytes_per_s) if cpu_busy else costs.link_bytes_per_s


def gpu_only(tokens: dict[int, int], expert_bytes: int, costs: MissCosts, hits: int = 0) -> MissSplit:
    """Every miss of ``tokens`` fetched (what "gpu" does), priced as ``split_misses`` prices a split: no
    CPU side, so the link at its idle rate and nothing left uncached."""
    fetched = len(tokens)
    return MissSplit(sorted(tokens), [], gpu_side_s(hits, fetched, expert_bytes, costs), 0.0,
                     fetched * expert_bytes / costs.link_bytes_per_s)


def cpu_never_wins(touched: int, rows: int, expert_bytes: int, costs: MissCosts) -> bool:
    """True when ``split.cpu_room`` finds no room for every forward of at most ``touched`` experts with at most
    ``rows`` rows an expert (a batch of M tokens: touched <= min(M x top-k, E), rows <= M): whatever its
    hits and misses, "auto" fetches every miss, as "gpu" does. Sufficient, not necessary: the CPU side's
    least price, ``cpu_margin`` x (``cpu_step_s`` + the least ``cpu_time`` over 1..``rows`` rows: at 1, at
    ``rows`` or at a table point between, ``cpu_time`` being linear between them), against an upper bound
    of ``gpu_only``'s cost over every split of ``touched`` into hits and F >= 1 fetches: T x read_one plus
    the larger of ``fetch_layer_s`` and T x fetch_one + ``gpu_call_s`` (``gpu_side_s`` is a max of such
    terms, each at most its value at T). O(table): "auto" asks it once per costs and M, not per forward."""
    if touched < 1 or rows < 1:
        return True
    points = {1, rows} | {r for r, _ in costs.cpu_rows_s if r <= rows}
    cpu_least = costs.cpu_margin * (costs.cpu_step_s + min(costs.cpu_time(r) for r in points))
    read_one, fetch_one = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    fetch_all = touched * read_one + max(costs.fetch_layer_s, touched * fetch_one + costs.gpu_call_s)
    return cpu_least > (1.0 - costs.hysteresis) * fetch_all


def fit_cpu_grid(timings: dict[tuple[int, int], float]) -> tuple[float, dict[int, float]]:
    """(seconds per CPU call, {rows: seconds per expert at that many rows}) fitted by least squares of the
    relative error to branch timings {(experts, rows each): seconds} (> 0), the model being time = call +
    experts x per_expert[rows] (one call cost shared by every row count, each row count its own
    per-expert slope): relative, so a one-expert call (a decode step's usual CPU call) weighs as much as
    a 32-expert one. Each row count needs two expert counts. The call cost is clamped at 0 (then the
    slopes refitted through the origin), a slope at 0."""
    rows = sorted({r for _, r in timings})
    for r in rows:
        if len({n for n, rr in timings if rr == r}) < 2:
            raise ValueError(f"fit_cpu_grid needs two expert counts at every row count, rows={r} has "
                             f"{sorted(n for n, rr in timings if rr == r)}")
    points = sorted(timings.items())
    if any(not t > 0.0 for _, t in points):
        raise ValueError(f"fit_cpu_grid needs timings > 0, got {dict(points)}")
    design = torch.tensor([[1.0 / t] + [n / t if r == rr else 0.0 for rr in rows] for (n, r), t in points],
                          dtype=torch.float64)  # each row divided by its timing: relative residuals
    target = torch.ones((len(points), 1), dtype=torch.float64)
    fit = torch.linalg.lstsq(design, target).solution.reshape(-1).tolist()
    if fit[0] < 0.0:
        fit = [0.0] + torch.linalg.lstsq(design[:, 1:], target).solution.reshape(-1).tolist()
    return fit[0], {r: max(s, 0.0) for r, s in zip(rows, fit[1:])}


def margin_of(timings: list[list[float]]) -> float:
    """Groups of repeated timings (one call each) -> the sum of each group's worst repeat over the sum of
    its medians (at least 1): how much slower than the fitted medians the branch ran, weighted by time,
    so one outlier in a short timing does not set it alone."""
    groups = [t for t in timings if t]
    medians = sum(statistics.median(t) for t in groups)
    return max(1.0, sum(max(t) for t in groups) / medians) if medians > 0 else 1.0
