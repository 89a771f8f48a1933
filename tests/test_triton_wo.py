"""Weight-only quantized Triton experts (int8_w8a16, int4_w4a16, mxfp4) on the CPU, under Triton's
interpreter, tiny shapes.

Chain: the kernels vs the torch twin (``fused_experts_wo_torch``), the twin vs a float64 per-token loop
over weights decoded by a dequantizer written here (element by element from the bit layout, e2m1 by its
exponent/mantissa rule rather than a table). The inputs are random bytes, so a packed row's padding
nibble (odd C) is garbage that must never count. Workspaces are poisoned with NaN before kernel runs.
Every kernel test runs both MMA decodes of the packed weights ("tile" and "register", ``triton_wo_plan``);
the word decode ("gemv", whole-word rows only) has its own file, ``test_triton_wo_gemv.py``.

What the interpreter cannot run and ``benchmarks/wo_device_check.py`` covers: bf16 ``tl.dot`` (upcast
here), bf16 intermediates (float32 here), the register decode's inline PTX (NVIDIA GPUs only; here its
pure-Triton twin, ``test_triton_wo_decode.py``), real shapes, CUDA graphs, timing.
"""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import experts_loop  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 32), ("int4_w4a16", 64), ("mxfp4", 32)]
DECODES = ["tile", "register"]  # triton_wo_plan.DECODES but gemv (test_triton_wo_gemv.py): every kernel test runs both
POISON = LaunchOptions(poison_workspace=True)
PER = {"int8_w8a16": 4, "int4_w4a16": 8, "mxfp4": 8}  # values a 32-bit word holds, by scheme


@pytest.fixture(scope="module")
def wo():
    """``moekit.experts.triton_wo`` with its kernels under the interpreter (the weight-only test modules import it)."""
    with interpreted("moekit.experts", "moekit.experts.triton_wo") as module:
        yield module


def make_weight(wo, scheme: str, group: int, e: int, r: int, c: int, seed: int):
    """Random bytes in the scheme's layout; scales that keep each GEMM's output near unit size."""
    g = torch.Generator().manual_seed(seed)
    if scheme == "int8_w8a16":
        q = torch.randint(-128, 128, (e, r, c), generator=g, dtype=torch.int8)
        return wo.WoWeight(scheme, q, (torch.rand(e, r, generator=g) + 0.5) / (64 * c**0.5))
    groups = -(-c // group)
    q = torch.randint(0, 256, (e, r, -(-c // 2)), generator=g, dtype=torch.uint8)
    if scheme == "int4_w4a16":
        scale = (torch.rand(e, r, groups, generator=g) + 0.5) / (4 * c**0.5)
        return wo.WoWeight(scheme, q, scale, torch.randint(0, 16, (e, r, groups), generator=g, dtype=torch.uint8),
                           group)
    exponents = torch.randint(122, 127, (e, r, groups), generator=g, dtype=torch.uint8)  # 2^-5 .. 2^-1
    return wo.WoWeight(scheme, q, exponents, None, group)


def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa  # subnormal: 0 or 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def dequant64(w, cols: int) -> torch.Tensor:
    """[E, R, C] float64, one column at a time from the layouts as written in COMMON.md."""
    e, r = w.q.shape[:2]
    out = torch.empty(e, r, cols, dtype=torch.float64)
    for c in range(cols):
        if w.scheme == "int8_w8a16":
            out[:, :, c] = w.q[:, :, c].double() * w.scale.double()
            continue
        byte = w.q[:, :, c // 2].long()
        code = (byte >> 4) if c % 2 else (byte & 15)  # element 2i low nibble, 2i+1 high
        group = c // w.group_size
        if w.scheme == "int4_w4a16":
            out[:, :, c] = (code - w.zero[:, :, group].long()).double() * w.scale[:, :, group].double()
        else:
            value = torch.tensor([e2m1_value(v) for v in range(16)], dtype=torch.float64)[code]
            out[:, :, c] = value * 2.0 ** (w.scale[:, :, group].double() - 127)
    return out


def loop64(x, w13, w2, ids, weights, expert_map=None) -> torch.Tensor:
    """float64 per token and slot on the weights dequantized here (``_helpers.experts_loop``); an id < 0, >= E, or
    mapped to -1 is skipped."""
    return experts_loop(x, dequant64(w13, x.shape[1]), dequant64(w2, w13.q.shape[1] // 2), ids, weights, expert_map)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def problem(wo, scheme, group, m=5, k=2, e=4, hidden=100, n=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = make_weight(wo, scheme, group, e, 2 * n, hidden, seed + 1)
    w2 = make_weight(wo, scheme, group, e, hidden, n, seed + 2)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].int()  # k distinct experts per token
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return x, w13, w2, ids, weights


def run_kernels(wo, x, w13, w2, ids, weights, expert_map=None, config=None, decode=None):
    """The kernels (``decode``'s; None: the chooser's) with poisoned workspaces (the custom op cannot poison)."""
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, config=config, options=POISON,
                             decode=decode)


# --- the twin against the float64 loop ---------------------------------------------------------------


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("cols", [96, 99])
def test_dequantize_matches_hand_decoder(wo, scheme, group, cols):
    w = make_weight(wo, scheme, group, 3, 5, cols, seed=cols)
    assert torch.allclose(wo.dequantize_wo(w, cols).double(), dequant64(w, cols), rtol=1e-6, atol=0)
    assert torch.equal(wo.dequantize_wo(w, cols, expert=1), wo.dequantize_wo(w, cols)[1])


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_twin_matches_float64_loop(wo, scheme, group):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=6, k=2, hidden=99, n=40)
    want = loop64(x, w13, w2, ids, weights)
    out = wo.fused_experts_wo_torch(x, w13, w2, ids, weights)
    assert out.dtype == x.dtype and want.norm() > 0.1 * x.double().norm()  # a real signal, not ~0
    assert rel(out, want) < 2e-3  # fp16 output rounding


def test_e2m1_table_spot_values():
    # the OCP MX e2m1 table, written out: codes 0..7 and their negatives
    assert [e2m1_value(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [e2m1_value(c) for c in range(8, 16)] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


# --- the kernels against the twin --------------------------------------------------------------------


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("hidden", [96, 100])
@pytest.mark.parametrize("decode", DECODES)
def test_kernels_match_twin(wo, scheme, group, k, hidden, decode):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=k, hidden=hidden, seed=k + hidden)
    out = run_kernels(wo, x, w13, w2, ids, weights, decode=decode)
    want = wo.fused_experts_wo_torch(x, w13, w2, ids, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, want) < 1e-3  # fp16 in and out: only rounding differs (interpreter dots are fp32)


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32), ("int8_w8a16", 0)])
@pytest.mark.parametrize("decode", DECODES)
def test_odd_reduction_tails_and_bf16(wo, scheme, group, decode):
    # K = 99 (a packed row's last high nibble is padding), N = 40 (down's last group holds 8 of 32)
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=4, k=2, hidden=99, n=40, dtype=torch.bfloat16, seed=7)
    out = run_kernels(wo, x, w13, w2, ids, weights, decode=decode)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-2


@pytest.mark.parametrize("block_k,group", [(32, 64), (64, 64), (128, 32), (128, 64), (64, 128), (256, 32)])
@pytest.mark.parametrize("decode", DECODES)
def test_block_k_smaller_and_larger_than_group(wo, block_k, group, decode):
    # BLOCK_K < g: several steps share one group's scale; BLOCK_K > g: one step spans several groups
    # (the register decode: several chunks a step, each scaled on its own partial product)
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", group, m=9, k=2, hidden=160, seed=block_k)
    tile = GemmTile(32, block_k, 1, 4, 2)
    out = run_kernels(wo, x, w13, w2, ids, weights, config=KernelConfig(16, tile, tile), decode=decode)
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", DECODES)
def test_mxfp4_scales_far_from_one(wo, dtype, decode):
    # e8m0 exponents 116..130 (factors 2^-11 .. 2^3), so the kernels' 2^(s - 113) factor is checked on
    # both sides of 2^0; every byte value (all 16 codes in both nibbles) occurs in the weights
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=4, k=2, hidden=128, n=64, dtype=dtype, seed=31)
    g = torch.Generator().manual_seed(32)
    w13 = wo.WoWeight("mxfp4", w13.q, torch.randint(120, 131, w13.scale.shape, generator=g, dtype=torch.uint8), None,
                      32)
    w2 = wo.WoWeight("mxfp4", w2.q, torch.randint(116, 129, w2.scale.shape, generator=g, dtype=torch.uint8), None, 32)
    x = x * 2.0**-6  # keep the gate-up outputs near unit size
    assert torch.unique(w13.q).numel() == 256
    out = run_kernels(wo, x, w13, w2, ids, weights, decode=decode)
    want = loop64(x, w13, w2, ids, weights)
    assert 0.01 < want.abs().max() < 2e4 and rel(out, want) < (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("m", [0, 1])
@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 32), ("mxfp4", 32)])
def test_empty_and_single_token(wo, m, scheme, group):
    # M = 1, k = 1 takes the naive shortcut (A*4 <= E): no alignment runs
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=m, k=1, seed=m)
    out = wo.fused_experts_wo(x, w13, w2, ids, weights)
    assert out.shape == (m, 100) and out.dtype == x.dtype
    if m:
        assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 64), ("mxfp4", 32)])
@pytest.mark.parametrize("decode", DECODES)
def test_expert_map_and_skipped_ids(wo, scheme, group, decode):
    # 6 global experts, this rank holds 4 (global 1, 2, 4, 5 -> local 0..3); global 0 and 3 are elsewhere
    x, w13, w2, _, weights = problem(wo, scheme, group, m=6, k=2, seed=3)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, 2], [3, 0], [5, 7]], dtype=torch.int32)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32)
    out = run_kernels(wo, x, w13, w2, ids, weights, expert_map=expert_map, decode=decode)
    want = loop64(x, w13, w2, ids, weights, expert_map)
    assert torch.all(out[4] == 0)  # token 4 routes nowhere here
    assert rel(out, want) < 2e-3
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-3


# --- the op, the configs, the refusals ---------------------------------------------------------------


def test_op_traces_fullgraph_and_passes_opcheck(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=3, k=2, seed=11)

    def layer(x, ids, weights):
        return wo.fused_experts_wo(x, w13, w2, ids, weights) * 2

    out = torch.compile(layer, backend="eager", fullgraph=True)(x, ids, weights)
    assert rel(out, 2 * wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3
    args = (x, w13.q, w13.scale, w13.zero, 32, w2.q, w2.scale, w2.zero, 32, ids, weights, None, "int4_w4a16",
            "silu", False, "register")
    torch.library.opcheck(torch.ops.moekit.triton_experts_wo.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_tuned_file_is_found_and_heuristic_otherwise(wo, user_config_dir):
    from moekit.experts import triton_wo_configs as plans

    tile = {"BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    entry = {"BLOCK_M": 32, "up": tile, "down": tile}
    (user_config_dir / "E4_N64_K100_mxfp4_cpu.json").write_text(json.dumps({"configs": {"8": entry}}))
    assert plans.wo_config(5, 4, 64, 100, 2, "mxfp4", "cpu") == KernelConfig.from_dict(entry)
    assert (plans.wo_config(5, 4, 64, 100, 2, "int4_w4a16", "cpu")
            == plans.wo_heuristic_config(5, 4, 64, 100, 2, "int4_w4a16"))
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=5, k=2, seed=12)
    out = wo.fused_experts_wo(x, w13, w2, ids, weights)  # runs on the file's config
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-3


def test_packed_block_k_below_32_is_refused(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=1, seed=13)
    tile = GemmTile(32, 16, 1, 4, 2)
    with pytest.raises(ValueError, match="BLOCK_K must be >= 32"):
        run_kernels(wo, x, w13, w2, ids, weights, config=KernelConfig(16, tile, tile))


@pytest.mark.parametrize("change,match", [
    (lambda wo, w13, w2: (w13, "not a weight"), "w2 must be a WoWeight"),
    (lambda wo, w13, w2: (wo.WoWeight("int3", w13.q, w13.scale, w13.zero, 32), w2), "w13.scheme must be one of"),
    (lambda wo, w13, w2: (wo.WoWeight("int4_w4a16", w13.q, w13.scale, w13.zero, 16), w2), "w13.group_size"),
    (lambda wo, w13, w2: (wo.WoWeight("int4_w4a16", w13.q, w13.scale, None, 32), w2), r"w13.zero must be a tensor"),
    (lambda wo, w13, w2: (w13, wo.WoWeight("int4_w4a16", w2.q, w2.scale[:, :, :1], w2.zero, 32)), r"w2.scale must be"),
    (lambda wo, w13, w2: (w13, wo.WoWeight("int4_w4a16", w2.q.view(torch.int8), w2.scale, w2.zero, 32)),
     r"w2.q must be"),
    (lambda wo, w13, w2: (w13, wo.WoWeight("mxfp4", w2.q, w2.zero, None, 32)), "share a scheme"),
])
def test_bad_weights_are_refused_by_name(wo, change, match):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=1, seed=14)
    w13, w2 = change(wo, w13, w2)
    with pytest.raises((TypeError, ValueError), match=match):
        wo.fused_experts_wo(x, w13, w2, ids, weights)


def test_bad_call_arguments_are_refused_by_name(wo):
    x, w13, w2, ids, weights = problem(wo, "int8_w8a16", 0, m=2, k=1, seed=15)
    with pytest.raises(ValueError, match="x must be a"):
        wo.fused_experts_wo(x.float(), w13, w2, ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be"):
        wo.fused_experts_wo(x, w13, w2, ids.float(), weights)
    with pytest.raises(ValueError, match="topk_weights must be"):
        wo.fused_experts_wo(x, w13, w2, ids, weights[:, :0])
    with pytest.raises(ValueError, match="expert_map must be"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, expert_map=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation must be"):
        wo.fused_experts_wo(x, w13, w2, ids, weights, activation="swishy")


# --- split-K (the down GEMM at decode sizes) ---------------------------------------------------------


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 32), ("mxfp4", 32)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("decode", DECODES)
def test_split_k_down_matches_twin(wo, scheme, group, split_k, decode):
    # N = 150 over 32-wide steps: 5 steps in 2 or 3 splits (the last one short, ending in a 22-wide group tail)
    from moekit.experts.triton_wo_plan import build_wo_plan

    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=64, n=150, seed=20 + split_k)
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)  # global 2 is elsewhere
    ids[0, 0] = 2
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    config = KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))
    plan = build_wo_plan(x, *args, ids, expert_map, scheme, "silu", config, POISON, split_k, decode)
    assert plan.split_k == split_k and plan.workspace.shapes[1] == (split_k * 6, 64)  # y: partial rows (1: none)
    out = wo.run_experts_wo(x, *args, ids, weights, expert_map, scheme, config=config, options=POISON, split_k=split_k,
                            decode=decode)
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-3


def test_decode_split_rule():
    from moekit.experts.triton_wo_configs import MIN_PROGRAMS, wo_heuristic_config
    from moekit.experts.triton_wo_plan import decode_split_k

    for (e, n, hidden, top_k), m in [((256, 2048, 7168, 8), 1), ((8, 14336, 4096, 2), 1), ((128, 768, 2048, 8), 1)]:
        config = wo_heuristic_config(m, e, n, hidden, top_k, "int4_w4a16")
        assert decode_split_k(config, m, top_k, e, n, hidden) == 1  # the presets' narrow tiles fill the GPU
    # one local expert of Mixtral's shape (expert parallelism): 4096 / 32 = 128 programs -> 2 splits
    config = wo_heuristic_config(1, 1, 14336, 4096, 2, "int4_w4a16")
    split = decode_split_k(config, 1, 2, 1, 14336, 4096)
    assert split == 2 and 4096 // config.down.BLOCK_N * split >= MIN_PROGRAMS
    tall = KernelConfig(64, config.up, config.down)
    assert decode_split_k(tall, 1024, 2, 1, 14336, 4096) == 1  # never past decode tiles


# --- SWAP_AB (the register decode: the weights as the MMA's M side) ------------------------------------


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_register_swap_ab_matches_float64_loop(wo, scheme, group, split_k):
    # each chunk computes W @ a^T into a [BN, BM] accumulator, transposed back for the epilogue (K = 100: a group tail)
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=100, n=64, seed=30 + split_k)
    tile = GemmTile(32, 32, 1, 4, 2)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    out = wo.run_experts_wo(x, *args, ids, weights, None, scheme, config=KernelConfig(16, tile, tile, swap_ab=True),
                            options=POISON, split_k=split_k, decode="register")
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("decode", ["tile", "gemv"])
def test_swap_ab_is_refused_outside_the_register_decode(wo, decode):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=2, k=2, hidden=64, n=32)
    tile = GemmTile(32, 32, 1, 4, 2)
    with pytest.raises(ValueError, match="swap_ab"):
        run_kernels(wo, x, w13, w2, ids, weights, config=KernelConfig(16, tile, tile, swap_ab=True), decode=decode)
