"""The weight-only Gluon path (``decode="gluon"``, ``triton_gluon_wo``) on the CPU: its torch twin and its launches
(the Gluon GEMM faked in torch, ``_gluon_fakes.wo_gemm``; the layout and combine kernels interpreted) against a
float64 loop, and the calls it refuses. The GEMM itself needs a Hopper GPU: ``benchmarks/wolean_device_check.py``
checks the path against the reference, the twin and its plain launch at real shapes (session 27's
``wol7_device_check.py`` is removed: ``git show 87f368f6:benchmarks/wol7_device_check.py``);
``benchmarks/wol7_compile_cpu.py`` compiles it for sm_90 here."""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import experts_loop
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_wo import experts_gluon_wo_twin, gluon_wo_unfit, run_experts_wo_gluon
from moekit.experts.triton_wo import WoWeight, run_experts_wo, weight_args

E, N, K = 4, 128, 256  # N and K: multiples of the 128-wide output tiles


def _int8(rows: int, cols: int, seed: int) -> WoWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (E, rows, cols), generator=g, dtype=torch.int8)
    scale = (torch.rand(E, rows, generator=g) + 0.5) / (74 * cols**0.5)
    return WoWeight("int8_w8a16", q, scale)


def _int4(rows: int, cols: int, seed: int, group: int = 128) -> WoWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(E, rows, cols // group, generator=g) + 0.5) / (4.6 * cols**0.5)  # std(code - zero) ~ 4.6
    zero = torch.randint(0, 16, (E, rows, cols // group), generator=g, dtype=torch.uint8)
    return WoWeight("int4_w4a16", q, scale, zero, group)


def _mxfp4(rows: int, cols: int, seed: int) -> WoWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(119, 124, (E, rows, cols // 32), generator=g, dtype=torch.uint8)  # ~ 1 / (2.9 sqrt(C))
    return WoWeight("mxfp4", q, scale, None, 32)


def _weights(scheme: str) -> tuple[WoWeight, WoWeight]:
    make = {"int8_w8a16": _int8, "int4_w4a16": _int4, "mxfp4": _mxfp4}[scheme]
    return make(2 * N, K, 1), make(K, N, 2)


def _call(m: int, k: int = 2, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return x, ids, weights


def _dense64(w: WoWeight) -> torch.Tensor:
    """The weight w stores, float64 [E, R, C], decoded here: int8 q * scale per row; int4 (code - zero) * scale per
    group along C, mxfp4 e2m1(code) * 2^(e8m0 - 127) per 32; code 2i the low nibble of byte i."""
    if w.scheme == "int8_w8a16":
        return w.q.double() * w.scale.double()[:, :, None]
    codes = torch.stack((w.q & 15, w.q >> 4), dim=-1).reshape(*w.q.shape[:2], -1)
    per = torch.arange(codes.shape[2]) // w.group_size
    if w.scheme == "mxfp4":  # e2m1: sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6; e8m0 scale 2^(s - 127)
        magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[codes.long() & 7]
        return torch.where(codes >= 8, -magnitude, magnitude) * torch.exp2(w.scale[:, :, per].double() - 127)
    return (codes.double() - w.zero[:, :, per].double()) * w.scale[:, :, per].double()


def _f64(x, w13: WoWeight, w2: WoWeight, ids, weights) -> torch.Tensor:
    """out[t] = sum_j weight * W2[e] @ (silu(g) * u), float64, one slot at a time (``_helpers.experts_loop``)."""
    return experts_loop(x, _dense64(w13), _dense64(w2), ids, weights)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
def test_twin_matches_a_float64_loop(scheme):
    w13, w2 = _weights(scheme)
    x, ids, weights = _call(40)
    out = experts_gluon_wo_twin(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 1e-2


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
@pytest.mark.parametrize("m", [1, 40, 300])  # one row; blocks part full; an expert over two 128-row blocks
def test_gluon_decode_matches_a_float64_loop(fake_gemms, m, scheme):
    w13, w2 = _weights(scheme)
    x, ids, weights = _call(m)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    out = run_experts_wo(x, a13, a2, ids, weights, None, scheme, decode="gluon")
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2
    launches = fake_gemms["wo"].log
    assert [bound["GATED"] for _, bound, _ in launches] == [True, False]  # gate-up, then down
    assert [bound["W_ROWS"] for _, bound, _ in launches] == [2 * N, K]
    params = set(fake_gemms["wo"]._params)
    assert all(set(bound) == params for _, bound, _ in launches)  # every parameter passed (none left to a default)
    kernel_scheme = {"int8_w8a16": 0, "int4_w4a16": 1, "mxfp4": 2}[scheme]
    assert [bound["SCHEME"] for _, bound, _ in launches] == [kernel_scheme] * 2


def test_tiles_reach_the_kernel(fake_gemms):
    from moekit.experts.triton_gluon_launch import GluonTile

    w13, w2 = _int8(2 * N, K, 1), _int8(K, N, 2)
    x, ids, weights = _call(16)
    up, down = GluonTile(128, 64, 3), GluonTile(128, 64, 5)
    run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", up_tile=up, down=down)
    assert [bound["STAGES"] for _, bound, _ in fake_gemms["wo"].log] == [3, 5]


@pytest.mark.parametrize("case, reason", [
    ("scheme", "scheme 'fp8_block'"), ("group", "int4 groups 32"), ("dtype", "x torch.float16"),
    ("act", "activation='gelu'"), ("strided", "strided w13.q"), ("narrow", "multiples of 128"),
])
def test_unfit_calls_name_their_reason(case, reason):
    w13, w2 = _int8(2 * N, K, 1), _int8(K, N, 2)
    x = torch.randn(4, K).bfloat16()
    scheme, act = "int8_w8a16", "silu"
    if case == "scheme":
        scheme = "fp8_block"
    elif case == "group":
        scheme, w13 = "int4_w4a16", _int4(2 * N, K, 1, group=32)
        w2 = _int4(K, N, 2)
    elif case == "dtype":
        x = x.half()
    elif case == "act":
        act = "gelu"
    elif case == "strided":
        w13 = WoWeight("int8_w8a16", w13.q.transpose(1, 2).contiguous().transpose(1, 2), w13.scale)
    else:
        w13 = _int8(2 * 64, K, 1)  # N = 64
    assert reason in gluon_wo_unfit(x, w13, w2, scheme, act)


def test_off_hopper_the_call_raises():
    w13, w2 = _int8(2 * N, K, 1), _int8(K, N, 2)
    x, ids, weights = _call(4)
    with pytest.raises(RuntimeError, match="Hopper"):
        run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16")


def test_measured_cells_start_where_the_cheap_test_looks():
    from moekit.experts.configs import KNOWN_DEVICES
    from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS, GLUON_WO_CELLS_BY_DEVICE, GLUON_WO_SCHEMES
    from moekit.experts.triton_wo import GLUON_MIN_TOKENS

    tables = [GLUON_WO_CELLS, *GLUON_WO_CELLS_BY_DEVICE.values()]
    assert all(GLUON_MIN_TOKENS <= lo < hi for table in tables for lo, hi in table.values())
    assert all(scheme in GLUON_WO_SCHEMES for table in tables for scheme, *_ in table)
    assert set(GLUON_WO_CELLS_BY_DEVICE) <= set(KNOWN_DEVICES)  # names as device_key spells them


def test_a_device_row_replaces_the_default_row_on_that_device_only(monkeypatch):
    """GLUON_WO_CELLS_BY_DEVICE: the H100's Qwen3 4-bit rows reach 4096..8191 there (session 40's M = 4096), the
    H200's default row elsewhere; a shape without a device row keeps the default on every device; and the route's
    test reads the row of the call's device."""
    import moekit.experts.triton_gluon_wo as tgw

    qwen3, h100 = (128, 768, 2048), "NVIDIA_H100_80GB_HBM3"
    for scheme, default in (("int4_w4a16", (2048, 4096)), ("mxfp4", (1024, 4096))):
        assert tgw.GLUON_WO_CELLS[(scheme, *qwen3)] == default  # the H200's rows unchanged
        assert tgw.gluon_wo_range(scheme, *qwen3, "NVIDIA_H200") == default
        assert tgw.gluon_wo_range(scheme, *qwen3, "cpu") == default
        lo, hi = tgw.gluon_wo_range(scheme, *qwen3, h100)
        assert lo == default[0] and lo < 4096 < hi == 8192
    mixtral_int8 = ("int8_w8a16", 8, 14336, 4096)
    assert tgw.gluon_wo_range(*mixtral_int8, h100) == tgw.GLUON_WO_CELLS[mixtral_int8] == (128, 4096)
    assert tgw.gluon_wo_range("int8_w8a16", 3, 5, 7, h100) == (0, 0)  # no row: never

    w13, w2 = _weights("int8_w8a16")
    x, ids, _ = _call(600)
    monkeypatch.setattr(tgw, "gluon_supported", lambda device: True)
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS", {("int8_w8a16", E, N, K): (100, 200)})
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS_BY_DEVICE", {"NVIDIA_TEST": {("int8_w8a16", E, N, K): (512, 1024)}})
    assert not tgw.gluon_wo_takes(x, w13, w2, ids, "int8_w8a16", "silu")  # this CPU: the default row, 600 outside
    monkeypatch.setattr(tgw, "call_device_key", lambda device: "NVIDIA_TEST")
    assert tgw.gluon_wo_takes(x, w13, w2, ids, "int8_w8a16", "silu")  # the device's row holds 600


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16"])
def test_a_measured_cell_takes_the_path_without_a_decode(fake_gemms, monkeypatch, scheme):
    import moekit.experts.triton_gluon_wo as tgw
    import moekit.experts.triton_wo as two
    from moekit.experts.triton_gluon_wo_lean import WoLeanPlan

    w13, w2 = _weights(scheme)
    x, ids, weights = _call(600)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS", {(scheme, E, N, K): (600, 601)})
    out = run_experts_wo(x, a13, a2, ids, weights, None, scheme)
    assert len(fake_gemms["wo"].log) == 2 and _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2
    plan = two.wo_lean_inputs(x, w13, w2, ids, weights, "silu", two.LaunchOptions())[0]  # kept: its lean launch's
    named = dict(zip(plan.up._named, plan.up.tail[len(plan.up.tail) - len(plan.up._named):]))  # the constexprs
    assert isinstance(plan, WoLeanPlan) and named["SCHEME"] == {"int8_w8a16": 0, "int4_w4a16": 1}[scheme]
    run_experts_wo(x[:599], a13, a2, ids[:599], weights[:599], None, scheme)  # below the range: the chooser's decode
    assert len(fake_gemms["wo"].log) == 2
    x2, ids2, _ = _call(601)
    assert not tgw.gluon_wo_takes(x2, a13, a2, ids2, scheme, "silu")  # past its end


def test_off_hopper_a_measured_cell_keeps_the_triton_kernels(monkeypatch):
    import moekit.experts.triton_gluon_wo as tgw

    w13, w2 = _weights("int8_w8a16")
    x, ids, _ = _call(600)
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS", {("int8_w8a16", E, N, K): (512, 1024)})
    assert not tgw.gluon_wo_takes(x, w13, w2, ids, "int8_w8a16", "silu")  # the CPU: no Gluon
    monkeypatch.setattr(tgw, "gluon_supported", lambda device: True)
    assert tgw.gluon_wo_takes(x, w13, w2, ids, "int8_w8a16", "silu")
    assert not tgw.gluon_wo_takes(x, w13, w2, ids, "int8_w8a16", "gelu")  # a call it does not fit


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
def test_options_reach_the_kernel(fake_gemms, scheme):
    from moekit.experts.triton_gluon_wo import GluonWoOptions

    w13, w2 = _weights(scheme)
    x, ids, weights = _call(40)
    out = run_experts_wo_gluon(x, w13, w2, ids, weights, None, scheme, options=GluonWoOptions(split=True, fast=True))
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2
    for _, bound, options in fake_gemms["wo"].log:
        fast = scheme != "int8_w8a16"  # int8's decode has no FAST form
        assert bound["SPLIT"] and bound["FAST"] == fast and options["num_warps"] == 4  # one warpgroup a partition
        assert bound["c_desc"].block_shape == [128, 64]  # each partition stores its half of the 128 columns
        words = bound["q_desc"].base.dtype == torch.int32
        assert words == fast or (words and scheme == "int4_w4a16")  # FAST mxfp4 reads int32 words as int4 does
        assert bound["q_desc"].block_shape[1] == 64 // (8 if words else {"int8_w8a16": 1, "mxfp4": 2}[scheme])


def test_a_measured_shape_takes_its_variant(fake_gemms, monkeypatch):
    import moekit.experts.triton_gluon_wo as tgw

    w13, w2 = _weights("int4_w4a16")
    x, ids, weights = _call(40)
    measured = tgw.GluonWoGemms(tgw.GluonWoOptions(split=True), tgw.GluonWoOptions(fast=True, slots=3))
    monkeypatch.setattr(tgw, "GLUON_WO_OPTIONS", {("int4_w4a16", E, N, K): tgw.MeasuredGemms(40, 80, measured)})
    run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16")
    run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16", options=tgw.GluonWoOptions())  # named: taken
    run_experts_wo_gluon(x[:39], w13, w2, ids[:39], weights[:39], None, "int4_w4a16")  # below the measured M
    assert [(b["SPLIT"], b["FAST"], b["SLOTS"]) for _, b, _ in fake_gemms["wo"].log] == [
        (True, False, 2), (False, True, 3)] + [(False, False, 2)] * 4  # gate-up, down; then the session-27 kernel
    with pytest.raises(ValueError, match="slots=4"):
        tgw.GluonWoOptions(slots=4)
