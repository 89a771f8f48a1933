"""What one replay of a CUDA graph runs on the GPU, read from torch.profiler's CUPTI trace: every kernel, memset
and copy in order with its grid, block, dynamic shared memory, registers and µs (the device checks' way to compare
two graphs' launches; session 31's ``wopk31_device_check.py`` compared the route's pick with the same options
named). Only on a GPU.

    rows = graph_kernels(graph)          # [GpuOp], in the order the GPU started them
    print("\\n".join(op_lines(rows)))
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


@dataclass(frozen=True)
class GpuOp:
    """One GPU operation of a replay."""

    name: str
    category: str
    grid: tuple
    block: tuple
    shared: int  # dynamic shared memory, bytes (-1: not reported)
    registers: int  # a thread's (-1: not reported)
    us: float


def trace_ops(events: list) -> list[GpuOp]:
    """The GPU operations of a chrome trace's events, in start order."""
    ops = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e.get("ts", 0))
    return [GpuOp(e.get("name", "?"), e["cat"], tuple(e.get("args", {}).get("grid", ())),
                  tuple(e.get("args", {}).get("block", ())), int(e.get("args", {}).get("shared memory", -1)),
                  int(e.get("args", {}).get("registers per thread", -1)), float(e.get("dur", 0.0))) for e in ops]


def graph_kernels(graph) -> list[GpuOp]:
    """The GPU operations of one replay of ``graph`` (replayed once before, untraced: CUPTI's start-up stays out)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return trace_ops(json.load(f).get("traceEvents", []))


def op_lines(ops: list[GpuOp], width: int = 44) -> list[str]:
    """One line an operation: name (cut to ``width``), grid, block, shared bytes, registers, µs."""
    return [f"{o.name[:width]:<{width}} {o.category[:6]:<6} grid {o.grid} block {o.block} smem {o.shared} "
            f"regs {o.registers} {o.us:9.1f} µs" for o in ops]
