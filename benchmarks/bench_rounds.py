"""The timing the device checks share: a variant's calls captured in one CUDA graph, the variants' graphs timed in
interleaved rounds (the GPU's clock and temperature drift between rounds, so each round times every variant and a
win is counted round by round against the base of the same round), the medians, the wins, and eager host / wall
µs a call. Each timer is a parameter, so the logic is tested on the CPU with a fake one (tests/test_bench_rounds.py).

    graphs = {name: graph_of([lambda c=c: call(c) for c in sets], dev) for name, call in variants.items()}
    rounds = interleaved(graphs, len(sets), dev, ROUNDS, REPLAYS)        # name -> [µs a call, each round]
    wins(rounds["wide"], rounds["pick"])                               # rounds "wide" took <= 0.97 x "pick"

Used by the device checks (``wo38``, ``gpt39``, ``fpb40``, ``gfp42``, ``wolean``, ``fam34``, ``rfast34``, ``fgrad36``,
``opg35``; their run bookkeeping: ``bench_run``); ``eager_rounds``: eager calls (a training step) in turned rounds
(``trn50``, ``trn51``).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Callable

import torch

WIN = 0.97  # a win: a round the variant took <= WIN x the base (>= 3% faster)


def graph_of(fns: list, dev, warmups: int = 2, replay: bool = True):
    """The calls ``fns`` captured in one CUDA graph (each run ``warmups`` times on a side stream first, then
    replayed once where ``replay``), or None off the GPU."""
    if dev.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns * warmups:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    if replay:
        g.replay()
    torch.cuda.synchronize()
    return g


def event_timer() -> Callable[[Callable[[], None]], float]:
    """A timer of GPU work: ``timer(run)`` enqueues ``run()`` between two CUDA events, waits, returns its ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timer(run: Callable[[], None]) -> float:
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return timer


def interleaved(graphs: dict, calls: int, dev, rounds: int, replays: int, until: float = math.inf,
                timer=None) -> dict:
    """name -> [µs a call, each round]: every graph replayed ``replays`` times a round (each replay runs ``calls``
    calls), the graphs in turn; no round after the first begins past ``until`` (``time.time()``). Off the GPU (no
    ``timer``): one NaN each."""
    if timer is None:
        if dev.type != "cuda":
            return {name: [float("nan")] for name in graphs}
        timer = event_timer()
    samples = {name: [] for name in graphs}

    def replayed(g) -> None:
        for _ in range(replays):
            g.replay()

    for r in range(rounds):
        if r and time.time() > until:
            print(f"deadline: {r} rounds", flush=True)
            break
        for name, g in graphs.items():
            samples[name].append(timer(lambda g=g: replayed(g)) * 1e3 / (replays * calls))
    return samples


def medians(rounds: dict) -> dict:
    """name -> the median of its rounds."""
    return {name: statistics.median(v) for name, v in rounds.items()}


def wins(samples, base, win: float = WIN) -> int:
    """Rounds in which ``samples`` took <= ``win`` x ``base``'s value of the same round."""
    return sum(v <= win * b for v, b in zip(samples, base))


def faster_rounds(samples, base, by: float = 1.03) -> int:
    """Rounds in which ``base`` took >= ``by`` x ``samples``' value of the same round."""
    return sum(b / v >= by for b, v in zip(base, samples))


def versus(samples, base) -> str:
    """``x<base median / samples median> (>=3% in <faster rounds>/<rounds>)``: how much faster ``samples`` ran."""
    ratio = statistics.median(base) / statistics.median(samples)
    return f"x{ratio:5.3f} (>=3% in {faster_rounds(samples, base)}/{len(samples)})"


def eager_us(calls: dict, rounds: int, n_calls: int) -> dict:
    """name -> (host µs a call: ``n_calls`` calls enqueued behind ~1 ms of GPU work, so the enqueue time is the
    host's alone; wall µs a call: the same calls to completion), medians of ``rounds`` interleaved rounds. ``calls``:
    name -> the calls to cycle through (rotated input sets)."""
    host, wall = {k: [] for k in calls}, {k: [] for k in calls}
    for _ in range(rounds):
        for name, fns in calls.items():
            for record, busy in ((host, True), (wall, False)):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead
                t0 = time.perf_counter()
                for i in range(n_calls):
                    fns[i % len(fns)]()
                if not busy:
                    torch.cuda.synchronize()
                record[name].append((time.perf_counter() - t0) * 1e6 / n_calls)
    return {k: (statistics.median(host[k]), statistics.median(wall[k])) for k in calls}


def turned(r: int, names: list) -> list:
    """``settled``'s default order of round r: ``names`` turned r places (cyclic: each keeps its predecessor)."""
    return names[r % len(names):] + names[:r % len(names)]


def turned_rounds(names: list, rounds: int, until: float = math.inf):
    """The names of ``rounds`` interleaved rounds in order, each round ``turned``; a round after the first starts only
    before ``until`` (``time.time()``)."""
    for r in range(rounds):
        if r and time.time() > until:
            return
        yield from turned(r, names)


def shuffled(r: int, names: list) -> list:
    """An order of round r: ``names`` in a permutation seeded by r (no name keeps one predecessor round after
    round)."""
    return random.Random(r).sample(list(names), len(names))


def settled(entries: dict, calls: int, dev, rounds: int, replays: int, until: float = math.inf,
            timer=None, order=turned) -> dict:
    """name -> [µs a call, each round], like ``interleaved``, with each name's predecessor fixed: ``entries`` name ->
    (the graph timed, the graph replayed once just before it, unmeasured: None for the timed graph itself), so no
    name inherits the clock and power state the graph before it in the round left (session 31: the pick, timed right
    after the bf16 call's graph every round, read 5-14% above the same launches timed elsewhere at DeepSeek-V3 4096
    and Mixtral 1024). ``order(r, names)``: round r's order (``turned``, ``shuffled``); no round after the first
    begins past ``until`` (``time.time()``). Off the GPU (no ``timer``): one NaN each."""
    if timer is None:
        if dev.type != "cuda":
            return {name: [float("nan")] for name in entries}
        timer = event_timer()
    samples = {name: [] for name in entries}
    for r in range(rounds):
        if r and time.time() > until:
            print(f"deadline: {r} rounds", flush=True)
            break
        for name in order(r, list(entries)):
            graph, warm = entries[name]
            (graph if warm is None else warm).replay()

            def replayed(g=graph) -> None:
                for _ in range(replays):
                    g.replay()

            samples[name].append(timer(replayed) * 1e3 / (replays * calls))
    return samples


def eager_rounds(fns: dict, dev, rounds: int, until: float = math.inf) -> dict:
    """name -> ([wall µs each round], [CUDA-event µs each round]; NaN off the GPU): one eager call of each of ``fns``
    a round, synchronised before and after, the order ``turned`` each round (``turned_rounds``: a round after the
    first starts only before ``until``)."""
    samples = {name: ([], []) for name in fns}
    cuda = dev.type == "cuda"
    for name in turned_rounds(list(fns), rounds, until):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fns[name]()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        samples[name][0].append((time.perf_counter() - t0) * 1e6)
        samples[name][1].append(start.elapsed_time(end) * 1e3 if cuda else float("nan"))
    return samples


def variant_lines(res: dict, floor_us: float) -> list[str]:
    """A check's table lines of one cell's variants (``res``: "variants" in order, the first the base; "median_us",
    "rounds", "x" = base / variant, "wins" = rounds >= 3% faster than the base): median µs, % of ``floor_us``."""
    med, lines = res["median_us"], []
    for i, name in enumerate(res["variants"]):
        win = f" x{res['x'][name]:.3f} >=3% in {res['wins'][name]}/{len(res['rounds'][name])}" if i else ""
        lines.append(f"  {name:18} {med[name]:9.1f} ({100 * floor_us / med[name]:5.1f}%){win}")
    return lines


def timed_graphs(log: Callable[[str], None], label: str, fns: dict, calls: int, dev, rounds: int, sample_us: float,
                 until: float = math.inf, base: str = "route") -> tuple[dict, dict]:
    """(name -> its graph, name -> [µs a call, each round]): ``fns`` name -> its calls, one CUDA graph each (``log``
    a line before each capture: a watchdog's heartbeat through the compiles), then ``settled`` rounds of replays
    of about ``sample_us`` of GPU work each (sized on ``base``'s graph; ``calls`` calls a replay)."""
    graphs = {}
    for name, call_list in fns.items():
        log(f"{label} {name}: graph")
        graphs[name] = graph_of(call_list, dev)
    replays = 1
    if dev.type == "cuda":
        replays = max(1, round(sample_us / (event_timer()(graphs[base].replay) * 1e3)))
    return graphs, settled({name: (g, None) for name, g in graphs.items()}, calls, dev, rounds, replays, until)

