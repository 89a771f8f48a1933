"""The words decode as the route's default in its measured cells (``triton_wo_words_default``) on the CPU: the rule
(nearest measured M within a factor 2, a Hopper with Gluon and never the interpreter, no expert map, gated SiLU,
weights the words kernels take, no padded copy) against expectations written here from the rule on a table made
here; then, with the Gluon kernels as torch stand-ins (``_words_fakes``) and the device predicates patched, a default
call takes the same path as ``decode="gluon_words"`` (the same launches, bit-equal outputs, a float64 loop's values)
through ``run_experts_wo``, the ``fused_experts_wo`` op and ``experts_triton`` on ``moekit.quant`` weights, whose
repeated eager calls the fast path serves from a words entry (no fused sequence recorded, no recording retried)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from _words_fakes import E, K, N, routing, stand_ins  # noqa: F401  (a fixture)
from test_triton_wo_words_lean import _weight, loop64
from moekit.activations import ActivationSpec
import moekit.experts.triton_wo_words_default as twd
import moekit.experts.triton_wo_words_route as route

KEY = ("int4_w4a16", E, N, K)
ROW = {1: True, 8: True, 32: False}  # measured M -> the words won there


def _cuda_x(m: int, k: int = K):
    """What the rule reads of x (shape, device) for a CUDA tensor, without one."""
    return types.SimpleNamespace(shape=(m, k), device=torch.device("cuda", 0))


@pytest.mark.parametrize("m, want", [(1, True), (2, True), (3, False), (4, True), (12, True), (16, True),
                                     (17, False), (24, False), (64, False), (65, False)])
def test_the_nearest_measured_m_within_a_factor_2_decides(m, want):
    """M = 1..2 from m = 1; 4..16 from m = 8 (16: a tie between 8 and 32, the smaller wins); 17..64 nearest to 32,
    which lost; none covers 3 or past 64."""
    assert twd.measured_win(ROW, m) is want


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper with Gluon as device 0 (``triton_gluon_launch._hopper_with_gluon``), this test's row in the table."""
    import moekit.experts.triton_gluon_launch as launch

    monkeypatch.setattr(launch, "_hopper_with_gluon", lambda index: True)
    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS", {KEY: ROW})
    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS_BY_DEVICE", {})
    monkeypatch.setattr(twd, "call_device_key", lambda device: "NVIDIA_TEST")
    monkeypatch.setattr(twd, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_the_rule_covers_a_measured_cell_on_a_hopper_only(hopper, monkeypatch):
    w13 = types.SimpleNamespace(q=torch.empty(E, 2 * N, K // 2, dtype=torch.uint8))
    covers = twd.words_default_covers
    assert covers(_cuda_x(1), w13, "int4_w4a16", "silu", None)
    assert not covers(_cuda_x(3), w13, "int4_w4a16", "silu", None)  # no measured M near
    assert not covers(_cuda_x(1), w13, "mxfp4", "silu", None)  # another scheme: another row (none)
    assert not covers(_cuda_x(1, 2 * K), w13, "int4_w4a16", "silu", None)  # another K
    assert not covers(_cuda_x(1), w13, "int4_w4a16", "silu", torch.arange(E))  # an expert map
    assert not covers(_cuda_x(1), w13, "int4_w4a16", ActivationSpec("gelu"), None)
    assert not covers(_cuda_x(1), w13, "int4_w4a16", ActivationSpec("silu", gated=False), None)
    assert covers(_cuda_x(1), w13, "int4_w4a16", ActivationSpec("silu", interleaved=True, limit=7.0), None)
    assert not covers(types.SimpleNamespace(shape=(1, K), device=torch.device("cpu")), w13, "int4_w4a16", "silu", None)
    monkeypatch.setattr(twd, "ENABLED", False)
    assert not covers(_cuda_x(1), w13, "int4_w4a16", "silu", None)
    monkeypatch.setattr(twd, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter never takes it, even on a Hopper
    assert not covers(_cuda_x(1), w13, "int4_w4a16", "silu", None)


def test_a_device_s_own_row_replaces_the_default_row_there_only(hopper, monkeypatch):
    w13 = types.SimpleNamespace(q=torch.empty(E, 2 * N, K // 2, dtype=torch.uint8))
    covers = twd.words_default_covers
    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS_BY_DEVICE", {"NVIDIA_TEST": {KEY: {1: False, 3: True}}})
    assert not covers(_cuda_x(1), w13, "int4_w4a16", "silu", None)  # the device's row: lost at 1
    assert covers(_cuda_x(3), w13, "int4_w4a16", "silu", None)  # won at 3, which the default row never measured
    monkeypatch.setattr(twd, "call_device_key", lambda device: "NVIDIA_OTHER")
    assert covers(_cuda_x(1), w13, "int4_w4a16", "silu", None)  # another device: the default row
    assert not covers(_cuda_x(3), w13, "int4_w4a16", "silu", None)


def test_the_table_holds_to_its_rule():
    """Rows the words kernels run without a padded copy (int4 / mxfp4, N and K on the 256 grid: never gpt-oss's
    2880), each with a measured M it won; a device's own rows replace rows of the default table."""
    device_rows = [row for rows in twd.WORDS_DEFAULT_CELLS_BY_DEVICE.values() for row in rows.items()]
    assert all(key in twd.WORDS_DEFAULT_CELLS for key, _ in device_rows)
    for (scheme, num_experts, n, k), row in [*twd.WORDS_DEFAULT_CELLS.items(), *device_rows]:
        assert scheme in route.WORDS_SCHEMES and num_experts >= 1 and n % 256 == 0 and k % 256 == 0
        assert any(row.values()) and all(m >= 1 for m in row)


@pytest.fixture
def on_cpu(stand_ins, monkeypatch):
    """The words path on the CPU (the rest interpreted): the kernels' stand-ins, this test's row in the table, the
    device predicates true for a CPU tensor."""
    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS", {KEY: ROW})
    monkeypatch.setattr(twd, "ENABLED", True)
    monkeypatch.setattr(twd, "gluon_supported", lambda device: True)
    monkeypatch.setattr(route, "runs_on", lambda device: True)
    return stand_ins


def _launches(fakes) -> list:
    """Each stand-in's launches: (grid, the constexprs and scalars), tensors as their shape and dtype."""
    def plain(v):
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v

    return [(grid, {k: plain(v) for k, v in bound.items()}) for f in fakes.values() for grid, bound, _ in f.log]


@pytest.mark.parametrize("scheme, m", [("int4_w4a16", 1), ("int4_w4a16", 5), ("mxfp4", 8)])
def test_a_default_call_takes_the_path_decode_gluon_words_names(on_cpu, monkeypatch, scheme, m):
    from moekit.experts.triton_wo import run_experts_wo

    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS", {(scheme, E, N, K): ROW})
    mx = scheme == "mxfp4"
    w13, w2 = _weight(2 * N, K, 1, mx), _weight(K, N, 2, mx)
    x, ids, weights = routing(m, m)
    named = run_experts_wo(x, w13, w2, ids, weights, None, scheme, decode="gluon_words")
    named_launches = _launches(on_cpu)
    for fake in on_cpu.values():
        fake.log.clear()
    default = run_experts_wo(x, w13, w2, ids, weights, None, scheme)
    assert torch.equal(default, named) and _launches(on_cpu) == named_launches != []
    want = loop64(x, w13, w2, ids, weights)
    assert ((default.double() - want).norm() / want.norm()).item() < 1e-2


def test_weights_the_kernels_do_not_take_fall_back_to_the_pick(on_cpu):
    """``run_experts_words(default=True)`` returns None (the route then runs the pick) where the words kernels refuse
    the call, launching nothing: int4 groups of 64, fp16 x, mxfp4 scales past the decode's range (a named call
    refuses each by name); mxfp4 off the 256 grid, where a default never makes the padded copy."""
    from moekit.experts import triton_wo_words_pad as pad

    x, ids, weights = routing(1, 3)
    int4 = (_weight(2 * N, K, 1, False), _weight(K, N, 2, False))
    big = (_weight(2 * N, K, 1, True), _weight(K, N, 2, True))
    big[0].scale[0, 0, 0] = 200
    refused = [(x, *(dataclasses.replace(w, group_size=64) for w in int4), "int4_w4a16"),
               (x.half(), *int4, "int4_w4a16"), (x, *big, "mxfp4")]
    for x_case, w13, w2, scheme in refused:
        assert route.run_experts_words(x_case, w13, w2, ids, weights, None, scheme, "silu", default=True) is None
        with pytest.raises(ValueError, match="gluon_words"):
            route.run_experts_words(x_case, w13, w2, ids, weights, None, scheme, "silu")
    pad.clear_padded()
    off = (_weight(2 * 320, 320, 1, True), _weight(320, 320, 2, True))
    x_off = torch.randn(1, 320).bfloat16()
    assert route.run_experts_words(x_off, *off, ids, weights, None, "mxfp4", "silu", default=True) is None
    assert not pad._KEPT  # no padded copy made
    assert all(not fake.log for fake in on_cpu.values())


@pytest.mark.parametrize("scheme, m", [("int4_w4a16", 1), ("mxfp4", 5)])
def test_the_client_takes_the_default_and_its_fast_path_serves_the_words(on_cpu, monkeypatch, scheme, m):
    """``experts_triton`` on ``moekit.quant`` weights, the ``fused_experts_wo`` op, eager and compiled: the named call's
    output (the compiled one through the words kernels too); the first eager call keeps a words entry (no fused
    sequence), the next ones are served by it through the words' own kept sequence, never asking to record again."""
    from _helpers import bf16_quantized_pair, count_served
    from moekit.experts import triton_fast, triton_quant_fast as tqf
    from moekit.experts.triton import experts_triton
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import fused_experts_wo, run_experts_wo, weight_args

    monkeypatch.setattr(twd, "WORDS_DEFAULT_CELLS", {(scheme, E, N, K): ROW})
    tqf.clear_quant_fast()
    q13, q2 = bf16_quantized_pair(scheme, E, N, K)
    a13, a2 = (weight_args(w.q, w.scale, getattr(w, "zero", None), w.group_size) for w in (_wo(q13), _wo(q2)))
    x, ids, weights = routing(m, 5)
    named = run_experts_wo(x, a13, a2, ids, weights, None, scheme, decode="gluon_words")
    want = loop64(x, a13, a2, ids, weights)
    assert ((named.double() - want).norm() / want.norm()).item() < 1e-2
    served = count_served(monkeypatch, triton_fast, "run_quant_fast")
    asked = count_served(monkeypatch, tqf, "_lean_inputs")  # what a kept call is recorded from
    outs = [experts_triton(x, q13, q2, ids, weights) for _ in range(4)]
    assert all(torch.equal(out, named) for out in outs)
    # the named call compiled the launches: call 1 records the words' sequence and keeps the entry, 2-4 are served
    assert served == [3] and asked == [1]
    (entry,) = tqf._MEMO.values()
    assert entry.sequence is None and entry.words == route.words_call_variant("silu", None, None)
    assert torch.equal(fused_experts_wo(x, _wo(q13), _wo(q2), ids, weights), named)
    compiled = torch.compile(lambda x, ids, weights: fused_experts_wo(x, _wo(q13), _wo(q2), ids, weights),
                             backend="eager", fullgraph=True)  # the op's body runs the route at run time
    for fake in on_cpu.values():
        fake.log.clear()
    assert torch.equal(compiled(x, ids, weights), named) and all(fake.log for fake in on_cpu.values())
