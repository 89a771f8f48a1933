"""The int4 words gate-up (``moekit/experts/triton_wo_words.py``, kernel ``_kernels/gluon_wo_words.py``) on the CPU:
Gluon does not run in the interpreter, so its host side is held here against independent references: the dot order
(closed form) against the words' nibbles read one by one, the kernel's operand steps mirrored in torch against it, the
activations' stored order and group sums against float64, the kernel's arithmetic (``gate_up_words_torch``) against a
float64 loop over dequantized weights, the refusals by name, and the kernel compiled for sm_90 (no spill, no shared
memory or shuffle in its main loop, 16-byte word loads). The kernel itself is checked on the device
(``benchmarks/w4g45_device_check.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit.experts.triton_wo_plan import weight_args
from moekit.experts._kernels.gluon_wo_words import stored_column
from moekit.experts.triton_wo_words import (
    check_ahead, check_words, check_words_down, dot_columns, down_split, stored_dot_columns, x_words, x_words_torch,
)
from moekit.experts.triton_wo_words_twin import (
    exact_half_torch, gate_up_words_torch, weight_halves_torch, x_halves_torch,
)

ROOT = Path(__file__).resolve().parents[1]


def _int4(e: int, rows: int, cols: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(e, rows, cols // group, generator=g) + 0.5) / (4.6 * cols**0.5)  # unit-variance products
    zero = torch.randint(0, 16, (e, rows, cols // group), generator=g, dtype=torch.uint8)
    return q, scale, zero


def _code(q_row: torch.Tensor, col: int) -> int:
    """The int4 code of column ``col`` of a packed row (element 2i the low nibble of byte i)."""
    byte = int(q_row[col // 2])
    return byte & 15 if col % 2 == 0 else byte >> 4


def test_orders_are_permutations():
    assert sorted(dot_columns().tolist()) == list(range(256))
    assert sorted(stored_dot_columns().tolist()) == list(range(256))


def test_weight_operand_holds_the_codes_in_dot_order():
    q, _, _ = _int4(1, 4, 512, 128)
    words = q[0].contiguous().view(torch.int32).long()  # [4, 64]
    cols = dot_columns().tolist()
    for s in range(2):
        halves = weight_halves_torch(words[:, 32 * s:32 * s + 32])
        for c, half in enumerate(halves):  # [4, 128]
            for r in range(4):
                want = [128 + _code(q[0, r], 256 * s + cols[128 * c + d]) for d in range(128)]
                assert half[r].tolist() == want


def test_x_operand_holds_x_in_dot_order_and_group_sums():
    x = torch.randn(3, 1024, dtype=torch.float64).bfloat16()
    xw = x_words_torch(x)
    cols = dot_columns()
    for s in range(4):
        b0, b1 = x_halves_torch(xw.x[:, 256 * s:256 * s + 256])  # [128, 3] each
        for c, b in enumerate((b0, b1)):
            assert torch.equal(b.t(), x[:, 256 * s + cols[128 * c:128 * c + 128]])
    sums = x.double().view(3, 8, 128).sum(-1)
    assert torch.allclose(xw.sums.double(), sums, rtol=1e-6, atol=1e-4)


def test_exact_decode_holds_code_minus_zero_in_dot_order():
    q, _, zero = _int4(1, 3, 256, 128)
    words = q[0].contiguous().view(torch.int32).long()  # [3, 32]
    cols = dot_columns().tolist()
    for c in range(2):  # the kernel splits a step's words into its half steps: words 16 c .. 16 c + 15
        half = exact_half_torch(words[:, 16 * c:16 * c + 16], zero[0, :, 0].long())
        for r in range(3):
            want = [_code(q[0, r], cols[128 * c + d]) - int(zero[0, r, 0]) for d in range(128)]
            assert half[r].tolist() == want


def test_the_gate_up_stores_h_where_the_down_gemm_reads_it():
    """``stored_column`` (the gate-up's H_ORDER store, its integer arithmetic run on torch) puts column n where
    ``x_words`` puts it: the down GEMM reads h as the gate-up reads x."""
    x = (torch.arange(768) % 256).repeat(2, 1).bfloat16()  # a step's columns told apart (exact in bf16)
    where = stored_column.fn(torch.arange(768))
    assert torch.equal(where // 256, torch.arange(768) // 256)  # each column stays in its step
    stored = torch.empty_like(x)
    stored[:, where] = x
    assert torch.equal(stored, x_words_torch(x).x)


@pytest.mark.parametrize("group", [128, 256])
def test_kernel_arithmetic_matches_a_float64_loop(group):
    e, n, k = 3, 32, 1024
    q, scale, zero = _int4(e, 2 * n, k, group, seed=group)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    h = gate_up_words_torch(x, weight_args(q, scale, zero, group), ids)
    for a, expert in enumerate(ids.reshape(-1).tolist()):
        xt = x[a // 2].double()
        acc = torch.zeros(2 * n, dtype=torch.float64)
        for r in range(2 * n):
            for col in range(k):
                grp = col // group
                w = (_code(q[expert, r], col) - int(zero[expert, r, grp])) * float(scale[expert, r, grp])
                acc[r] += w * float(xt[col])
        want = torch.nn.functional.silu(acc[:n]) * acc[n:]
        assert torch.allclose(h[a], want, rtol=1e-6, atol=1e-6 * want.abs().max())  # x sums in float32


@pytest.mark.parametrize("change, named", [
    ({"n": 640}, "N must be a multiple of 256"), ({"split": 3}, "split"), ({"group": 64}, "group_size"),
    ({"k": 40}, "K a multiple of 64"),
])
def test_down_refusals_name_the_argument(change, named):
    n, k, group = change.get("n", 512), change.get("k", 128), change.get("group", 128)
    q, scale, zero = _int4(2, k, n, group)
    with pytest.raises(ValueError, match=named):
        check_words_down(weight_args(q, scale, zero, group), change.get("split", 1))


@pytest.mark.parametrize("change, named", [
    ({"dtype": torch.float16}, "bf16"), ({"k": 640}, "K a multiple of 256"), ({"group": 64}, "group_size"),
    ({"n": 48}, "N a multiple of 32"), ({"block_rows": 4}, "block_rows"),
])
def test_refusals_name_the_argument(change, named):
    n, k, group = change.get("n", 64), change.get("k", 1024), change.get("group", 128)
    q, scale, zero = _int4(2, 2 * n, k, group)
    x = torch.zeros(1, k, dtype=change.get("dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=named):
        check_words(x, weight_args(q, scale, zero, group), 2, change.get("block_rows", 8))


@pytest.mark.parametrize("ahead", [1, 2])
def test_kernel_compiles_for_sm90_without_an_operand_hop(ahead):
    """Through Triton's whole pipeline to sm_90 SASS (a layout error fails here, not on the device), in a process of
    its own (the interpreter's patches stay out): no spill, no STS / LDS / SHFL / local memory in the main loop, the
    words and x by 16-byte loads, at most 2 instructions a weight; the gate-up and the down GEMM, with the words one
    step ahead (two steps a loop) and two (three steps a loop)."""
    pytest.importorskip("triton.experimental.gluon._runtime", reason="no GluonASTSource in this Triton")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere", reason="no Gluon mma_v2 in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    cases = ("naive", "aligned", "down", "down-aligned")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "w4g45_sass_cpu.py"), "--ahead", str(ahead),
                          *cases], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(tuple(f"{c} ahead {ahead}:" for c in cases))]
    assert run.returncode == 0 and len(lines) == len(cases), run.stdout + run.stderr[-3000:]
    for line in lines:  # "naive ahead 1: registers 114, stack 0 B; loop 410 instructions, 1.60 a weight (8 ...), ..."
        assert "stack 0 B" in line and "local in the loop 0;" in line, line
        # the gate-up 1.60-1.65 on Triton 3.6 / 3.9, the down (one bf16x2 fma a pair more) 1.97
        assert float(line.split(" instructions, ")[1].split(" a weight")[0]) <= 2.0, line
        # a step: 4 loads of words, 8 of x / h; the loop runs ahead + 1 steps
        assert f"'LDG.E.128': {12 * (ahead + 1)}" in line, line


def test_ahead_is_refused_by_name_outside_its_values():
    with pytest.raises(ValueError, match="ahead must be one of"):
        check_ahead(3)


def test_down_split_takes_the_fewest_splits_that_fill_the_device():
    assert down_split(14336, 4096, 2) == 4  # Mixtral M = 1: 2 x 64 row tiles, 56 steps -> 4 x 128 = 512 programs
    assert down_split(2048, 7168, 8) == 1  # DeepSeek-V3 M = 1: 8 x 112 = 896 programs unsplit
    assert down_split(768, 2048, 8) == 3  # Qwen3 M = 1: 3 steps, 8 x 32 x 3 = 768
    assert down_split(512, 128, 1) == 2  # too few programs at any split: the finest


@pytest.mark.parametrize("scheme, named", [("cpu", "CUDA"), ("int8", "int4_w4a16 or mxfp4"), ("map", "expert_map")])
def test_the_selectable_decode_refuses_what_it_does_not_run(scheme, named):
    from moekit.experts.triton_wo import run_experts_wo

    n, k = 256, 512
    w13, w2 = weight_args(*_int4(4, 2 * n, k, 128), 128), weight_args(*_int4(4, k, n, 128), 128)
    x, ids, weights = torch.zeros(1, k, dtype=torch.bfloat16), torch.tensor([[0, 1]]), torch.ones(1, 2)
    expert_map = torch.arange(4) if scheme == "map" else None
    with pytest.raises(ValueError, match=named):
        run_experts_wo(x, w13, w2, ids, weights, expert_map, "int8_w8a16" if scheme == "int8" else "int4_w4a16",
                       decode="gluon_words")


def test_the_x_launch_matches_its_torch_twin():
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(3)).bfloat16()
    got, want = x_words(x), x_words_torch(x)
    assert torch.equal(got.x, want.x)
    assert torch.allclose(got.sums, want.sums, rtol=1e-5, atol=1e-5)  # float32 sums in another order


def test_the_down_gemm_operands_match_a_float64_loop():
    """The down kernel's arithmetic in its operand order: each half step's words (16 c .. 16 c + 15 of the step)
    decoded exactly (``exact_half_torch``) against h in the stored order the gate-up writes (``x_halves_torch``),
    times the group's scale and the routed weight, against a float64 loop over dequantized w2."""
    e, k, n, group = 2, 8, 512, 128
    q, scale, zero = _int4(e, k, n, group, seed=5)
    h = torch.randn(3, n, generator=torch.Generator().manual_seed(6)).bfloat16()
    stored = x_words_torch(h).x
    experts, routed = [1, 0, 1], [0.5, 0.25, 2.0]
    for a, (expert, weight) in enumerate(zip(experts, routed)):
        words = q[expert].contiguous().view(torch.int32).long()  # [K, N / 8]
        y = torch.zeros(k, dtype=torch.float64)
        for s in range(n // 256):
            halves = x_halves_torch(stored[a:a + 1, 256 * s:256 * s + 256].double())
            for c in range(2):
                grp = (256 * s + 128 * c) // group
                a_op = exact_half_torch(words[:, 32 * s + 16 * c:32 * s + 16 * c + 16], zero[expert, :, grp].long())
                y += (a_op.double() @ halves[c][:, 0]) * scale[expert, :, grp].double()
        want = torch.zeros(k, dtype=torch.float64)
        for r in range(k):
            for col in range(n):
                grp = col // group
                w = (_code(q[expert, r], col) - int(zero[expert, r, grp])) * float(scale[expert, r, grp])
                want[r] += w * float(h[a, col])
        assert torch.allclose(y * weight, want * weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_loop_decodes_every_step_once_in_order_from_its_own_loads(monkeypatch, ahead):
    """The main loop's Python body (``_loop_ahead1`` / ``_loop_ahead2``, as written) run with loads that return their
    offsets and a ``_step`` that records what it is given: for 1-10 steps, each step decoded once, in order, with its
    own words, activations and column, and no load outside the steps (the loads are unmasked)."""
    import moekit.experts._kernels.gluon_wo_words as gw

    value = lambda v: getattr(v, "value", v)  # noqa: E731  (the module's constexprs)
    loads = []

    class FakeGl:
        @staticmethod
        def load(offset):
            loads.append(value(offset))
            return value(offset)

        @staticmethod
        def minimum(a, b):
            return min(value(a), value(b))

    monkeypatch.setattr(gw, "gl", FakeGl)
    monkeypatch.setattr(gw, "_step", lambda acc, zeros, w, x, col, *rest: acc + [(value(w), value(x), value(col))])
    loop = (gw._loop_ahead1 if ahead == 1 else gw._loop_ahead2).fn
    w0, x0, col0 = 1 << 20, 1 << 24, 512  # the words' and activations' first offsets, the first column
    for steps in range(1, 11):
        loads.clear()
        done = loop([], None, w0, x0, steps, col0, 0, 0, 0, 0, 0, 0, 0, 0, 128, False, 4)
        assert done == [(w0 + 32 * i, x0 + 128 * i, col0 + 256 * i) for i in range(steps)], (steps, done)
        words = [o - w0 for o in loads if o < x0]
        acts = [o - x0 for o in loads if o >= x0]
        assert all(0 <= o < 32 * steps for o in words) and all(0 <= o < 128 * steps for o in acts), steps
