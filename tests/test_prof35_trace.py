"""``benchmarks/prof35_trace.py`` on hand-written chrome traces: kernels given to the step of their launch (a graph
launch's kernels by correlation id, an unmatched kernel by its start), the busy union of overlapping kernels, the
per-name counts and µs a step, the host ranges by their start, the part of each name, the diff against a baseline,
the smoke's leaf CPU ops."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prof35_trace as pt  # noqa: E402


def _mark(ts):
    return {"cat": "user_annotation", "name": pt.MARK, "ts": ts, "dur": 1}


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 2, "args": {"correlation": corr}}


def _lookup(ts, dur):
    return {"cat": "cpu_op", "name": "TorchDynamo Cache Lookup", "ts": ts, "dur": dur}


def _kernel(name, ts, dur, corr=None):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {} if corr is None else {"correlation": corr}}


def _write(tmp_path, events, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _two_step_trace(tmp_path, down_us):
    """Marks at 0, 100, 200; step 1's graph launched at 10 (its kernels run past mark 1), step 2's at 110."""
    events = [_mark(0), _mark(100), _mark(200), _launch(10, 7), _launch(110, 8), _lookup(5, 4), _lookup(104, 6),
              _kernel("flash_fwd_kernel", 20, 30, 7), _kernel("down_kernel", 40, down_us, 7),  # overlaps flash
              _kernel("gate_up_kernel", 120, 10, 8), _kernel("down_kernel", 130, down_us, 8),
              _kernel("triton_poi_fused_copy_0", 150, 5)]  # no launch in the trace: its start (150) counts
    return _write(tmp_path, events, f"t{down_us}.json")


def test_steps_follow_their_launch(tmp_path):
    trace = pt.read_trace(_two_step_trace(tmp_path, 70), cpu_ops=False)
    assert trace.marks == [0.0, 100.0, 200.0]
    assert trace.counts == {"kernels": 5, "launch_matched": 4}
    table = pt.step_table(trace, first=1)
    assert table.steps == 2
    assert table.wall_us == [100.0, 100.0]
    # step 1: flash [20, 50) and down [40, 110) -> union [20, 110) = 90; step 2: [120, 130) + [130, 200) + [150, 155)
    assert table.busy_us == [90.0, 80.0]
    assert table.kernel_us == [100.0, 85.0]
    assert table.by_name["down_kernel"] == {"part": "experts", "count": 1.0, "us": 70.0}
    assert table.by_name["gate_up_kernel"] == {"part": "experts", "count": 0.5, "us": 5.0}
    assert table.by_part == pytest.approx({"attention": 15.0, "experts": 75.0, "other": 2.5})
    summary = table.summary()
    assert summary["gap_us"] == 15.0  # median wall 100 - median busy 85
    assert summary["kernels"] == 2.5
    # the host ranges by their start: the graph launches (2 µs each) and the guard checks (4, then 6 µs)
    assert table.host == {"TorchDynamo Cache Lookup": {"count": 1.0, "us": 5.0},
                          "cudaGraphLaunch": {"count": 1.0, "us": 2.0}}


def test_diff_against_the_baseline(tmp_path):
    table = pt.step_table(pt.read_trace(_two_step_trace(tmp_path, 70), cpu_ops=False), 1)
    base = pt.step_table(pt.read_trace(_two_step_trace(tmp_path, 10), cpu_ops=False), 1)
    rows = pt.diff_rows(table, base, layers=4)
    assert rows == [{"name": "down_kernel", "part": "experts", "count_step": 0.0, "us_step": 60.0, "us_layer": 15.0}]


@pytest.mark.parametrize("name, part", [
    ("gate_route_kernel", "router"), ("void at::native::sbtopk::gatherTopK<float>", "router"),
    ("triton_per_fused__softmax_1", "router"), ("align_small_kernel", "experts"), ("route_kernel", "experts"),
    ("pytorch_flash::flash_fwd_kernel", "attention"), ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"), ("gemv2T_kernel_val", "gemm"),
    ("triton_poi_fused_add_mul_rsqrt_0", "other"),
    # names from an H200 profile of this decode (results/raw/NVIDIA_H200-2026-12-02-477bbf7-hf_compiled.log)
    ("void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long>", "router"), ("sum_slots_kernel", "experts"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_2_64x32x128", "attention"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("triton_per_fused__softmax__to_copy_exp_prepare_softmax_online_sub_8", "router"),
    ("Memcpy DtoD (Device -> Device)", "other")])
def test_parts(name, part):
    assert pt.part_of(name) == part


def test_leaf_cpu_ops_stand_for_kernels(tmp_path):
    events = [_mark(0), _mark(100),
              {"cat": "cpu_op", "name": "aten::linear", "ts": 10, "dur": 50, "tid": 1},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 15, "dur": 20, "tid": 1},  # inside linear: the leaf
              {"cat": "cpu_op", "name": "aten::add", "ts": 70, "dur": 5, "tid": 1}]
    trace = pt.read_trace(_write(tmp_path, events), cpu_ops=True)
    assert [(k.name, k.launch) for k in trace.kernels] == [("aten::mm", 15.0), ("aten::add", 70.0)]
    assert pt.step_table(trace, 1).busy_us == [25.0]


def test_no_step_is_an_error():
    with pytest.raises(ValueError):
        pt.step_table(pt.Trace([], [5.0], [], {}), first=1)
