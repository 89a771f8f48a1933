"""The int4 ring decode's host side (``moekit.experts.triton_wo_ring``): its weight layout, plan checks, grid, the
torch twin against a float64 loop, and the kernel's bit placement done in torch integer ops. The Gluon kernel
itself does not run in the interpreter (compiled offline by ``benchmarks/wo_ring_compile_cpu.py``, run on the GPU
by ``benchmarks/wo_ring_device_check.py``)."""

import pytest
import torch

from moekit.experts.triton_wo import WoWeight
from moekit.experts.triton_wo_ring import RingPlan, check_plan, ring_grid, ring_items, ring_twin, ring_weight


def random_int4(e, r, c, seed, group=128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (e, r, c // 2), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 16, (e, r, -(-c // group)), generator=g, dtype=torch.uint8)
    scale = torch.rand(e, r, -(-c // group), generator=g) + 0.5
    return WoWeight("int4_w4a16", q, scale, zero, group)


def dense64(w: WoWeight, c: int) -> torch.Tensor:
    """[E, R, C] float64 by a loop over the bytes: element 2i the low nibble of byte i."""
    e, r, _ = w.q.shape
    out = torch.empty(e, r, c, dtype=torch.float64)
    for j in range(c):
        byte = w.q[:, :, j // 2].long()
        code = (byte & 15) if j % 2 == 0 else (byte >> 4)
        group = j // w.group_size
        out[:, :, j] = (code - w.zero[:, :, group].long()).double() * w.scale[:, :, group].double()
    return out


def test_ring_weight_transposes_groups():
    w = random_int4(3, 8, 256, 0)
    rw = ring_weight(w, 256)
    assert rw.q.shape == (24, 128) and rw.q.data_ptr() == w.q.data_ptr()  # a view, no copy
    for e in range(3):
        for g in range(2):
            assert torch.equal(rw.scale_t[e * 2 + g], w.scale[e, :, g])
            assert torch.equal(rw.zero_t[e * 2 + g], w.zero[e, :, g])


@pytest.mark.parametrize("bad, match", [
    (WoWeight("int8_w8a16", torch.zeros(1, 8, 256, dtype=torch.int8), torch.ones(1, 8)), "int4_w4a16"),
    (random_int4(1, 8, 256, 0, group=64), "group size 128"),
])
def test_ring_weight_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        ring_weight(bad, 256)


def test_ring_weight_refuses_cols():
    with pytest.raises(ValueError, match="multiple of 128"):
        ring_weight(random_int4(1, 8, 192, 0), 192)


@pytest.mark.parametrize("plan, rows, match", [
    (RingPlan(24, 8, 4), 96, "multiple of 4 \\* num_warps"),
    (RingPlan(32, 8, 4), 48, "not a multiple of block_rows"),
    (RingPlan(32, 1, 4), 64, "stages"),
    (RingPlan(32, 8, 4, 1, 3), 64, "group"),
])
def test_check_plan_refuses(plan, rows, match):
    with pytest.raises(ValueError, match=match):
        check_plan(plan, rows)


def test_ring_grid():
    assert ring_grid(8, 2048, RingPlan(32), 132) == 132  # 512 tiles
    assert ring_grid(1, 256, RingPlan(32), 132) == 8  # 8 tiles
    assert ring_grid(64, 2048, RingPlan(32, 8, 4, 2), 132) == 264


def test_ring_twin_matches_float64_loop():
    e, n, k, m, top_k = 4, 128, 256, 3, 2
    w13, w2 = random_int4(e, 2 * n, k, 1), random_int4(e, k, n, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [2, 2], [1, 4]])  # 4 >= E: an EP-skipped slot, weight 0
    wts = torch.rand(m, top_k, generator=g)
    h, out = ring_twin(x, w13, w2, ids, wts)
    d13, d2 = dense64(w13, k), dense64(w2, n)
    for t in range(m):
        want = torch.zeros(k, dtype=torch.float64)
        for j in range(top_k):
            ex = int(ids[t, j])
            if ex >= e:
                continue
            gu = d13[ex] @ x[t].double()
            hh = torch.nn.functional.silu(gu[:n]) * gu[n:]
            assert torch.allclose(h[t * top_k + j].double(), hh, rtol=1e-2, atol=1e-2)
            want += wts[t, j].double() * (d2[ex] @ h[t * top_k + j].double())
        assert torch.allclose(out[t].double(), want, rtol=2e-2, atol=2e-2)


def test_bit_placement_is_exact():
    """The kernel's decode in torch integer ops: every byte and zero gives code - zero (low) and 16 (code - zero)
    (high) exactly, and an int32 of two bf16 gives both values exactly."""
    b = torch.arange(256, dtype=torch.int32)[:, None]  # [256, 1]
    z = torch.arange(16, dtype=torch.float32)[None, :]  # [1, 16]
    magic = 0x4B000000
    lo = ((b & 0x0F) | magic).view(torch.float32) - (8388608.0 + z)
    hi = ((b & 0xF0) | magic).view(torch.float32) - (8388608.0 + 16.0 * z)
    assert torch.equal(lo, ((b & 15).float() - z))
    assert torch.equal(hi, 16 * ((b >> 4).float() - z))
    x = torch.randn(64).to(torch.bfloat16)
    bits = x.view(torch.int32)  # [32]: x[2j] in the low half (little endian)
    assert torch.equal((bits << 16).view(torch.float32), x[0::2].float())
    assert torch.equal((bits & -65536).view(torch.float32), x[1::2].float())


@pytest.mark.parametrize("tm", [1, 2, 4])
def test_ring_items_cover_every_slot_once(tm):
    g = torch.Generator().manual_seed(tm)
    ids = torch.randint(0, 6, (40,), generator=g, dtype=torch.int32)
    items = ring_items(ids, tm)
    n = int(items.count)
    want = sum(-(-int((ids == e).sum()) // tm) for e in range(6))  # ceil(count / tm) items an expert
    assert n == want
    seen = []
    for i in range(n):
        slots = [int(v) for v in items.slots[i] if v >= 0]
        assert 1 <= len(slots) <= tm and slots == sorted(slots)
        assert all(int(ids[v]) == int(items.expert[i]) for v in slots)
        seen += slots
    assert sorted(seen) == list(range(40))
    assert (items.slots[n:] == -1).all()


def test_word_decode_in_torch_matches_float64_dot():
    """The word decode's arithmetic with ``prep_x``'s x: per word, the 8 codes bit-placed as 2^23 + code 16^(j % 4)
    (words shifted by 16 for j >= 4), minus 2^23, times the prepared x; the zero through the word's x sum."""
    from moekit.experts.triton_wo_ring import prep_x

    g = torch.Generator().manual_seed(5)
    r, c = 6, 256
    w = random_int4(1, r, c, 7)
    x = torch.randn(2, c, generator=g).to(torch.bfloat16)
    values, sums = prep_x(x)  # [2 * G * 8, 16], [2 * G, 16]
    words = w.q[0].view(torch.int32)  # [R, C / 8]
    got = torch.zeros(2, r)
    for row in range(2):
        for grp in range(c // 128):
            xv = values[(row * 2 + grp) * 8:(row * 2 + grp + 1) * 8]  # [8, 16]
            word = words[:, grp * 16:(grp + 1) * 16]  # [R, 16]
            t = torch.zeros(r, 16)
            for j in range(8):
                src = word if j < 4 else word >> 16
                v = ((src & (15 << (4 * (j % 4)))) | 0x4B000000).view(torch.float32) - 8388608.0
                t += v * xv[j]
            zero, scale = w.zero[0, :, grp].float()[:, None], w.scale[0, :, grp][:, None]
            got[row] += ((t - zero * sums[row * 2 + grp]) * scale).sum(1)
    want = x.double() @ dense64(w, c)[0].T  # [2, R]
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)


def test_raw_decode_in_torch_matches_float64_dot():
    """The raw decode's arithmetic on moekit's own layout: code j of a word bit-placed at its own position as
    2^(23-4p) + code (p = j % 4, words shifted by 16 for j >= 4), minus 2^(23-4p); x read as bf16 pairs; the zero
    through the word's x sum."""
    r, c = 6, 256
    w = random_int4(1, r, c, 8)
    x = torch.randn(c, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    words = w.q[0].view(torch.int32)  # [R, C / 8]
    pairs = x.view(torch.int32).view(-1, 4)  # [C / 8, 4]: word c's x pairs
    got = torch.zeros(r)
    for grp in range(c // 128):
        word, xp = words[:, grp * 16:(grp + 1) * 16], pairs[grp * 16:(grp + 1) * 16]  # [R, 16], [16, 4]
        t, xs = torch.zeros(r, 16), torch.zeros(16)
        for j in range(8):
            p = j % 4
            src = word if j < 4 else (word >> 16) & 0xFFFF
            v = ((src & (15 << (4 * p))) | (0x4B000000 - (p << 25))).view(torch.float32) - 2.0 ** (23 - 4 * p)
            bits = xp[:, j // 2]
            xj = ((bits << 16) if j % 2 == 0 else (bits & -65536)).view(torch.float32)
            t += v * xj
            xs += xj
        zero, scale = w.zero[0, :, grp].float()[:, None], w.scale[0, :, grp][:, None]
        got += ((t - zero * xs) * scale).sum(1)
    want = dense64(w, c)[0] @ x.double()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)


def test_ring_sum_adds_routed_slots_in_order():
    from moekit.experts.triton_wo_ring import ring_sum

    m, k, kdim, e = 3, 4, 64, 5
    g = torch.Generator().manual_seed(11)
    y = torch.randn(m * k, kdim, generator=g)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 1, 0], [2, 2, 6, 1]], dtype=torch.int32)  # 5, 6 >= E: skipped
    out = ring_sum(y, ids, torch.empty(m, kdim, dtype=torch.bfloat16), e)
    want = torch.zeros(m, kdim, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            if ids[t, j] < e:
                want[t] += y[t * k + j].double()
    assert torch.allclose(out.double(), want, rtol=1e-2, atol=1e-2)


def test_mxfp4_bit_placement_is_exact():
    """The raw decode's mxfp4 codes in torch integer ops: every code j of a word (its 3 magnitude bits shifted to
    float bits 22..24, its sign to bit 31) is the e2m1 value times 2^-126 exactly; times x * 2^64, the products
    stay normal, and the scale's float 2^(e8m0 - 65) undoes both."""
    from moekit.quant import e2m1_decode

    codes = torch.arange(16, dtype=torch.int32)
    for j in range(8):
        w = codes << (4 * j)  # the code alone at position j of a word
        mag = (w << (22 - 4 * j)) if j <= 5 else ((w >> (4 * j - 22)) & 0x3FFFFFFF)
        f = ((mag & 0x01C00000) | ((w << (28 - 4 * j)) & -(1 << 31))).view(torch.float32).double()
        assert torch.equal(f * 2.0**126, e2m1_decode(codes.to(torch.uint8)).double())
    e8 = torch.arange(0, 193, dtype=torch.int32)
    factor = ((e8 + 62) << 23).view(torch.float32).double()
    assert torch.equal(factor, 2.0 ** (e8.double() - 65))
