"""The fp8 block-scaled Triton experts path on the CPU, under Triton's interpreter, tiny shapes.

Chain: the kernels vs the torch twin ``fused_experts_fp8_torch`` (float32 inputs: both round the same
values onto the e4m3 grid, so they agree up to float32 summation order, see FLIP_TOL); the twin vs a float64
per-token emulation of the recipe written here; that emulation vs the unquantized float64 experts
(the quantization error, ~6% relative L2, is really there). Workspaces are filled with NaN first.

What the interpreter cannot run and ``benchmarks/fp8_device_check.py`` covers on the GPU: fp8
``tl.dot`` and the hardware e4m3 conversion (the interpreter upcasts and rounds in float32 arithmetic),
bf16 outputs (the interpreter truncates), timing, CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, SHAPES, emulation_f64, fake_quant_f64  # noqa: E402
from _fp8_cases import kernel_vs_twin as _kernel_vs_twin, problem as _problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_fp8_plan import check_config, fp8_config, heuristic_fp8_config  # noqa: E402


# --- quantization ------------------------------------------------------------------------------------


def test_quantize_kernel_equals_twin_exactly(fp8):
    # Ties, subnormals (< 2^-6 after scaling), a zero group, a group of one column (the tail), both signs.
    g = torch.Generator().manual_seed(3)
    v = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 300)[None, :]
    v[5, :128] = 0.0
    # amax 448 gives s = 1: 17 and 19 are ties (to 16 and 20, even), 3 * 2^-10 a subnormal tie (to 2^-8).
    v[7, :6] = torch.tensor([448.0, 17.0, 19.0, -17.0, 3 * 2**-10, 2**-11])
    q, s = fp8.quantize_groups_triton(v, 128)
    q_twin, s_twin = fp8.quantize_groups(v, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 3)
    assert torch.equal(s, s_twin) and torch.equal(q.float(), q_twin.float())
    assert s[5, 0] == 1.0 and (q[5, :128].float() == 0).all()
    assert s[7, 0] == 1.0 and q[7, :6].float().tolist() == [448.0, 16.0, 20.0, -16.0, 2**-8, 0.0]
    deq = fp8.dequantize_groups(q, s, 128)
    want = torch.stack([fake_quant_f64(row.double(), 128) for row in v])
    assert rel_l2(deq, want) < 1e-6  # float32 v / s against float64: the same grid points
    assert (q.float().abs().amax(dim=1) == 448).all()  # each row's largest value maps to 448


# --- the fused path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("shape,block_shape", SHAPES)
def test_kernels_match_twin(fp8, m, k, shape, block_shape):
    x, _, quantized, ids, weights = _problem(m, k, shape, block_shape, seed=m * 10 + k)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, block_shape)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("m,x_in_gate_up", [(1, False), (7, True)])
def test_x_quantized_inside_gate_up_or_apart(fp8, m, x_in_gate_up):
    # The plan quantizes x inside the gate-up GEMM only for the tiny-batch shortcut (M=1, k=1 here);
    # forced the other way round, both must give the twin's result (M=7: aligned blocks, gathered rows).
    x, _, quantized, ids, weights = _problem(m, 1, *SHAPES[0], seed=12)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, SHAPES[0][1], x_in_gate_up=x_in_gate_up)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("shape,block_shape", SHAPES)
def test_twin_matches_float64_emulation(fp8, shape, block_shape):
    x, (w13, w2), quantized, ids, weights = _problem(9, 2, shape, block_shape, seed=4)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=block_shape)
    emulated = emulation_f64(x, *quantized, ids, weights, block_shape)
    assert rel_l2(twin, emulated) < FLIP_TOL
    # The quantization is there: against the unquantized experts the recipe is off by a few percent.
    exact = experts_reference(x.double(), w13.double(), w2.double(), ids, weights)
    assert 0.02 < rel_l2(emulated, exact) < 0.15


def test_bf16_input(fp8):
    # bf16 x: the interpreter truncates the bf16 output, so the kernel-twin gap is ~ one bf16 step.
    x, _, quantized, ids, weights = _problem(17, 2, *SHAPES[0], dtype=torch.bfloat16, seed=2)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, SHAPES[0][1])
    assert rel_l2(out, twin) < 1e-2
    emulated = emulation_f64(x, *quantized, ids, weights, SHAPES[0][1])
    assert rel_l2(twin, emulated) < 1e-2


def test_empty_batch_and_tiny_batch_shortcut(fp8):
    x, _, quantized, ids, weights = _problem(0, 2, *SHAPES[0])
    out = fp8.fused_experts_fp8(x, *quantized, ids, weights)
    assert out.shape == (0, 160)
    # M=1, k=1, E=4: A*4 <= E, so no alignment runs (block 0 is assignment 0).
    x, _, quantized, ids, weights = _problem(1, 1, *SHAPES[0], seed=7)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, SHAPES[0][1])
    assert rel_l2(out, twin) < FLIP_TOL
    assert rel_l2(twin, emulation_f64(x, *quantized, ids, weights, SHAPES[0][1])) < FLIP_TOL


@pytest.mark.parametrize("shape,block_shape", SHAPES)
def test_expert_map_with_minus_one(fp8, shape, block_shape):
    # 7 global experts, 4 or 5 of them local; ids include -1 (skipped) and experts mapped to -1.
    num_experts = shape[0]
    expert_map = torch.full((7,), -1, dtype=torch.int32)
    expert_map[torch.randperm(7, generator=torch.Generator().manual_seed(1))[:num_experts]] = torch.arange(
        num_experts, dtype=torch.int32)
    x, _, quantized, ids, weights = _problem(11, 2, shape, block_shape, seed=5, num_global=7)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, block_shape, expert_map)
    assert rel_l2(out, twin) < FLIP_TOL
    emulated = emulation_f64(x, *quantized, ids, weights, block_shape, expert_map)
    assert rel_l2(twin, emulated) < FLIP_TOL
    not_local = (expert_map[ids.clamp(0).long()] < 0) | (ids < 0)
    assert not_local.any()


@pytest.mark.parametrize("config", [
    KernelConfig(64, GemmTile(128, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2)),  # one 64-row block per expert
    KernelConfig(16, GemmTile(256, 128, 2, 4, 2), GemmTile(32, 128, 4, 4, 2)),  # two h groups per gate-up tile
    KernelConfig(16, GemmTile(64, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2)),  # h in float32, quantized by down
    KernelConfig(64, GemmTile(32, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2)),
])
@pytest.mark.parametrize("m", [1, 9])
def test_explicit_configs(fp8, config, m):
    x, _, quantized, ids, weights = _problem(m, 2, *SHAPES[0], seed=8)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, SHAPES[0][1], config=config)
    assert rel_l2(out, twin) < FLIP_TOL


def test_narrow_gate_up_tiles_with_small_groups(fp8):
    # G = 32 with a 16-wide gate-up tile (h quantized by down) and a 64-wide one (two groups per tile).
    (shape, block_shape), g = SHAPES[1], 32
    for up_n in (16, 64):
        config = KernelConfig(16, GemmTile(up_n, g, 1, 4, 2), GemmTile(32, g, 1, 4, 2))
        x, _, quantized, ids, weights = _problem(6, 2, shape, block_shape, seed=up_n)
        out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, block_shape, config=config)
        assert rel_l2(out, twin) < FLIP_TOL


# --- arguments, configs, the custom op -------------------------------------------------------------


@pytest.mark.parametrize("block_shape", [(100, 128), (48, 32)])
def test_row_blocks_that_straddle_tiles(fp8, block_shape):
    """A block height that is not a multiple of the tile (any positive int is a valid block_shape[0]): the kernels'
    per-column scales equal the twin and the float64 emulation."""
    x, _, quantized, ids, weights = _problem(7, 2, SHAPES[0][0], block_shape, seed=3)
    out, twin = _kernel_vs_twin(fp8, x, quantized, ids, weights, block_shape)
    assert rel_l2(out, twin) < FLIP_TOL
    assert rel_l2(twin, emulation_f64(x, *quantized, ids, weights, block_shape)) < 1e-5


def test_bad_arguments(fp8):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = _problem(3, 2, *SHAPES[0])
    call = fp8.fused_experts_fp8
    with pytest.raises(TypeError, match="w13_q must be a 3-D float8_e4m3fn"):
        call(x, w13_q.float(), w13_s, w2_q, w2_s, ids, weights)
    with pytest.raises(ValueError, match=r"w13_scale must be \[4, 2, 2\]"):
        call(x, w13_q, w13_s[:, :1], w2_q, w2_s, ids, weights)
    with pytest.raises(ValueError, match="w2_scale must be"):
        call(x, w13_q, w13_s, w2_q, w2_s[:, :1].clone(), ids, weights)
    with pytest.raises(ValueError, match="activation must be one of"):  # any gated one is taken (session 40)
        call(x, w13_q, w13_s, w2_q, w2_s, ids, weights, activation="swiglu")
    with pytest.raises(ValueError, match=r"w13_scale must be \[4, 3, 2\]"):  # another block shape
        call(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=(64, 128))
    with pytest.raises(ValueError, match=r"block_shape\[1\] \(the reduction block.* one of \(16, 32, 64, 128\)"):
        call(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=(128, 96))
    with pytest.raises(ValueError, match="topk_ids must be"):
        call(x, w13_q, w13_s, w2_q, w2_s, ids.float(), weights)
    with pytest.raises(ValueError, match="x must be"):
        call(x.to(torch.float8_e4m3fn), w13_q, w13_s, w2_q, w2_s, ids, weights)


def test_config_rules_and_heuristic():
    bad_k = KernelConfig(16, GemmTile(128, 64), GemmTile(64, 128))
    with pytest.raises(ValueError, match="BLOCK_K of both GEMMs must be the block shape's 128"):
        check_config(bad_k, 128)
    with pytest.raises(ValueError, match="gate-up BLOCK_N must be a multiple of 128 or a power of two"):
        check_config(KernelConfig(16, GemmTile(96, 128), GemmTile(64, 128)), 128)
    with pytest.raises(ValueError, match="gate-up BLOCK_N must be a multiple of 32 or a power of two"):
        check_config(KernelConfig(16, GemmTile(8, 32), GemmTile(64, 32)), 32)
    check_config(KernelConfig(16, GemmTile(64, 128), GemmTile(64, 128)), 128)  # h to the down GEMM in float32
    for num_experts, n, k, top_k in ((128, 768, 2048, 8), (256, 2048, 7168, 8), (8, 14336, 4096, 2)):
        for m in (1, 8, 64, 512, 4096, 16384):
            for group in (32, 128):
                check_config(heuristic_fp8_config(m, num_experts, n, k, top_k, group), group)
    assert heuristic_fp8_config(1, 128, 768, 2048, 8).BLOCK_M == 16
    assert heuristic_fp8_config(4096, 128, 768, 2048, 8).BLOCK_M == 64


def test_tuned_file_nearest_m_and_refusal(user_config_dir):
    from moekit.experts.configs import clear_config_cache

    small = KernelConfig(16, GemmTile(128, 128, 1, 4, 5), GemmTile(32, 128, 1, 4, 5))
    large = KernelConfig(128, GemmTile(256, 128, 8, 8, 3), GemmTile(128, 128, 8, 8, 3))
    entries = {"1": small.to_dict(), "1024": large.to_dict()}
    path = user_config_dir / "E4_N96_K160_fp8_block_dev.json"
    path.write_text(json.dumps({"E": 4, "N": 96, "K": 160, "dtype": "fp8_block", "device": "dev", "configs": entries}))
    clear_config_cache()
    assert fp8_config(2, 4, 96, 160, 2, 128, "dev") == small
    assert fp8_config(600, 4, 96, 160, 2, 128, "dev") == large
    assert fp8_config(600, 4, 96, 160, 2, 128, "other") == heuristic_fp8_config(600, 4, 96, 160, 2)
    entries["1"]["up"]["BLOCK_N"] = 96
    path.write_text(json.dumps({"E": 4, "N": 96, "K": 160, "configs": entries}))
    clear_config_cache()
    with pytest.raises(ValueError, match="E4_N96_K160_fp8_block_dev.json: the gate-up BLOCK_N"):
        fp8_config(1, 4, 96, 160, 2, 128, "dev")


def test_opcheck_and_compile(fp8):
    x, _, quantized, ids, weights = _problem(5, 2, *SHAPES[0], seed=9)
    op = torch.ops.moekit.triton_experts_fp8
    # test_schema is left out: it multiplies every input tensor, which float8_e4m3fn does not support on the CPU.
    torch.library.opcheck(op, (x, *quantized, ids, weights, None, 128, 128, True, True, True),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    run = lambda x, ids, w: fp8.fused_experts_fp8(x, *quantized, ids, w)  # noqa: E731
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(x, ids, weights)
    torch.testing.assert_close(compiled, run(x, ids, weights))


@pytest.mark.parametrize("x_in_gate_up", [False, True])
def test_strided_inputs(fp8, x_in_gate_up):
    # x a misaligned column slice, w2_q stored transposed ([E, N, K] storage, as transformers' is_transposed
    # down_proj), w13_scale a column-major view: the kernels read everything through strides.
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = _problem(6, 2, *SHAPES[0], seed=13)
    wide = torch.randn(6, 162)
    wide[:, 1:161] = x
    x_view = wide[:, 1:161]
    w2_t = w2_q.transpose(1, 2).contiguous().transpose(1, 2)
    w13_s_t = w13_s.transpose(1, 2).contiguous().transpose(1, 2)
    quantized = (w13_q, w13_s_t, w2_t, w2_s)
    out, twin = _kernel_vs_twin(fp8, x_view, quantized, ids, weights, SHAPES[0][1], x_in_gate_up=x_in_gate_up)
    assert rel_l2(out, twin) < FLIP_TOL
    assert rel_l2(twin, fp8.fused_experts_fp8_torch(x, w13_q, w13_s, w2_q, w2_s, ids, weights)) < 1e-6  # BLAS order
