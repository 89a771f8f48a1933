"""moekit.quant: every scheme's quantizer against a round-to-nearest quantizer written in the test
(moekit's error never worse), its tensors decoded by hand from the session-5 layout text, packing
round trips, odd C, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch
from _quant_refs import (
    decode_e2m1,
    e4m3_magnitudes,
    pack_nibbles_by_hand,
    rms,
    rtn_fp8_block,
    rtn_int4,
    rtn_int8,
    rtn_mxfp4,
    unpack_nibbles_by_hand,
)

import moekit.quant as Q

SHAPES = [(2, 256, 384), (3, 130, 301)]  # block-aligned, and tails on both dims (odd C)


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * shape[2] ** -0.5


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block_is_rtn_and_decodes_by_the_layout(shape):
    w = _weight(shape)
    qw = Q.quantize(w, "fp8_block")
    e, r, c = shape
    assert qw.scheme == "fp8_block" and qw.shape == shape and qw.q.dtype == torch.float8_e4m3fn
    assert qw.scale.shape == (e, -(-r // 128), -(-c // 128)) and qw.scale.dtype == torch.float32
    rows, cols = torch.arange(r) // 128, torch.arange(c) // 128
    by_hand = qw.q.double() * qw.scale.double()[:, rows][:, :, cols]  # q * scale[e, r // 128, c // 128]
    assert torch.equal(qw.dequantize(torch.float64), by_hand)
    assert set(qw.q.double().abs().unique().tolist()) <= set(e4m3_magnitudes().tolist())
    assert rms(qw.dequantize(), w) <= rms(rtn_fp8_block(w), w) * (1 + 1e-4)
    assert qw.nbytes == e * r * c + qw.scale.numel() * 4 and qw.nbytes_per_expert * e == qw.nbytes


def test_fp8_block_shape_option():
    w = _weight((2, 96, 200))
    qw = Q.quantize(w, "fp8_block", block_shape=(32, 64))
    assert qw.scale.shape == (2, 3, 4) and qw.block_shape == (32, 64)
    assert rms(qw.dequantize(), w) <= rms(rtn_fp8_block(w, 32, 64), w) * (1 + 1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_is_rtn_and_decodes_by_the_layout(shape):
    w = _weight(shape)
    qw = Q.quantize(w, "int8_w8a16")
    assert qw.q.dtype == torch.int8 and qw.scale.shape == shape[:2]
    assert torch.equal(qw.dequantize(torch.float64), qw.q.double() * qw.scale.double()[:, :, None])
    assert rms(qw.dequantize(), w) <= rms(rtn_int8(w), w) * (1 + 1e-4)
    assert int(qw.q.abs().max()) == 127  # the row's amax maps to +-127


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_is_rtn_and_decodes_by_the_layout(shape, group_size, symmetric):
    w = _weight(shape)
    qw = Q.quantize(w, "int4_w4a16", group_size=group_size, symmetric=symmetric)
    e, r, c = shape
    groups = -(-c // group_size)
    assert qw.q.shape == (e, r, -(-c // 2)) and qw.q.dtype == torch.uint8 and qw.shape == shape
    assert qw.scale.shape == (e, r, groups) and qw.zero.shape == (e, r, groups) and qw.zero.dtype == torch.uint8
    if symmetric:
        assert bool((qw.zero == 8).all())
    gidx = torch.arange(c) // group_size
    codes = unpack_nibbles_by_hand(qw.q, c)
    by_hand = (codes.double() - qw.zero.double()[:, :, gidx]) * qw.scale.double()[:, :, gidx]
    assert torch.equal(qw.dequantize(torch.float64), by_hand)
    assert rms(qw.dequantize(), w) <= rms(rtn_int4(w, group_size, symmetric), w) * (1 + 1e-4)
    assert qw.nbytes == e * r * (-(-c // 2)) + e * r * groups * 5


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp4_never_worse_than_either_rtn_and_decodes_by_the_layout(shape):
    w = _weight(shape)
    qw = Q.quantize(w, "mxfp4")
    e, r, c = shape
    assert qw.q.shape == (e, r, -(-c // 2)) and qw.scale.shape == (e, r, -(-c // 32)) and qw.scale.dtype == torch.uint8
    codes = unpack_nibbles_by_hand(qw.q, c)
    factor = 2.0 ** (qw.scale.double()[:, :, torch.arange(c) // 32] - 127)
    assert torch.equal(qw.dequantize(torch.float64), decode_e2m1(codes) * factor)
    got = rms(qw.dequantize(), w)
    assert got <= rms(rtn_mxfp4(w), w) * (1 + 1e-6)  # OCP's floor exponent
    assert got <= rms(rtn_mxfp4(w, exponent_shift=1), w) * (1 + 1e-6)  # the no-clipping exponent


def test_weight_error_figures_per_scheme():
    """The per-weight figures the report quotes: RMS error relative to the weights' RMS, moekit vs RTN."""
    w = _weight((2, 256, 512), seed=3)
    refs = {"fp8_block": rtn_fp8_block(w), "int8_w8a16": rtn_int8(w), "int4_w4a16": rtn_int4(w, 128, False),
            "mxfp4": rtn_mxfp4(w)}
    for scheme, ref in refs.items():
        ours = rms(Q.quantize(w, scheme).dequantize(), w) / float(w.double().square().mean().sqrt())
        rtn = rms(ref, w) / float(w.double().square().mean().sqrt())
        print(f"{scheme}: weight rel RMS error moekit {ours:.4%}, RTN {rtn:.4%}")
        assert ours <= rtn * (1 + 1e-4)
        assert ours < {"fp8_block": 0.03, "int8_w8a16": 0.01, "int4_w4a16": 0.12, "mxfp4": 0.13}[scheme]


@pytest.mark.parametrize("cols", [64, 63, 1])
def test_int4_packing_round_trip_from_hand_packed_bytes(cols):
    g = torch.Generator().manual_seed(cols)
    codes = torch.randint(0, 16, (2, 5, cols), generator=g)
    groups = -(-cols // 32)
    scale = torch.rand(2, 5, groups, generator=g) + 0.1
    zero = torch.randint(0, 16, (2, 5, groups), generator=g).to(torch.uint8)
    qw = Q.from_tensors("int4_w4a16", q=pack_nibbles_by_hand(codes), scale=scale, zero=zero, group_size=32, cols=cols)
    gidx = torch.arange(cols) // 32
    expected = (codes.double() - zero.double()[:, :, gidx]) * scale.double()[:, :, gidx]
    assert torch.equal(qw.dequantize(torch.float64), expected)
    assert torch.equal(qw.codes().long(), codes)


@pytest.mark.parametrize("cols", [64, 33])
def test_mxfp4_packing_round_trip_from_hand_packed_bytes(cols):
    g = torch.Generator().manual_seed(cols)
    codes = torch.randint(0, 16, (2, 3, cols), generator=g)
    scale = torch.randint(120, 134, (2, 3, -(-cols // 32)), generator=g).to(torch.uint8)
    qw = Q.from_tensors("mxfp4", q=pack_nibbles_by_hand(codes), scale=scale, cols=cols)
    expected = decode_e2m1(codes) * 2.0 ** (scale.double()[:, :, torch.arange(cols) // 32] - 127)
    assert torch.equal(qw.dequantize(torch.float64), expected)


def test_zero_weights_and_extremes_round_trip():
    w = torch.zeros(1, 4, 64)
    w[0, 1, 3] = 3.0  # one non-zero block/row/group; the others all zero
    for scheme in Q.SCHEMES:
        d = Q.quantize(w, scheme).dequantize()
        assert torch.isfinite(d).all() and d[0, 0].abs().max() == 0, scheme
        assert float(d[0, 1, 3]) == pytest.approx(3.0, rel=1e-6), scheme  # the amax is exact in every scheme


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_quantize_in_expert_chunks_equals_whole(scheme, monkeypatch):
    import moekit.quant.schemes as schemes

    w = _weight((5, 64, 96))
    whole = Q.quantize(w, scheme)
    monkeypatch.setattr(schemes, "CHUNK_ELEMENTS", 2 * 64 * 96)  # chunks of 2, 2, 1 experts
    chunked = Q.quantize(w, scheme)
    assert all(torch.equal(_bits(t), _bits(chunked.tensors()[k])) for k, t in whole.tensors().items())


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_object_helpers():
    qw = Q.quantize(_weight((4, 64, 96)), "int4_w4a16", group_size=32)
    sub = qw.select_experts(torch.tensor([2, 0]))
    assert sub.shape == (2, 64, 96) and torch.equal(sub.dequantize(), qw.dequantize()[[2, 0]])
    assert qw.to("cpu") is qw and Q.is_quantized(qw) and not Q.is_quantized(torch.ones(1))
    assert "Int4Weight" in repr(qw) and qw.dtype == torch.float32
    again = Q.from_tensors("int4_w4a16", **qw.tensors(), group_size=32, cols=96)
    assert torch.equal(again.dequantize(), qw.dequantize())


@pytest.mark.parametrize("call, error, match", [
    (lambda w: Q.quantize(w, "int3"), ValueError, "scheme must be one of"),
    (lambda w: Q.quantize(w, "int4_w4a16", group_size=48), ValueError, "group_size must be one of"),
    (lambda w: Q.quantize(w, "int4_w4a16", group_size=64.0), ValueError, "group_size must be one of"),
    (lambda w: Q.from_tensors("int4_w4a16", **Q.quantize(w, "int4_w4a16", group_size=32).tensors(), group_size=32.0,
                              cols=64), ValueError, r"group_size must be one of \(32, 64, 128\), got 32.0"),
    (lambda w: Q.quantize(w, "fp8_block", block_shape=(128, 96)), ValueError, r"block_shape\[1\] \(the reduction"),
    (lambda w: Q.quantize(w, "fp8_block", block_shape=(128, 128.0)), ValueError, "two positive ints"),
    (lambda w: Q.quantize(w, "mxfp4", group_size=32), ValueError, "not options of scheme 'mxfp4'"),
    (lambda w: Q.quantize(w, "int8_w8a16", group_size=32), ValueError, "not options of scheme 'int8_w8a16'"),
    (lambda w: Q.quantize(w, "fp8_block", block_shape=(128,)), ValueError, "block_shape must be"),
    (lambda w: Q.quantize(w[0], "mxfp4"), ValueError, r"3-D tensor \[E, R, C\]"),
    (lambda w: Q.quantize(w.to(torch.int32), "mxfp4"), TypeError, "w must be float16"),
    (lambda w: Q.quantize(w / 0, "int8_w8a16"), ValueError, "NaN or infinite"),
    (lambda w: Q.quantize(w, "int4_w4a16", symmetric=1), TypeError, "symmetric must be a bool"),
    (lambda w: Q.from_tensors("fp8_block", q=w.to(torch.float8_e4m3fn), scale=torch.ones(2, 1, 2)), ValueError,
     r"scale must have shape \[2, 1, 1\]"),
    (lambda w: Q.from_tensors("int8_w8a16", q=w, scale=torch.ones(2, 8)), TypeError, "q must be torch.int8"),
    (lambda w: Q.from_tensors("mxfp4", q=torch.zeros(2, 8, 16, dtype=torch.uint8)), ValueError,
     r"needs the tensors \['scale'\]"),
    (lambda w: Q.from_tensors("mxfp4", q=w, scales=w), ValueError, r"\['scales'\] are not fields"),
    # torch's own errors were "Tensor.item() cannot be called on meta tensors" and "device() received an invalid
    # combination of arguments"
    (lambda w: Q.quantize(w.to("meta"), "int8_w8a16"), ValueError, "w is on the meta device: it has no values"),
    (lambda w: Q.quantize(w, "int8_w8a16").to(torch.float16), TypeError,
     r"Int8Weight.to takes a device, got the dtype torch.float16: .*dequantize\(torch.float16\) gives a float copy"),
])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call(_weight((2, 8, 64)))


DTYPES = r"\(torch.float32, torch.bfloat16, torch.float16, torch.float64\)"


@pytest.mark.parametrize("scheme", Q.SCHEMES)
@pytest.mark.parametrize("dtype, error", [("float32", TypeError), (torch.int8, ValueError), (float, TypeError),
                                          (torch.float8_e4m3fn, ValueError), (None, TypeError)])
def test_dequantize_takes_float_dtypes_only(scheme, dtype, error):
    """A string once read "Invalid device string", torch.int8 returned truncated integers, None a float32 copy."""
    qw = Q.quantize(_weight((2, 8, 64)), scheme)
    for call in (lambda: qw.dequantize(dtype), lambda: qw.dequantize_expert(1, dtype)):
        with pytest.raises(error, match=rf"^dtype must be a floating-point torch.dtype {DTYPES}, got {dtype!r}$"):
            call()
    assert torch.equal(qw.dequantize_expert(1, torch.float64), qw.dequantize(torch.float64)[1])  # the float path


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequantize_builds_no_host_tensor(dtype, monkeypatch):
    # the dequantizing path runs inside CUDA graph captures (grouped_mm's), which refuse a pageable host copy: the
    # e2m1 decode once built its table with torch.tensor(..., device=codes.device) on every call
    qw = Q.quantize(_weight((2, 64, 96)), "mxfp4")
    codes = unpack_nibbles_by_hand(qw.q, 96)
    factor = 2.0 ** (qw.scale.double()[:, :, torch.arange(96) // 32] - 127)
    want = (decode_e2m1(codes) * factor).to(dtype)

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("torch.tensor called while dequantizing")

    monkeypatch.setattr(torch, "tensor", no_host_tensor)
    assert torch.equal(qw.dequantize(dtype), want)
