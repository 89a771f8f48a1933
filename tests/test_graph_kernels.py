"""``benchmarks/graph_kernels.py`` on the CPU: the GPU operations read from a hand-written chrome trace (kernels,
memsets and copies in start order with their launch geometry; host events left out), and their lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from graph_kernels import GpuOp, op_lines, trace_ops  # noqa: E402


def test_trace_ops_keeps_gpu_operations_in_start_order_with_their_geometry():
    events = [
        {"cat": "kernel", "name": "down_kernel", "ts": 30.0, "dur": 12.5,
         "args": {"grid": [132, 1, 1], "block": [256, 1, 1], "shared memory": 229588, "registers per thread": 168}},
        {"cat": "cpu_op", "name": "aten::empty", "ts": 1.0, "dur": 3.0},
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 5.0, "dur": 1.0, "args": {}},
        {"cat": "kernel", "name": "align_kernel", "ts": 10.0, "dur": 2.0,
         "args": {"grid": [4, 1, 1], "block": [128, 1, 1], "shared memory": 0, "registers per thread": 32}},
    ]
    ops = trace_ops(events)
    assert [o.name for o in ops] == ["Memset (Device)", "align_kernel", "down_kernel"]
    assert ops[0] == GpuOp("Memset (Device)", "gpu_memset", (), (), -1, -1, 1.0)
    assert ops[2] == GpuOp("down_kernel", "kernel", (132, 1, 1), (256, 1, 1), 229588, 168, 12.5)


def test_op_lines_one_line_an_operation_name_cut_to_width():
    op = GpuOp("a_very_long_kernel_name", "kernel", (2, 1, 1), (128, 1, 1), 1024, 40, 3.25)
    (line,) = op_lines([op], width=8)
    assert line.startswith("a_very_l kernel grid (2, 1, 1) block (128, 1, 1) smem 1024 regs 40")
    assert line.endswith("3.2 µs")
