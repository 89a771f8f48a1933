"""The weight-only path's word decode (``decode="gemv"``, ``_kernels/gemm_wo_gemv.py``) on the CPU under
Triton's interpreter, tiny shapes: its bit placement for every byte of a word against a decoder written
here, the kernels against the torch twin and the float64 loop of ``test_triton_wo`` (1- and 2-row
blocks, the tiny-batch shortcut, odd K, group tails, scales per row and per word, split-K, an expert map
with -1, M = 0), where it applies, and its configs' errors. The inline PTX of the decode (NVIDIA only)
is checked against the twin by ``benchmarks/wo_device_check.py`` (int4, M <= 8).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import run_compile_script  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from test_triton_wo import PER, POISON, e2m1_value, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)


def config(scheme: str, block_m: int, words: int, rows: int = 16, group_m: int = 1) -> KernelConfig:
    tile = GemmTile(rows, words * PER[scheme], group_m, 1, 1)
    return KernelConfig(block_m, tile, tile)


def run(wo, x, w13, w2, ids, weights, cfg=None, expert_map=None, split_k=None):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, config=cfg, options=POISON,
                             split_k=split_k, decode="gemv")


_KERNELS = {}  # the interpreted wo_words module, for value_kernel (a Triton kernel reads module globals only)


@triton.jit
def value_kernel(w_ptr, out_ptr, SCHEME: triton.language.constexpr, PER: triton.language.constexpr):
    tl = triton.language
    i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16]: word i
    values = _KERNELS["wo_words"].word_values(tl.load(w_ptr + i), SCHEME, False)
    for t in tl.static_range(PER):
        tl.store(out_ptr + i * PER + t, values[t])


def expected_value(byte_values: list[int], t: int, scheme: str) -> float:
    """The float32 ``_value`` places value t of a word at (module docstring of the kernel)."""
    if scheme == "int8_w8a16":
        q = byte_values[t] - 256 if byte_values[t] > 127 else byte_values[t]
        return 1 + (q + 128) / 2**15
    code = (byte_values[t // 2] >> (4 * (t % 2))) & 15
    if scheme == "int4_w4a16":
        return 1 + code / (128 if t % 2 == 0 else 2048)
    return e2m1_value(code) * 2.0**-126


@pytest.mark.parametrize("scheme", ["int4_w4a16", "int8_w8a16", "mxfp4"])
def test_word_values_every_byte(wo, scheme):
    import importlib

    _KERNELS["wo_words"] = importlib.import_module("moekit.experts._kernels.wo_words")  # interpreted (fixture)
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (256, 4), generator=g, dtype=torch.uint8)
    raw[:, 0] = torch.arange(256, dtype=torch.uint8)  # every byte value in every position of some word
    raw[:, 3] = torch.arange(255, -1, -1, dtype=torch.uint8)
    per = PER[scheme]
    out = torch.empty(256, per, dtype=torch.float32)
    value_kernel[(1,)](raw.view(torch.int32).reshape(256), out, {"int8_w8a16": 0, "int4_w4a16": 1, "mxfp4": 2}[scheme],
                       per)
    want = torch.tensor([[expected_value(raw[w].tolist(), t, scheme) for t in range(per)] for w in range(256)],
                        dtype=torch.float64)
    assert torch.equal(out.double(), want)


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 32), ("int4_w4a16", 128), ("mxfp4", 32)])
@pytest.mark.parametrize("block_m,words", [(1, 4), (2, 8)])
def test_kernels_match_twin(wo, scheme, group, block_m, words):
    # K = 96 (int4 g = 128: one group with a 32-wide... tail; 4 words a step at g = 32: per-row scales),
    # N = 64; M = 3, k = 2 over 4 experts: aligned blocks of block_m rows
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=96, n=64, seed=block_m + words)
    out = run(wo, x, w13, w2, ids, weights, config(scheme, block_m, words))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32), ("int8_w8a16", 0)])
def test_odd_k_group_tails_bf16_and_the_shortcut(wo, scheme, group):
    # 4-bit: K = 95 (48 bytes a row: the last high nibble is padding), N = 40 (down's last group holds 8
    # of 32); int8: K = 100. M = 2, k = 1 over 8 experts: the tiny-batch shortcut (1-row blocks, no alignment)
    hidden = 100 if scheme == "int8_w8a16" else 95
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=1, e=8, hidden=hidden, n=40, dtype=torch.bfloat16,
                                       seed=7)
    out = run(wo, x, w13, w2, ids, weights)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-2


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 64), ("mxfp4", 32)])
def test_expert_map_skipped_ids_and_split_k(wo, scheme, group):
    # 6 global experts, this rank holds 4 (global 1, 2, 4, 5); token 4 routes nowhere here; N = 96 in
    # three splits of the down GEMM
    x, w13, w2, _, weights = problem(wo, scheme, group, m=6, k=2, hidden=64, n=96, seed=3)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, 2], [3, 0], [5, 7]], dtype=torch.int32)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32)
    out = run(wo, x, w13, w2, ids, weights, config(scheme, 2, 4), expert_map=expert_map, split_k=3)
    assert torch.all(out[4] == 0)
    assert rel(out, loop64(x, w13, w2, ids, weights, expert_map)) < 2e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32), ("int8_w8a16", 0)])
@pytest.mark.parametrize("up_split,x_tile", [(1, False), (2, True)])
def test_words_two_steps_ahead_and_x_tile(wo, scheme, group, up_split, x_tile):
    # num_stages 2: each program loads step s+2's words before it decodes step s (the kernels' AHEAD); K = 96 in
    # 4-word steps: 3 gate-up steps (int8: 6), the loads past the row (or the split) masked; down split in 2;
    # x_tile: x and h read as one [words, 8] tile a step (the 4-bit schemes only)
    x_tile = x_tile and scheme != "int8_w8a16"
    from moekit.experts.triton_wo_gemv import WordConfig

    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=96, n=64, seed=11)
    tile = GemmTile(16, 4 * PER[scheme], 1, 1, 2)
    out = run(wo, x, w13, w2, ids, weights, WordConfig(1, tile, tile, up_split=up_split, x_tile=x_tile), split_k=2)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


def nan_padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view into a buffer one row and 8 columns larger, filled past it with NaN (uint8: 255, an
    e8m0 NaN, inf once the kernel places it): a read past a row, past the last row or past a row's groups
    reaches the output as NaN."""
    fill = 255 if t.dtype == torch.uint8 else float("nan")
    big = torch.full((t.shape[0] + 1, *t.shape[1:-1], t.shape[-1] + 8), fill, dtype=t.dtype)
    view = big[:t.shape[0], ..., :t.shape[-1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32), ("int8_w8a16", 0)])
@pytest.mark.parametrize("block_m", [1, 2])
def test_ahead_and_x_tile_read_nothing_past_their_tensors(wo, scheme, group, block_m):
    # x and the scales inside NaN-filled buffers; K = 95 (int8: 100, 25 words), N = 40 (a group tail), 4-word
    # steps, both GEMMs split in 2: the words loaded 2 steps ahead and the x / h tiles run past every row's end
    import dataclasses

    from moekit.experts.triton_wo_gemv import WordConfig

    hidden = 100 if scheme == "int8_w8a16" else 95
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=4, k=2, hidden=hidden, n=40, dtype=torch.bfloat16, seed=5)
    want = loop64(x, w13, w2, ids, weights)
    x = nan_padded(x)
    w13, w2 = (dataclasses.replace(w, scale=nan_padded(w.scale)) for w in (w13, w2))
    tile = GemmTile(16, 4 * PER[scheme], 1, 1, 2)
    cfg = WordConfig(block_m, tile, tile, up_split=2, x_tile=scheme != "int8_w8a16")
    out = run(wo, x, w13, w2, ids, weights, cfg, split_k=2)
    assert torch.isfinite(out).all()
    assert rel(out, want) < 1e-2


def test_gemv_ahead_limit(wo):
    from moekit.experts.triton_wo_gemv import check_gemv_config

    from moekit.experts.triton_wo_gemv import WordConfig

    tile = GemmTile(16, 32, 1, 1, 3)
    with pytest.raises(ValueError, match="num_stages"):
        check_gemv_config(KernelConfig(1, tile, tile), "int4_w4a16")
    tile = GemmTile(16, 32, 1, 1, 2)
    with pytest.raises(ValueError, match="x_tile"):
        check_gemv_config(WordConfig(1, tile, tile, x_tile=True), "int8_w8a16")


def test_empty_batch(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=0, k=1, hidden=96, seed=1)
    assert run(wo, x, w13, w2, ids, weights).shape == (0, 96)


def test_where_it_applies_and_config_errors(wo):
    from moekit.experts.triton_wo_plan import _usable_decode
    from moekit.experts.triton_wo_gemv import words_ok

    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=1, hidden=100, seed=1)  # 50 bytes a row
    assert not words_ok(w13.q) and words_ok(w2.q)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    with pytest.raises(ValueError, match="decode='gemv' needs"):
        run(wo, x, w13, w2, ids, weights)
    assert _usable_decode(None, *args, "int4_w4a16", 2, 4, 64, 100, 1) in ("tile", "register")
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=1, hidden=96, seed=1)
    with pytest.raises(ValueError, match="BLOCK_M must be 1 to 2"):
        run(wo, x, w13, w2, ids, weights, config("int4_w4a16", 4, 4))
    bad = KernelConfig(1, GemmTile(16, 24, 1, 1, 1), GemmTile(16, 32, 1, 1, 1))  # 3 words a step
    with pytest.raises(ValueError, match="up.BLOCK_K must be 8 x a power of two"):
        run(wo, x, w13, w2, ids, weights, bad)


def test_inline_ptx_compiles_for_sm90():
    """The kernels with their inline PTX (1- and 2-row blocks, both 4-bit schemes) through Triton's pipeline and
    the bundled ptxas to sm_90 SASS (the PTX cannot run here; a syntax or operand error fails here, not on the
    device). In a process of its own: this module's interpreted kernels patch Triton's frontend."""
    done, lines = run_compile_script("wo_gemv_sass_cpu.py", "--quick")
    assert (done.returncode == 0 and len(lines) == 4
            and all(line.startswith("OK") for line in lines)), done.stdout + done.stderr
