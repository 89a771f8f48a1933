"""The weight-only path's word MMA decode (``decode="mma"``, ``_kernels/gemm_wo_mma.py``, int8, int4, mxfp4) on the
CPU under Triton's interpreter, tiny shapes: the kernels against the float64 loop of ``test_triton_wo`` (odd K with a
group tail, split-K down, an expert map with -1), the MMA order of ``wo_mma_values`` (weights and activations
permuted alike) against a decoder written here, and its refusals by name. The FAST placement (NVIDIA only) was
checked against the torch twin at real shapes by session 26's ``wo_mma_device_check.py`` (removed:
``git show 87f368f6:benchmarks/wo_mma_device_check.py``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import run_compile_script  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from test_triton_wo import POISON, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)


def config(rows: int = 32, block_k: int = 128) -> KernelConfig:
    tile = GemmTile(rows, block_k, 1, 1, 1)
    return KernelConfig(16, tile, tile)


def run(wo, x, w13, w2, ids, weights, cfg, expert_map=None, split_k=None):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, config=cfg, options=POISON,
                             split_k=split_k, decode="mma")


def check_edges(wo, scheme, group, m, cfg, hidden, n, seed, split_k=None):
    """The mma decode at ``cfg`` on M = 0 (an empty output) and M = 1 with an expert map whose -1 drops one of the
    token's two experts (global expert 2 lives elsewhere): out [m, hidden], M = 1 against the float64 loop."""
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=m, k=2, hidden=hidden, n=n, seed=seed)
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    if m:
        ids[0] = torch.tensor([2, 4], dtype=torch.int32)
    out = run(wo, x, w13, w2, ids, weights, cfg, expert_map=expert_map, split_k=split_k)
    assert out.shape == (m, hidden)
    if m:
        assert rel(out, loop64(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-3


@pytest.mark.parametrize("scheme,hidden,group", [("int4_w4a16", 256, 128), ("int4_w4a16", 200, 128),
                                                 ("int4_w4a16", 256, 256), ("mxfp4", 256, 32), ("mxfp4", 200, 32),
                                                 ("int8_w8a16", 256, 0), ("int8_w8a16", 200, 0)])
def test_mma_matches_float64_loop(wo, scheme, hidden, group):
    # K = 200: the last step's words past the row (25 words; int8 50 of 64) load as 0, x past K as 0, the tail group
    # is 72 (int4) or 8 (mxfp4) wide; mxfp4 scales 2^-5 .. 2^-1 (``make_weight``), each weight scaled in the decode
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=hidden, n=128, seed=hidden + group)
    out = run(wo, x, w13, w2, ids, weights, config())
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 128), ("mxfp4", 32), ("int8_w8a16", 0)])
@pytest.mark.parametrize("split_k", [2, 3])
def test_mma_split_down_and_expert_map(wo, scheme, group, split_k):
    # N = 384: three 128-wide steps in 2 (one of 256, one of 128) or 3 splits; global expert 2 lives elsewhere
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=128, n=384, seed=40 + split_k)
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    ids[0, 0] = 2
    out = run(wo, x, w13, w2, ids, weights, config(rows=16), expert_map=expert_map, split_k=split_k)
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 128), ("mxfp4", 32), ("int8_w8a16", 0)])
def test_mma_split_gate_up(wo, scheme, group):
    # K = 384: three 128-column steps in 2 splits (256 + 128) or 3; float32 partials summed by the split_glu launch;
    # E = 2: two row blocks of 3 rows (as the wide steps below)
    from moekit.experts.triton_wo_gemv import WordConfig

    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, e=2, hidden=384, n=128, seed=7)
    tile = GemmTile(32, 128, 1, 1, 1)
    for split in (2, 3):
        out = run(wo, x, w13, w2, ids, weights, WordConfig(16, tile, tile, up_split=split))
        assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3
    with pytest.raises(ValueError, match="glu_fold"):
        run(wo, x, w13, w2, ids, weights, WordConfig(16, tile, tile, up_split=2, glu_fold=True))


@pytest.mark.parametrize("scheme,hidden,group,block_k", [
    ("int4_w4a16", 200, 128, 256), ("int4_w4a16", 640, 128, 256), ("int4_w4a16", 640, 256, 256),
    ("int4_w4a16", 296, 128, 256), ("mxfp4", 200, 32, 256), ("mxfp4", 328, 32, 256), ("int8_w8a16", 200, 0, 256),
    ("int8_w8a16", 328, 0, 256), ("int8_w8a16", 328, 0, 128)])
def test_mma_wide_steps_match_float64_loop(wo, scheme, hidden, group, block_k):
    # steps of 256 columns (one load of 128 bytes of a 4-bit row, 256 of int8) run as 2 dots on the step's halves,
    # each dot inside one int4 group; K = 200 / 296 / 328 / 640: tail steps whose later sub-steps lie past the row
    # (their words, x and scales 0), int4 tail groups of 72 / 40 / 128 columns, an mxfp4 tail group of 8; N = 384 in
    # the down GEMM: a step of 256 then a half step; int8 at 128 columns (32 words, one dot) too. E = 2: two row
    # blocks of 3 rows (every token takes both experts; E = 4 spread the same 6 slots over 3-4 blocks)
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, e=2, hidden=hidden, n=384,
                                       seed=hidden + block_k)
    out = run(wo, x, w13, w2, ids, weights, config(block_k=block_k))
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 128), ("mxfp4", 32), ("int8_w8a16", 0)])
@pytest.mark.parametrize("m", [0, 1])
def test_mma_wide_steps_edges(wo, scheme, group, m):
    # M = 0 (an empty output) and M = 1 with an expert map whose -1 drops one of the token's experts; 32-word steps,
    # the down GEMM split in 2 (one 256-column step each) and the gate-up in 2 (float32 partials)
    from moekit.experts.triton_wo_gemv import WordConfig

    tile = GemmTile(32, 256, 1, 1, 2)
    check_edges(wo, scheme, group, m, WordConfig(16, tile, tile, up_split=2), hidden=512, n=512, seed=11 + m,
                split_k=2)


def test_mma_heuristic_config_runs(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 128, m=2, k=2, hidden=128, n=128, seed=3)
    out = run(wo, x, w13, w2, ids, weights, None)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


_KERNELS = {}  # the interpreted wo_mma_values module (a Triton kernel reads module globals only)


@pytest.fixture
def mma_values(wo):
    """``_kernels/wo_mma_values`` as ``wo`` decorated it, put where the order kernels read it; imported here, not
    taken from ``sys.modules``, so a test run alone does not depend on an earlier test's launch having loaded it."""
    import importlib

    _KERNELS["mma"] = importlib.import_module("moekit.experts._kernels.wo_mma_values")
    yield _KERNELS["mma"]
    _KERNELS.clear()


@triton.jit
def order_kernel(w_ptr, x_ptr, v_out, x_out, PAIRS: triton.language.constexpr):
    tl = triton.language
    i = tl.arange(0, 8)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [8, 16]: 8 rows of 16 words
    k = tl.arange(0, 16)[:, None] * 128 + tl.arange(0, 128)[None, :]  # [16, 128]: 16 rows of 128 columns
    w = tl.load(w_ptr + i)
    zero = tl.arange(0, 8)[:, None]  # [8, 1]: row r's zero point r
    v = _KERNELS["mma"].weight_operand(w, zero, 8, 16, tl.float32, 1, False, PAIRS)  # [8, 128]: code - zero
    tl.store(v_out + tl.arange(0, 8)[:, None] * 128 + tl.arange(0, 128)[None, :], v)
    tl.store(x_out + k, _KERNELS["mma"].x_operand(tl.load(x_ptr + k), 16, 16, PAIRS))


@pytest.mark.parametrize("pairs", [1, 2])
def test_mma_order_pairs_weights_and_activations_alike(mma_values, pairs):
    # logical k = 32b + 16h + 8g + 2q + p (PAIRS 1) or 32b + 16h + 4q + 2g + p (PAIRS 2) holds value T = 2h + g + 4p
    # of word 4b + q: activation column 8j + T; int4 values code - zero (row r's zero point r here)
    words = torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32)
    words[0, :4] = torch.tensor([0, -1, 0x12345678, -0x789ABCDF], dtype=torch.int32)
    x = torch.randn(16, 128)
    v_out, x_out = torch.empty(8, 128), torch.empty(16, 128)
    order_kernel[(1,)](words, x, v_out, x_out, pairs)
    for k in range(128):
        b, h, p = k // 32, (k // 16) % 2, k % 2
        g, q = ((k // 8) % 2, (k // 2) % 4) if pairs == 1 else ((k // 2) % 2, (k // 4) % 4)
        j, t = 4 * b + q, 2 * h + g + 4 * p
        codes = [(int(w) >> (4 * t)) & 0xF for w in words[:, j].tolist()]
        assert v_out[:, k].tolist() == [c - r for r, c in enumerate(codes)]
        assert torch.equal(x_out[:, k], x[:, 8 * j + t])
    # the one dot a step equals the natural-order sum (float64)
    natural = torch.tensor([[((int(w) >> (4 * t)) & 0xF) - r for w in row for t in range(8)]
                            for r, row in enumerate(words.tolist())], dtype=torch.float64)  # [8, 128]
    assert torch.allclose(x_out.double() @ v_out.double().T, x.double() @ natural.T, rtol=1e-12, atol=1e-9)


@triton.jit
def int8_order_kernel(w_ptr, x_ptr, v_out, x_out, PAIRS: triton.language.constexpr):
    tl = triton.language
    i = tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [8, 32]: 8 rows of 32 int8 words
    k = tl.arange(0, 16)[:, None] * 128 + tl.arange(0, 128)[None, :]  # [16, 128]
    v = _KERNELS["mma"].weight_operand(tl.load(w_ptr + i), 0, 8, 32, tl.float32, 0, False, PAIRS)  # [8, 128]
    tl.store(v_out + tl.arange(0, 8)[:, None] * 128 + tl.arange(0, 128)[None, :], v)
    tl.store(x_out + k, _KERNELS["mma"].x_operand(tl.load(x_ptr + k), 16, 32, PAIRS, 0))


@pytest.mark.parametrize("pairs", [1, 2])
def test_mma_int8_order_weights_and_activations_alike(mma_values, pairs):
    # int8: logical k = 32b + 16e + 8t + 2q + p (PAIRS 1) or 32b + 16e + 4q + 2t + p (PAIRS 2) holds value t + 2p of
    # word 8b + 2q + e (the signed byte at bits 8(t + 2p)): activation column 4j + t + 2p
    words = torch.randint(-2**31, 2**31 - 1, (8, 32), dtype=torch.int32)
    words[0, :4] = torch.tensor([0, -1, 0x7F80017F, -0x7F7F8081], dtype=torch.int32)
    x = torch.randn(16, 128)
    v_out, x_out = torch.empty(8, 128), torch.empty(16, 128)
    int8_order_kernel[(1,)](words, x, v_out, x_out, pairs)
    signed = words.view(torch.uint8).view(torch.int8).reshape(8, 128)  # little-endian: column 4j + T is byte T of j
    for k in range(128):
        b, e, p = k // 32, (k // 16) % 2, k % 2
        t, q = ((k // 8) % 2, (k // 2) % 4) if pairs == 1 else ((k // 2) % 2, (k // 4) % 4)
        col = 4 * (8 * b + 2 * q + e) + t + 2 * p
        assert v_out[:, k].tolist() == signed[:, col].tolist()
        assert torch.equal(x_out[:, k], x[:, col])
    assert torch.allclose(x_out.double() @ v_out.double().T, x.double() @ signed.double().T, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("scheme,group,block_k,match", [
    ("int8_w8a16", 0, 384, "BLOCK_K must be one of"), ("int4_w4a16", 64, 128, "multiple of 128"),
    ("int4_w4a16", 64, 256, "multiple of 128"), ("int4_w4a16", 128, 64, "BLOCK_K must be one of"),
    ("mxfp4", 32, 384, "BLOCK_K must be one of"), ("mxfp4", 32, 512, "BLOCK_K must be one of")])
def test_mma_refusals_name_the_problem(wo, scheme, group, block_k, match):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=2, hidden=128, n=128)
    with pytest.raises(ValueError, match=match):
        run(wo, x, w13, w2, ids, weights, config(block_k=block_k))


def test_chooser_mma_falls_back_where_the_groups_do_not_fit(wo, monkeypatch):
    # a measured "mma" entry for the call's shape: taken with g = 128, the register decode with g = 64 (steps of
    # 128 columns would straddle two groups); a caller's decode="mma" there is refused (above)
    from moekit.experts import triton_wo_plan as plan

    for scheme, group, want in (("int4_w4a16", 128, "mma"), ("int4_w4a16", 64, "register"), ("int8_w8a16", 0, "mma")):
        x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=2, hidden=128, n=128, e=4)
        monkeypatch.setitem(plan.DECODE_MEASURED, (scheme, 4, 128, 128), {2: "mma"})
        args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
        built = plan.build_wo_plan(x, *args, ids, None, scheme, "silu", None, POISON)
        assert built.decode == want


def test_chooser_takes_mma_where_it_won():
    # Mixtral int4 M=8 (session 26: 343.0 against the register decode's 422.3 µs): M = 3 .. 31 take that entry
    # (nearest in log2 to 8 of {1, 8} in the 16-row bucket); M = 32 .. 127 the winners table's M=64 row (session 29:
    # 474.0 against the tile decode's 819.5), from 128 the tile decode; other shapes unchanged
    from moekit.experts.triton_wo_plan import choose_decode

    picks = {m: choose_decode("int4_w4a16", m, 8, 14336, 4096, 2) for m in (1, 2, 3, 8, 16, 31, 32, 127, 128)}
    assert picks == {1: "gemv", 2: "register", 3: "mma", 8: "mma", 16: "mma", 31: "mma", 32: "mma", 127: "mma",
                     128: "tile"}
    assert {choose_decode("int4_w4a16", m, e, n, k, 8) for m in (1, 8) for e, n, k in
            ((256, 2048, 7168), (128, 768, 2048))} == {"gemv"}
    # int4 M=64 (DeepSeek-V3 2309.5 against 2742.0, Qwen3 162.5 against 196.7 µs) and Mixtral mxfp4 M=8 (562.0
    # against the tile decode's 589.6), merged main b32c0fb
    # session 38 (H100): DeepSeek-V3 M=512 on the mma decode (its winners row: to M = 724, nearer than M = 1024's tile),
    # Qwen3 M=256 (DECODE_MEASURED, 256..511; from 512 the M = 1024 row's tile)
    assert {m: choose_decode("int4_w4a16", m, 256, 2048, 7168, 8) for m in (22, 23, 64, 511, 512, 724, 725)} == {
        22: "register", 23: "mma", 64: "mma", 511: "mma", 512: "mma", 724: "mma", 725: "tile"}
    assert {m: choose_decode("int4_w4a16", m, 128, 768, 2048, 8) for m in (23, 64, 255, 256, 511, 512)} == {
        23: "mma", 64: "mma", 255: "mma", 256: "mma", 511: "mma", 512: "tile"}
    # mxfp4 on the mma's multiply placement (session 29, mx9 CK1 / CK1b: Mixtral M = 1 / 8 / 64 168.1 / 336.4 / 763.1
    # against 190.4 / 558.1 / 856.5 µs, DeepSeek-V3 M = 1 / 8 / 64 104.1 / 866.5 / 3156.3 against the gemv's 144.0 /
    # 1010.4 and the register decode's 3936.8)
    assert {m: choose_decode("mxfp4", m, 8, 14336, 4096, 2) for m in (1, 2, 8, 64, 128, 255)} == {
        1: "mma", 2: "mma", 8: "mma", 64: "mma", 128: "mma", 255: "mma"}  # 128..255: session 38's row (H100)
    assert {choose_decode("mxfp4", m, 256, 2048, 7168, 8) for m in (1, 2, 3, 8, 64)} == {"mma"}
    # int8 M=1 (session 28: DeepSeek-V3 104.4 against the tile decode's 123.7 µs, Mixtral 122.2 against 135.8): M <= 2
    # (nearest in log2 to 1 of {1, 8, 64}), the tile decode from 3 (M=8: DeepSeek-V3 694.2 against 714.3)
    for e, n, k, top_k in ((256, 2048, 7168, 8), (8, 14336, 4096, 2)):
        assert {m: choose_decode("int8_w8a16", m, e, n, k, top_k) for m in (1, 2, 3, 8, 64)} == {
            1: "mma", 2: "mma", 3: "tile", 8: "tile", 64: "tile"}


def test_int8_mma_tuned_steps():
    # the winner's config is a tuned file (256-column steps, 3 stages, 32 rows in 1 warp); other devices, the heuristic;
    # Mixtral M <= 2: MMA_CONFIGS' 128-column steps with the down GEMM split in 4 (session 32)
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_gemv import WordConfig

    tile, k128 = GemmTile(32, 256, 1, 1, 3), GemmTile(32, 128, 1, 1, 3)
    assert wo_config(1, 256, 2048, 7168, 8, "int8_w8a16", "NVIDIA_H200", "mma") == KernelConfig(16, tile, tile)
    for m in (1, 2):
        assert wo_config(m, 8, 14336, 4096, 2, "int8_w8a16", "NVIDIA_H200", "mma") == WordConfig(16, k128, k128,
                                                                                                 down_split=4)
    assert wo_config(1, 256, 2048, 7168, 8, "int8_w8a16", "other", "mma").up.BLOCK_K == 128


def test_inline_ptx_compiles_for_sm90():
    """The mma kernels with their inline PTX (int8, int4, mxfp4, both GEMMs, the default tiles; int4's halves gate-up
    in its two taken tiles) through Triton's pipeline and the bundled ptxas to sm_90 SASS (the PTX cannot run here: a
    syntax or operand error fails here, not on the device). In a process of its own: this module's interpreted
    kernels patch Triton's frontend."""
    done, lines = run_compile_script("wo_mma_sass_cpu.py", "--quick")
    ok = done.returncode == 0 and len(lines) == 8 and all(line.startswith("OK") for line in lines)
    assert ok, done.stdout + done.stderr
