"""Split or unsplit: ``cpu_gemm="auto"``'s CPU loop at decode sizes, chosen per call by timing both online.

The split loop (``moekit.experts.cpu_workers``: whole experts dealt to single-threaded workers) keeps both cores busy
when a neighbour holds one of them. But in a model, the op before the experts (the router's GEMM, attention) ran on
torch's 2 OpenMP threads, and libgomp's idle thread keeps spinning after it, taking a core from one of the split's
workers. The unsplit loop (each GEMM on the caller's intra-op threads, in phases: ``moekit.experts.cpu_phased``)
hands that spinning thread the work instead. Measured on the 2-core Sapphire Rapids Xeon at Qwen3-30B-A3B widths,
M = 1, right after a 2-thread GEMM: 4.1 against 6.3 ms (bf16), 4.7 against 7.6 ms (fp32), the same bits. But on a
loaded machine 2-thread GEMMs wait at OpenMP's barriers for a descheduled thread: the unsplit loop ran 4-16x slower
than the split (the EPYC, session 27; ~10x on this Xeon under the helpers' load). No fixed rule wins both, and no
cheap signal says which case a call is in (the load average counts our own threads), so both are timed where they
run:

    per key (M's bit length: 1, 2-3, 4-7, ...; the dtype, weight shape and threads): the first 2 * WINDOW calls
    alternate the modes; then the mode with the lower median over its last WINDOW calls runs, and the other runs
    once every ``interval`` calls (a probe). A probe that loses doubles the interval (PROBE_MIN .. PROBE_MAX
    calls); one faster than the running mode's median runs again on the next call, so a mode that became faster
    takes over in two calls; a change of mode resets the interval to PROBE_MIN.

A neighbour that arrives slows the running unsplit mode at once: its median rises within two calls and the split,
timed before, takes over. One that leaves is found by the next probe. A probe of the loaded unsplit mode costs ~10
split calls, so at PROBE_MAX calls apart it costs < 1% of the time.

Both modes give the same bits where 1- and 2-thread GEMMs do (each expert's rows are combined in expert order
either way): measured at M = 1 to 64 on the Xeon, fp32 and bf16, at real and at test widths.

Only M < ``CHOSEN_BELOW`` is chosen: at Qwen3-30B-A3B widths after a 2-thread op, the phased loop led the split by
20-40% at M = 1, ~7% at 4 and 8, 0-5% at 16, and trailed it by 6-13% at M = 64, where experts of more rows split
well over single-threaded workers.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

R = TypeVar("R")

SPLIT, UNSPLIT = "split", "unsplit"
MODES = (SPLIT, UNSPLIT)
WINDOW = 3  # samples per mode a median is taken over: one outlier (a neighbour's burst) never decides
PROBE_MIN, PROBE_MAX = 8, 1024  # calls between probes of the losing mode, doubled after each loss
CHOSEN_BELOW = 32  # rows M of the calls whose mode is timed online; the rest split


@dataclass
class _KeyState:
    """One key's timings: ``samples[mode]`` the last WINDOW seconds of that mode; probes are counted in calls."""

    samples: dict[str, deque] = field(default_factory=lambda: {m: deque(maxlen=WINDOW) for m in MODES})
    calls: int = 0  # calls recorded for this key
    interval: int = PROBE_MIN  # calls from one probe to the next while probes lose
    next_probe: int = 0  # the call number at which the losing mode runs next

    def median(self, mode: str) -> float:
        return statistics.median(self.samples[mode])

    def warming(self) -> str | None:
        """The mode to run while either mode has fewer than WINDOW samples (the one with fewer), else None."""
        split, unsplit = (len(self.samples[m]) for m in MODES)
        if min(split, unsplit) >= WINDOW:
            return None
        return SPLIT if split <= unsplit else UNSPLIT

    def best(self) -> str:
        """The mode with the lower median (ties: the split, robust under load)."""
        return UNSPLIT if self.median(UNSPLIT) < self.median(SPLIT) else SPLIT


class SplitChooser:
    """Per key, whether the CPU loop runs split or unsplit, from both modes' wall times in this process.

    ``call(key, run)`` runs ``run(mode)`` in the chosen mode and times it on ``clock`` (seconds; injectable
    for tests). Thread-safe: concurrent calls of one key share its timings."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._states: dict[Hashable, _KeyState] = {}
        self._lock = threading.Lock()

    def choose(self, key: Hashable) -> str:
        with self._lock:
            state = self._states.setdefault(key, _KeyState())
            warming = state.warming()
            if warming is not None:
                return warming
            best = state.best()
            if state.calls >= state.next_probe:
                return UNSPLIT if best == SPLIT else SPLIT
            return best

    def record(self, key: Hashable, mode: str, seconds: float) -> None:
        """One call of ``mode`` took ``seconds``: update the key's medians and when the next probe runs."""
        with self._lock:
            state = self._states.setdefault(key, _KeyState())
            state.calls += 1
            if state.warming() is not None:  # warm-up: no mode runs yet, the first probe is an interval away
                state.samples[mode].append(seconds)
                state.next_probe = state.calls + state.interval
                return
            running = state.best()
            state.samples[mode].append(seconds)
            if state.best() != running:  # the probe took over, or the running mode slowed past the other's median
                state.interval = PROBE_MIN  # the mode left behind is timed again soon (a neighbour's burst passes)
                state.next_probe = state.calls + PROBE_MIN
            elif mode == running:  # its median follows the machine
                return
            elif seconds < state.median(running):  # faster than the running mode: confirm it on the next call
                state.next_probe = state.calls
            else:  # lost: probe less often, ``interval`` calls after this one
                state.interval = min(2 * state.interval, PROBE_MAX)
                state.next_probe = state.calls - 1 + state.interval

    def call(self, key: Hashable, run: Callable[[str], R]) -> R:
        mode = self.choose(key)
        start = self.clock()
        result = run(mode)
        self.record(key, mode, self.clock() - start)
        return result

    def modes(self) -> dict[Hashable, str]:
        """key -> the mode its medians favour now (keys still warming up left out): what a bench reports."""
        with self._lock:
            return {k: s.best() for k, s in self._states.items() if s.warming() is None}

    def clear(self) -> None:
        with self._lock:
            self._states.clear()


_CHOOSER = SplitChooser()


def split_chooser() -> SplitChooser:
    """The process-wide chooser ``cpu_gemm="auto"`` uses (``clear()`` it to time both modes afresh)."""
    return _CHOOSER
