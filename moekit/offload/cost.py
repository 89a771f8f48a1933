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
    hysteresis: float = 0.0  # a split with CPU experts must cost this fraction less than fetching all (``split_misses``)
    cpu_rows_s: tuple[tuple[int, float], ...] = ()  # (rows, CPU seconds per expert at that many rows), rows ascending (``cpu_time``)
    gpu_call_s: float = 0.0  # a second GPU experts call: a forward with hits and fetched misses makes two (``gpu_side_s``)
    fetch_layer_s: float = 0.0  # the least a forward with any fetch takes over an all-hit one (``gpu_side_s``)
    issue_s: float = 0.0  # host seconds to issue one fetched expert's copies, before the CPU branch can start

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


def split_misses(tokens: dict[int, int], expert_bytes: int, costs: MissCosts, hits: int = 0,
                 reuse: dict[int, float] | None = None) -> MissSplit:
    """The split of the missed experts (``tokens``: expert -> its routed assignments in this forward;
    ``hits``: cached experts the GPU computes meanwhile) with the smallest ``cost_s``: the predicted
    forward time plus, for each expert left on the CPU (not cached), one fetch times p, its chance of
    being touched again while a fetched copy would still be cached (a refetch, deferred to later).

    p: with ``costs.refetch == "reuse"`` and ``reuse`` (expert -> its chance, ``ExpertCache.reuse``),
    the mean over the expert's class among these misses, the classes being "likely reused" (p >= 1/2,
    and an infinite p: a cache that has not yet evicted, where a CPU-kept expert misses at every later
    touch, so no miss goes to the CPU) and "likely evicted first" (below); otherwise (``"hit_rate"``,
    session 8's, or no ``reuse``) h = hits / touched this forward for every miss. With h, a 75% cache
    at M = 1 on the H200 (still filling after the bench's 61 steps) kept a few hot experts on the CPU
    step after step: 0.03 less hit rate and 1.09-1.15x the pure fetch's step.

    Exact: within a class every expert costs the same to fetch and to leave uncached, so the best split
    with a of one class and b of the other on the CPU takes the a and b with the least CPU time
    (``cpu_time``: by rows, not always the fewest rows when a measured table is not monotone); for a
    fixed b the cost is convex in a (the GPU side falls linearly with fewer fetches under a max, the
    CPU side adds ever dearer experts, less one fetch's ``issue_s`` each), so its leftmost minimum is found by bisection, for every b. The
    one exception, a second GPU call (``gpu_call_s``) saved when no miss is fetched at all, is the
    last point of the last run: it is priced on its own; so is it where ``fetch_layer_s`` (the least a
    forward with any fetch takes) falls away with the last fetch. Ties go to fewer CPU experts, then fewer
    likely-reused ones.

    Hysteresis: the best split with CPU experts is taken only where it costs at most (1 -
    ``costs.hysteresis``) x ``gpu_only``'s; otherwise every miss is fetched. The model's differences of
    a few percent are within its error (the CPU rate drifts by tens of percent over a run), and a decision flipping
    on them sends a hot expert to the CPU one step and over the link the next."""
    fetch_all = gpu_only(tokens, expert_bytes, costs, hits)
    if cpu_cannot_win(tokens, fetch_all.cost_s, costs):
        return fetch_all
    fetch_one = expert_bytes / costs.link_bytes_per_s
    touched = hits + len(tokens)
    chance = {e: (reuse[e] if reuse is not None and costs.refetch == "reuse" else hits / touched) for e in tokens}
    times = {t: costs.cpu_time(t) for t in set(tokens.values())}  # by rows: a few distinct counts
    classes = [sorted((e for e in tokens if (chance[e] >= 0.5) == hot), key=lambda e: (times[tokens[e]], tokens[e], e))
               for hot in (False, True)]
    charge = [fetch_one * sum(chance[e] for e in c) / len(c) if c else 0.0 for c in classes]
    prices = _Prices(len(tokens), costs, *[_cumulative([times[tokens[e]] for e in c]) for c in classes], *charge,
                     hits, expert_bytes)
    drop = (hits > 0 and costs.gpu_call_s > 0) or costs.fetch_layer_s > 0  # fetching nothing saves a step
    found = _cheapest(prices.cost, len(classes[0]), len(classes[1]), drop, fetch_all.cost_s, prices.bound_or_none())
    if found is None:
        return fetch_all
    a, b = found
    on_cpu, fetched = classes[0][:a] + classes[1][:b], len(tokens) - a - b
    best = MissSplit(sorted(classes[0][a:] + classes[1][b:]), sorted(on_cpu), *prices.sides(a, b),
                     fetched * expert_bytes / fetch_rate(costs, True), prices.refetch(a, b))
    return best if best.cost_s <= (1.0 - costs.hysteresis) * fetch_all.cost_s else fetch_all


@dataclass(frozen=True)
class _Prices:
    """``split_misses``' prices of a of the first class and b of the second on the CPU (a + b >= 1), from the
    classes' cumulative CPU times (``cum0``, ``cum1``), their per-expert refetch charges and the GPU side by
    fetch count (``gpu_side_s`` with ``hits``, CPU busy; priced once per fetch count the search probes);
    plain floats, no MissSplit built per probe."""

    n: int  # misses
    costs: MissCosts
    cum0: list[float]
    cum1: list[float]
    charge0: float
    charge1: float
    hits: int
    expert_bytes: int
    gpu: dict = dataclasses.field(default_factory=dict)  # fetches -> GPU side, as probed

    def sides(self, a: int, b: int) -> tuple[float, float]:
        """(GPU side, CPU side)."""
        c, f = self.costs, self.n - a - b
        if f not in self.gpu:
            self.gpu[f] = gpu_side_s(self.hits, f, self.expert_bytes, c, True)
        return self.gpu[f], c.cpu_margin * (c.cpu_step_s + self.cum0[a] + self.cum1[b]) + (
            self.n - a - b) * c.issue_s

    def refetch(self, a: int, b: int) -> float:
        return (a * self.charge0 if a else 0.0) + (b * self.charge1 if b else 0.0)

    def cost(self, a: int, b: int) -> float:
        """``MissSplit.cost_s`` of the split, without building it."""
        gpu_s, cpu_s = self.sides(a, b)
        return (gpu_s if gpu_s > cpu_s else cpu_s) + self.refetch(a, b)

    def bound(self, b: int) -> float:
        """A lower bound of ``cost(a, b)`` over every a: its CPU side and refetch at a = 0, less every first-class
        expert's issue (a's CPU time and refetch are >= 0, each of its experts takes one issue off)."""
        c = self.costs
        return c.cpu_margin * (c.cpu_step_s + self.cum1[b]) + (self.n - (len(self.cum0) - 1) - b) * c.issue_s + (
            b * self.charge1 if b else 0.0)

    def bound_or_none(self):
        """``bound``, where it is nondecreasing in b: its steps are the second class's CPU times (ascending)
        at the margin plus its charge less one issue, so from the least step on; else None."""
        least = self.costs.cpu_margin * (self.cum1[1] if len(self.cum1) > 1 else 0.0) + self.charge1
        return self.bound if least >= self.costs.issue_s else None


def _cheapest(cost, n0: int, n1: int, drop: bool, fetch_all_s: float, bound=None) -> tuple[int, int] | None:
    """``split_misses``' search: the cheapest (a, b) by ``cost(a, b)`` over a <= n0, b <= n1 (a + b >= 1), None
    where fetching every miss (``fetch_all_s``) costs no more; by bisection on each b's convex run of a;
    ``drop``: fetching nothing saves a second GPU call (or ``fetch_layer_s``), so that one point (a, b) =
    (n0, n1) is off its run and priced on its own. Ties: fewer CPU experts, then fewer of the second class.
    ``bound(b)``: a lower bound of cost(a, b) over every a, nondecreasing in b (or None): the runs stop at
    the first b whose bound exceeds the best price so far (no later b can reach it).
    Prices are plain floats (a MissSplit, its sorted lists, is built once for the winner: at M = 32, 75
    misses a layer, building one per probe took 16 ms of host time a layer on a 2-core host)."""
    best, rank, found = fetch_all_s, (0, 0), None

    def offer(a: int, b: int) -> None:
        nonlocal best, rank, found
        c = cost(a, b)
        if (c, a + b, b) < (best, *rank):
            best, rank, found = c, (a + b, b), (a, b)

    if drop:
        offer(n0, n1)
    for b in range(n1 + 1):
        if bound is not None and bound(b) > best * (1.0 + 1e-12):
            break
        lo, hi = (1 if b == 0 else 0), n0 - (1 if drop and b == n1 else 0)  # a = b = 0: no CPU side at all
        if lo > hi:
            continue
        while lo < hi:  # the leftmost minimum of a convex run: the first a from which the cost stops falling
            mid = (lo + hi) // 2
            if cost(mid + 1, b) < cost(mid, b):
                lo = mid + 1
            else:
                hi = mid
        offer(lo, b)
    return found


def cpu_cannot_win(tokens: dict[int, int], fetch_all_s: float, costs: MissCosts) -> bool:
    """True when no split with a CPU expert can be taken over fetching every miss (``fetch_all_s``:
    ``gpu_only``'s ``cost_s``, its GPU side): any such split costs at least its CPU side, ``cpu_margin`` x
    (``cpu_step_s`` + the cheapest miss's ``cpu_time``), and that already exceeds what hysteresis allows.
    The search (and the cache's reuse estimates) then need not run: a decode step's host time at M = 1 is
    a few hundred microseconds a layer, and "auto" must not pay more than "gpu" for the same plan."""
    if not tokens:
        return True
    floor = costs.cpu_margin * (costs.cpu_step_s + min(costs.cpu_time(t) for t in set(tokens.values())))
    return floor > (1.0 - costs.hysteresis) * fetch_all_s


def cpu_never_wins(touched: int, rows: int, expert_bytes: int, costs: MissCosts) -> bool:
    """True when ``cpu_cannot_win`` holds for every forward of at most ``touched`` experts with at most
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


def _cumulative(values: list[float]) -> list[float]:
    """[0, v0, v0 + v1, ...]."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def margin_of(timings: list[list[float]]) -> float:
    """Groups of repeated timings (one call each) -> the sum of each group's worst repeat over the sum of
    its medians (at least 1): how much slower than the fitted medians the branch ran, weighted by time,
    so one outlier in a short timing does not set it alone."""
    groups = [t for t in timings if t]
    medians = sum(statistics.median(t) for t in groups)
    return max(1.0, sum(max(t) for t in groups) / medians) if medians > 0 else 1.0
