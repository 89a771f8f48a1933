"""How ``bench --hf``'s compiled decode compiled: dynamo's graphs and graph breaks while an implementation warms
up, and the frames it compiles again afterwards (a recompile in the timed passes), from dynamo's own counters
(``torch._dynamo.utils.counters``). One graph, no break and no recompile is a decode step that runs as one graph
(one CUDA graph under "reduce-overhead"); a graph break splits the step into pieces run between Python.

Each implementation compiles on a fresh dynamo state (``fresh_dynamo``): a graph break dynamo cannot resume from
(transformers' own experts loop breaks on ``nonzero`` inside the output-capturing wrapper's try block) marks the
model's shared frames to run uncompiled from then on, for every implementation compiled after it in the process
(the tiny Qwen3 with ``moekit``: 13 graphs a decode step after ``eager`` had compiled, 1 on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DynamoCounts:
    """Dynamo's running totals in this process (differences of two of them: what happened in between)."""

    frames: int  # Python frames dynamo compiled: a first compile or a recompile of one
    graphs: int  # graphs it made (a frame with a graph break makes one a piece)
    graph_breaks: int  # graph breaks met while tracing

    def __sub__(self, other: "DynamoCounts") -> "DynamoCounts":
        return DynamoCounts(self.frames - other.frames, self.graphs - other.graphs,
                            self.graph_breaks - other.graph_breaks)


def dynamo_counts() -> DynamoCounts:
    from torch._dynamo.utils import counters

    return DynamoCounts(frames=counters["frames"]["total"], graphs=counters["stats"]["unique_graphs"],
                        graph_breaks=sum(counters["graph_break"].values()))


@dataclass
class GraphCalls:
    count: int = 0  # compiled graphs called since the last reset (a decode step of one graph: 1 a step)


def counting_backend(calls: GraphCalls):
    """A torch.compile backend that runs each graph as dynamo traced it (no code generation) and counts its calls in
    ``calls``: how many graphs a decode step runs, which dynamo's compile-time counters do not say. A function, not an
    object: transformers' ``CompileConfig`` deep-copies its fields, which copies an object and keeps a function."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        def run(*args):
            calls.count += 1
            return gm.forward(*args)
        return run
    return backend


def fresh_dynamo() -> None:
    """Forget every compiled frame and every frame marked to run uncompiled (``torch._dynamo.reset``; CUDA graph
    trees too), so the next implementation compiles as if first in the process."""
    torch._dynamo.reset()


RECOMPILE_LIMIT = 64  # dynamo's per-function recompile limit while bench --hf compiles


def recompile_limit(limit: int = RECOMPILE_LIMIT):
    """Dynamo's per-function recompile limit raised to ``limit`` for a block (``recompile_limit``; ``cache_size_limit``
    before torch 2.6), so that recompiles (a guard on a cache's fill, an implementation switched) never exhaust it and
    leave a frame silently uncompiled."""
    import torch._dynamo.config as cfg

    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(getattr(cfg, name), limit)})


def counts_line(rows: list[dict]) -> str | None:
    """The report's line for compiled rows that carry counts: ``impl graphs/breaks/recompiles``; None: none do."""
    parts = [f"{r['impl']} {r['compile_graphs']}/{r['compile_graph_breaks']}/"
             f"{'-' if r.get('recompiles') is None else r['recompiles']}"
             for r in rows if r.get("compile_graphs") is not None]
    if not parts:
        return None
    return ("compiled, dynamo graphs / graph breaks in the warm-up / frames recompiled in the timed passes: "
            + ", ".join(parts))
