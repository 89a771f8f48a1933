"""``prof35_device_check``'s reading of a ``torch.profiler`` chrome trace of a compiled ``generate``: the GPU kernels
of each decode step, grouped by name and by part of the model (attention / router / experts / gemm / other).

Steps: a logits processor opens and closes a ``record_function`` (``MARK``) at each step, right after the host queued
that step's forward (generate then waits for the step's token before the next forward): step k is what the host
launched between mark k-1 and mark k (its forward, the previous step's argmax and bookkeeping). A kernel belongs to
the step of its launch (the runtime call with its correlation id: one ``cudaGraphLaunch`` for a whole graph under
CUDA graphs); a kernel whose launch is not in the trace falls back to its own start time. Wall: mark k - mark k-1 on
the host clock (profiled). Busy: the union of the step's kernel intervals. Gap: wall - busy.

Host: the step's time in the host ranges of ``HOST`` (dynamo's guard check, the compiled region, the graph launch,
the syncs), by their start; under CUDA graphs a step is serial (generate waits for each token), so host time before
the graph launch adds to the step as GPU time does.

In the smoke (CPU activity only) the "kernels" are the leaf CPU ops (those holding no other op).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

MARK = "prof35_step"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "cudaGraphLaunch", "cudaStreamSynchronize",
        "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::_local_scalar_dense", "cudaLaunchKernel", "cuLaunchKernel")
# Part of the model by kernel name; the first pattern that matches wins (case-insensitive).
PARTS = (
    ("router", r"gate_kernel|gate_route_kernel|topk|sort|softmax"),  # moekit's router kernels, torch's top-k / softmax
    ("experts", r"align_|route_kernel|gate_up|down_|sum_slots|gather_|grouped|sorted_gemm|blk256|permute_rows"
                r"|contiguous_sum|zero_unrouted|split_glu|moekit"),
    ("attention", r"flash|fmha|attention|attn|sdpa|rotary|rope"),
    ("gemm", r"gemm|gemv|nvjet|cublas|xmma|cutlass|sm90_|sm80_|ampere_|splitk|matmul|addmm|bmm"),  # q/k/v/o, gate, head
)


def part_of(name: str) -> str:
    """The model part a kernel named ``name`` is attributed to (``PARTS``), else "other"."""
    return next((part for part, pat in PARTS if re.search(pat, name, re.IGNORECASE)), "other")


@dataclass
class Kernel:
    name: str
    start: float  # µs, the trace's clock
    dur: float  # µs
    launch: float  # µs: the host's launch (or the kernel's start where the launch is not in the trace)


def _leaf_cpu_ops(events: list) -> list:
    """The CPU ops holding no other op of their thread (the smoke's "kernels")."""
    by_tid = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            by_tid[e.get("tid")].append(e)
    leaves = []
    for ops in by_tid.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        for i, e in enumerate(ops):
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:  # the next op starts after this one ends
                leaves.append(e)
    return leaves


@dataclass
class Trace:
    kernels: list[Kernel]
    marks: list[float]  # the step marks' start µs, in order
    host: list[Kernel]  # the ``HOST`` ranges, named by their ``HOST`` prefix (launch: their start)
    counts: dict  # kernels, launch_matched (kernels whose launch is in the trace)


def _host_ranges(events: list) -> list[Kernel]:
    got = []
    for e in events:
        name = next((h for h in HOST if e.get("name", "").startswith(h)), None)
        if name is not None and "dur" in e and e.get("cat") not in GPU_CATS:
            got.append(Kernel(name, float(e["ts"]), float(e["dur"]), float(e["ts"])))
    return got


def read_trace(path: str, cpu_ops: bool) -> Trace:
    """The chrome trace at ``path``; ``cpu_ops``: the leaf CPU ops stand for kernels (the smoke)."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    marks = sorted(e["ts"] for e in events if e.get("cat") == "user_annotation" and e.get("name") == MARK)
    launches = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATS and corr is not None:
            launches[corr] = e["ts"]
    raw = _leaf_cpu_ops(events) if cpu_ops else [e for e in events if e.get("cat") in GPU_CATS and "dur" in e]
    kernels, matched = [], 0
    for e in raw:
        launch = launches.get((e.get("args") or {}).get("correlation"))
        matched += launch is not None
        kernels.append(Kernel(e["name"], float(e["ts"]), float(e["dur"]), float(e["ts"] if launch is None else launch)))
    return Trace(kernels, [float(m) for m in marks], _host_ranges(events),
                 {"kernels": len(kernels), "launch_matched": matched})


def busy_us(kernels: list[Kernel]) -> float:
    """The union of the kernels' intervals, µs (kernels on two streams at once counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start):
        lo, hi = max(k.start, end), k.start + k.dur
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


@dataclass
class StepTable:
    """The decode steps of one profiled generate."""

    steps: int
    wall_us: list[float]  # each step's wall (marks, host clock, profiled)
    busy_us: list[float]  # each step's kernel-interval union
    kernel_us: list[float]  # each step's kernel time summed
    by_name: dict = field(default_factory=dict)  # name -> {"part", "count" a step, "us" a step}
    by_part: dict = field(default_factory=dict)  # part -> µs a step
    host: dict = field(default_factory=dict)  # ``HOST`` name -> {"count", "us"} a step

    def summary(self) -> dict:
        med = statistics.median
        wall, busy = med(self.wall_us), med(self.busy_us)
        return {"steps": self.steps, "wall_us": round(wall, 1), "busy_us": round(busy, 1),
                "kernel_us": round(med(self.kernel_us), 1), "gap_us": round(wall - busy, 1),
                "kernels": round(sum(v["count"] for v in self.by_name.values()), 2),
                "by_part_us": {k: round(v, 1) for k, v in sorted(self.by_part.items())},
                "host_us": {k: round(v["us"], 1) for k, v in self.host.items()}}


def _per_name(per_step: list[list[Kernel]]) -> dict:
    """name -> {"count", "us"} a step (largest µs first)."""
    names: dict = defaultdict(lambda: [0, 0.0])
    for step in per_step:
        for k in step:
            names[k.name][0] += 1
            names[k.name][1] += k.dur
    n = len(per_step)
    return {name: {"count": c / n, "us": us / n} for name, (c, us) in sorted(names.items(), key=lambda kv: -kv[1][1])}


def step_table(trace: Trace, first: int) -> StepTable:
    """Steps ``first``..len(marks)-1 (step k: launched after mark k-1, up to mark k)."""
    marks = trace.marks
    windows = [(marks[k - 1], marks[k]) for k in range(first, len(marks))]
    if not windows:
        raise ValueError(f"{len(marks)} step marks: no decode step from step {first}")
    per_step = [[k for k in trace.kernels if lo < k.launch <= hi] for lo, hi in windows]
    by_name = {name: {"part": part_of(name), **v} for name, v in _per_name(per_step).items()}
    by_part: dict = defaultdict(float)
    for v in by_name.values():
        by_part[v["part"]] += v["us"]
    host = _per_name([[h for h in trace.host if lo < h.launch <= hi] for lo, hi in windows])
    return StepTable(steps=len(windows), wall_us=[hi - lo for lo, hi in windows],
                     busy_us=[busy_us(s) for s in per_step], kernel_us=[sum(k.dur for k in s) for s in per_step],
                     by_name=by_name, by_part=dict(by_part), host=host)


def diff_rows(table: StepTable, base: StepTable, layers: int) -> list[dict]:
    """What ``table`` runs beyond ``base`` by kernel name: count and µs a step and a layer (largest first)."""
    rows = []
    for name in set(table.by_name) | set(base.by_name):
        a, b = table.by_name.get(name, {}), base.by_name.get(name, {})
        d_us, d_count = a.get("us", 0.0) - b.get("us", 0.0), a.get("count", 0.0) - b.get("count", 0.0)
        if abs(d_us) >= 0.05 or abs(d_count) >= 0.01:
            rows.append({"name": name, "part": part_of(name), "count_step": round(d_count, 2),
                         "us_step": round(d_us, 2), "us_layer": round(d_us / layers, 2)})
    return sorted(rows, key=lambda r: -abs(r["us_step"]))
