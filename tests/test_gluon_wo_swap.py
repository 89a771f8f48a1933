"""The swapped weight-only Gluon GEMM's host side (``GluonWoOptions(swap=True)``, ``_kernels/gluon_gemm_wo_swap.py``)
on the CPU: the kernel as its torch stand-in (``_gluon_fakes.wo_gemm``: the same product), the layout and combine
interpreted. Its launches (plain and lean) hand it every parameter, its ring, tiles and warps, and none of the
session-27 kernel's variant constexprs; the call matches a float64 loop, on one GEMM or both; what it cannot take is
refused by name. The kernel itself: ``benchmarks/wo4k_compile_cpu.py`` (sm_90 offline); session 29 ran it on
the H200 in ``wo4k_device_check.py`` (removed: ``git show 87f368f6:benchmarks/wo4k_device_check.py``)."""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from test_gluon_wo_fast import _bf16_bits, _f32_bits, _f32_value, run_ptx
from test_triton_gluon_wo import E, K, N, _call, _f64, _rel, _weights
from moekit.experts.triton_gluon_wo import GluonWoGemms, GluonWoOptions, run_experts_wo_gluon

SWAP = GluonWoOptions(swap=True)


@pytest.mark.parametrize("fast, split", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("m", [1, 40, 300])  # one row; blocks part full; an expert over two 128-row blocks
def test_swap_matches_a_float64_loop(fake_gemms, lean, m, fast, split):
    w13, w2 = _weights("int8_w8a16")
    x, ids, weights = _call(m)
    options = GluonWoOptions(swap=True, fast=fast, split=split)
    out = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", lean=lean, options=options)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2
    assert fake_gemms["wo"].log == []  # the session-27 kernel never launched
    launches = fake_gemms["wo_swap"].log
    params = set(fake_gemms["wo_swap"]._params)
    assert all(set(bound) == params for _, bound, _ in launches)  # every parameter passed, none left to a default
    assert "SLOTS" not in params
    got = [(b["GATED"], b["W_ROWS"], b["GATE_OFFSET"], b["STAGES"], b["FAST"], b["SPLIT"]) for _, b, _ in launches]
    assert got == [(True, 2 * N, N, 6, fast, split), (False, K, 0, 8, fast, split)]  # gate-up, down; swap_stages
    for grid, bound, compiled in launches:
        assert compiled["num_warps"] == (4 if split else 8) and compiled["maxnreg"] == 168  # split: a warpgroup
        assert bound["q_desc"].base.dtype == torch.int8 and bound["q_desc"].block_shape == [128, 64]
        assert bound["a_desc"].block_shape == [128, 64]
        assert bound["c_desc"].block_shape == [128, 64 if split else 128]  # split: a partition's half
        assert bound["num_col_blocks"] == bound["c_desc"].base.shape[1] // 128 and grid[1:] == (1, 1)


def test_lean_swap_equals_plain(fake_gemms):
    w13, w2 = _weights("int8_w8a16")
    x, ids, weights = _call(300)
    plain = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", lean=False, options=SWAP)
    lean = [run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", options=SWAP) for _ in range(2)]
    assert torch.equal(lean[0], plain) and torch.equal(lean[1], plain)
    plain_log, lean_log = fake_gemms["wo_swap"].log[:2], fake_gemms["wo_swap"].log[2:4]
    for (g0, b0, o0), (g1, b1, o1) in zip(plain_log, lean_log):
        assert g0 == g1 and o0 == o1
        assert b0.keys() == b1.keys()
        assert all(b0[k] == b1[k] for k in b0 if isinstance(b0[k], (int, bool)))  # scalars and constexprs
        assert all(b0[k].block_shape == b1[k].block_shape for k in ("a_desc", "q_desc", "c_desc"))


@pytest.mark.parametrize("which", ["up", "down"])
def test_swap_on_one_gemm(fake_gemms, which):
    w13, w2 = _weights("int8_w8a16")
    x, ids, weights = _call(40)
    gemms = GluonWoGemms(SWAP, GluonWoOptions(slots=3)) if which == "up" else GluonWoGemms(GluonWoOptions(), SWAP)
    out = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", options=gemms)
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2
    swapped = [b["GATED"] for _, b, _ in fake_gemms["wo_swap"].log]
    base = [(b["GATED"], b["SLOTS"]) for _, b, _ in fake_gemms["wo"].log]
    assert (swapped, base) == (([True], [(False, 3)]) if which == "up" else ([False], [(True, 2)]))


@pytest.mark.parametrize("scheme, gated, stages", [("int8_w8a16", True, 6), ("int8_w8a16", False, 8),
                                                   ("int4_w4a16", True, 8), ("int4_w4a16", False, 8)])
def test_swap_fills_the_shared_memory(scheme, gated, stages):
    from moekit.experts.triton_gluon_launch import SHARED_BYTES
    from moekit.experts.triton_gluon_wo import swap_stages

    def smem(n: int) -> int:  # n stages of bf16 activations [128, 64] and codes [128, 64 / a byte's], the output
        return n * (128 * 64 * 2 + (2 if gated else 1) * 128 * 64 // (1 if scheme == "int8_w8a16" else 2)) + 32768

    assert swap_stages(scheme, gated) == stages
    assert smem(stages) + 2 * 8 * stages <= SHARED_BYTES and (stages == 8 or smem(stages + 1) > SHARED_BYTES - 1024)


@pytest.mark.parametrize("scheme, options", [("mxfp4", SWAP), ("int4_w4a16", GluonWoOptions(swap=True, fast=True))])
def test_swap_refuses_what_it_cannot_decode(scheme, options):
    from moekit.experts.triton_gluon_launch import UP_TILE
    from moekit.experts.triton_gluon_wo import wo_gemm_launch

    with pytest.raises(ValueError, match="swap takes int8_w8a16"):
        wo_gemm_launch(scheme, UP_TILE, True, options)
    with pytest.raises(ValueError, match="swap takes no third slot"):
        GluonWoOptions(swap=True, slots=3)


def test_fast_int8_pairs_convert_exactly():
    """FAST's inline PTX (``gluon_gemm_wo_swap._INT8_ASM``) in ``test_gluon_wo_fast``'s emulator: two codes of a K
    pair (a 16-bit load, the low byte the first) -> their bf16x2, the first the low half; every byte in each place."""
    from moekit.experts._kernels.gluon_gemm_wo_swap import _INT8_ASM

    g = torch.Generator().manual_seed(0)
    pairs = [b | o << 8 for b in range(256) for o in (0, 0x7F, 0x80, 0xFF)]
    pairs += [o | b << 8 for b in range(256) for o in (0, 0x01, 0x80, 0xFE)]
    pairs += torch.randint(0, 1 << 16, (256,), generator=g).tolist()
    for pair in pairs:
        codes = [(pair >> s & 0xFF) - (256 if pair >> s & 0x80 else 0) for s in (0, 8)]  # int8 values
        want = _bf16_bits(float(codes[0])) | _bf16_bits(float(codes[1])) << 16
        magic = 0x43004300  # the kernel's runtime magic, and magic ^ 0x80008000, each passed twice (pack 2)
        assert run_ptx(_INT8_ASM.value, [None, pair, magic, magic, magic ^ 0x80008000, magic ^ 0x80008000], 1) == [
            want], hex(pair)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("m", [40, 300])
def test_int4_swap_matches_a_float64_loop(fake_gemms, m, split):
    w13, w2 = _weights("int4_w4a16")
    x, ids, weights = _call(m)
    options = GluonWoOptions(swap=True, split=split)
    outs = [run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16", lean=lean, options=options)
            for lean in (False, True)]
    assert torch.equal(outs[0], outs[1]) and _rel(outs[1], _f64(x, w13, w2, ids, weights)) < 2e-2
    assert fake_gemms["wo"].log == []
    for _, bound, _ in fake_gemms["wo_swap"].log:  # the codes as bytes [.., K / 2], groups of 128, their zeros
        assert bound["q_desc"].base.dtype == torch.uint8 and bound["q_desc"].block_shape == [128, 32]
        assert (bound["SCHEME"], bound["GROUP"], bound["STAGES"], bound["SPLIT"]) == (1, 128, 8, split)
        assert bound["z_ptr"].dtype == torch.uint8 and bound["stride_zg"] == 1


def test_measured_options_lie_in_their_cells():
    from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS, GLUON_WO_OPTIONS

    for key, measured in GLUON_WO_OPTIONS.items():  # a variant only where a call takes the path at all
        lo, hi = GLUON_WO_CELLS[key]
        assert lo <= measured.lo < measured.hi <= hi, key


def test_a_measured_int8_cell_takes_the_split_ptx_swap(fake_gemms, monkeypatch):
    import moekit.experts.triton_gluon_wo as tgw

    w13, w2 = _weights("int8_w8a16")
    x, ids, weights = _call(40)
    taken = tgw.GLUON_WO_OPTIONS[("int8_w8a16", 256, 2048, 7168)]  # DeepSeek-V3's, on this test's shape
    monkeypatch.setattr(tgw, "GLUON_WO_OPTIONS", {("int8_w8a16", E, N, K): tgw.MeasuredGemms(40, 80, taken.gemms)})
    out = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16")
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2 and fake_gemms["wo"].log == []
    assert [(b["GATED"], b["FAST"], b["SPLIT"]) for _, b, _ in fake_gemms["wo_swap"].log] == [
        (True, True, True), (False, True, True)]



def test_a_measured_int4_cell_takes_the_split_swap(fake_gemms, monkeypatch):
    import moekit.experts.triton_gluon_wo as tgw

    w13, w2 = _weights("int4_w4a16")
    x, ids, weights = _call(40)
    taken = tgw.GLUON_WO_OPTIONS[("int4_w4a16", 8, 14336, 4096)]  # Mixtral's, on this test's shape
    monkeypatch.setattr(tgw, "GLUON_WO_OPTIONS", {("int4_w4a16", E, N, K): tgw.MeasuredGemms(40, 80, taken.gemms)})
    out = run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int4_w4a16")
    assert _rel(out, _f64(x, w13, w2, ids, weights)) < 2e-2 and fake_gemms["wo"].log == []
    assert [(b["GATED"], b["FAST"], b["SPLIT"]) for _, b, _ in fake_gemms["wo_swap"].log] == [
        (True, False, True), (False, False, True)]

@pytest.mark.parametrize("zero", [0, 7, 15])
def test_int4_bytes_decode_as_the_session_27_formula(zero):
    """``_INT4_BYTE_ASM`` in the emulator, every byte: the low nibble (the even K) the low half, each weight the
    float32 fma(128 + code, scale, -(128 + zero) * scale) rounded to bf16 (``gluon_wo_fast``'s int4, bit for bit)."""
    from moekit.experts._kernels.gluon_gemm_wo_swap import _INT4_BYTE_ASM

    for scale in (float(torch.tensor(0.0123, dtype=torch.float32)), float(torch.tensor(3.7e-4, dtype=torch.float32))):
        add = _f32_value(_f32_bits(-(128.0 + zero) * scale))  # float32, as ``_group_scales`` makes it
        for byte in range(256):
            codes = (byte & 15, byte >> 4)
            want = [_bf16_bits(_f32_value(_f32_bits((128.0 + c) * scale + add))) for c in codes]
            got = run_ptx(_INT4_BYTE_ASM.value, [None, byte, _f32_bits(scale), _f32_bits(add), 0x43000000], 1)
            assert got == [want[0] | want[1] << 16], (byte, scale, zero)

