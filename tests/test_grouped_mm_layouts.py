"""The grouped_mm backend's stages: every layout, GEMM strategy and the chunked path against a float64 per-token loop
(``_helpers.experts_loop``); the plan (layout, chunks) by memory budget; the layouts' weighted inverses."""

import pytest
import torch

from _helpers import experts_loop
from moekit import MoE, MoEConfig
from moekit.experts.grouped_mm import (
    CPU_GEMMS, DEFAULT_MEMORY_BUDGET_BYTES, GROUPED_MM_LAYOUTS, experts_grouped_mm, plan_grouped_mm,
)
from moekit.layouts import (
    choose_layout, combine_contiguous, combine_masked, masked_layout, permute_contiguous, unmask, unpermute_contiguous,
)

E, N, K = 6, 8, 16


def rel_err(got, want):
    return float((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30))


def problem(m, k, seed, skips=True, duplicates=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    w13 = torch.randn(E, 2 * N, K, generator=g) * K**-0.5
    w2 = torch.randn(E, K, N, generator=g) * N**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k]
                       for _ in range(m)]) if m else torch.zeros(0, k, dtype=torch.long)
    if m and duplicates:
        ids[::3, -1] = ids[::3, 0]  # a token routed twice to one expert: both slots count
    if m and skips:
        ids[1::4, 0] = -1  # moekit's skip / capacity drop
        ids[2::5, -1] = E + 1  # transformers' EP sentinel (id >= E)
    weights = torch.rand(m, k, generator=g)
    return x, w13, w2, ids.int(), weights


@pytest.mark.parametrize("layout", ["auto", *GROUPED_MM_LAYOUTS])
@pytest.mark.parametrize("cpu_gemm", CPU_GEMMS)
@pytest.mark.parametrize("grad", [False, True])
def test_every_layout_and_gemm_equals_token_loop(layout, cpu_gemm, grad):
    x, w13, w2, ids, weights = problem(37, 3, seed=1)
    want = experts_loop(x, w13, w2, ids, weights)
    with torch.set_grad_enabled(grad):
        got = experts_grouped_mm(x.requires_grad_(grad), w13, w2, ids, weights, layout=layout, cpu_gemm=cpu_gemm)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("layout", GROUPED_MM_LAYOUTS)
def test_small_budget_runs_in_chunks_and_stays_exact(layout):
    x, w13, w2, ids, weights = problem(50, 4, seed=2)
    budget = 20_000  # fits a few tokens' rows, not 50
    plan = plan_grouped_mm(50, 4, E, K, N, torch.float32, memory_budget_bytes=budget, layout=layout)
    assert plan.layout == layout and 1 <= plan.chunk_tokens < 50 and "chunks of" in plan.reason
    got = experts_grouped_mm(x, w13, w2, ids, weights, memory_budget_bytes=budget, layout=layout)
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5


def test_plan_default_budget_and_choice():
    plan = plan_grouped_mm(512, 8, 128, 2048, 768, torch.float32)
    assert plan.layout == "contiguous" and plan.chunk_tokens == 512  # fewest rows, and 105 MB fits 1 GiB
    assert DEFAULT_MEMORY_BUDGET_BYTES == 1 << 30
    assert plan_grouped_mm(8192, 8, 128, 2048, 768, torch.float32).chunk_tokens == 4096  # 1.7 GB does not
    assert plan_grouped_mm(4, 2, E, K, N, torch.float32, allow_sync=False).layout == "contiguous"
    with pytest.raises(ValueError, match="cannot hold even one token"):
        plan_grouped_mm(4, 2, E, K, N, torch.float32, memory_budget_bytes=16)
    with pytest.raises(ValueError, match="layout must be 'auto' or one of"):
        plan_grouped_mm(4, 2, E, K, N, torch.float32, layout="block_aligned")
    with pytest.raises(ValueError, match="CPU eager only"):
        plan_grouped_mm(4, 2, E, K, N, torch.float32, layout="masked_measured_cap", allow_sync=False)
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        experts_grouped_mm(*problem(3, 2, seed=0), cpu_gemm="blas")


def test_empty_batch_every_layout():
    x, w13, w2, ids, weights = problem(0, 2, seed=0)
    for layout in GROUPED_MM_LAYOUTS:
        assert experts_grouped_mm(x, w13, w2, ids, weights, layout=layout).shape == (0, K)


def test_expert_map_and_float64():
    x, w13, w2, ids, weights = problem(20, 3, seed=4, duplicates=False)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1])  # this rank holds experts 0, 2, 4, 6 as 0..3
    local = torch.where((ids >= 0) & (ids < 8), expert_map[ids.long().clamp(0, 7)], -1)
    want = experts_loop(x, w13[:4], w2[:4], local, weights)
    for layout in GROUPED_MM_LAYOUTS:
        got = experts_grouped_mm(x, w13[:4], w2[:4], ids, weights, expert_map=expert_map, layout=layout)
        assert rel_err(got, want) < 1e-5
    got64 = experts_grouped_mm(x.double(), w13.double(), w2.double(), ids, weights)
    assert got64.dtype == torch.float64 and rel_err(got64, experts_loop(x, w13, w2, ids, weights)) < 1e-12


def test_compiled_small_budget_chunks_trace_whole():
    x, w13, w2, ids, weights = problem(24, 2, seed=5)
    fn = torch.compile(lambda *a: experts_grouped_mm(*a, memory_budget_bytes=5_000), fullgraph=True,
                       backend="aot_eager")
    assert plan_grouped_mm(24, 2, E, K, N, torch.float32, memory_budget_bytes=5_000, allow_sync=False).chunk_tokens < 24
    assert rel_err(fn(x, w13, w2, ids, weights), experts_loop(x, w13, w2, ids, weights)) < 1e-5


def test_layer_stats_name_the_layout():
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    stats = MoE(cfg)(torch.randn(5, K), return_stats=True).stats
    assert stats.layout == "contiguous"
    assert MoE(cfg, backend="reference")(torch.randn(5, K), return_stats=True).stats.layout == "per_expert_loop"


def test_layer_stats_name_the_quantized_layout():
    """fp8_block off the Triton path runs moekit.quant's per-expert recipe loop, whatever the backend's
    own plan; weight-only schemes run the backend's dense plan on the dequantized weights."""
    cfg = MoEConfig(hidden_size=128, moe_intermediate_size=128, num_experts=E, top_k=2)
    fp8 = MoE(cfg).quantize_("fp8_block")
    assert fp8(torch.randn(5, 128), return_stats=True).stats.layout == "per_expert_loop"
    assert MoE(cfg).quantize_("int8_w8a16")(torch.randn(5, 128), return_stats=True).stats.layout == "contiguous"


def test_layer_backend_options_reach_the_backend():
    """MoE(backend_options=) binds grouped_mm's memory budget: the layer then runs in chunks (its stats
    say so) and still equals the float64 token loop; a name the backend does not take is refused."""
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    torch.manual_seed(0)
    layer = MoE(cfg, backend="grouped_mm", backend_options={"memory_budget_bytes": 5_000}, dtype=torch.float64)
    x = torch.randn(40, K, dtype=torch.float64)
    with torch.no_grad():
        result = layer(x, return_stats=True)
        routing = layer.route_tokens(x).routing
        want = experts_loop(x, layer.w13, layer.w2, routing.topk_ids, routing.topk_weights)
    assert "in chunks of" in result.stats.layout
    assert rel_err(result.out, want) < 1e-12
    with pytest.raises(ValueError, match=r"backend_options \['budget'\].*experts_grouped_mm"):
        MoE(cfg, backend="grouped_mm", backend_options={"budget": 1})
    with pytest.raises(TypeError, match="backend_options must be a dict"):
        MoE(cfg, backend_options=[("memory_budget_bytes", 1)])


def test_weighted_inverses_equal_inverse_then_sum_and_skip_padding():
    x, _, _, ids, weights = problem(30, 3, seed=6)
    want = lambda rows: (rows.double() * weights[..., None].double()).sum(1)  # noqa: E731
    contiguous = permute_contiguous(x, ids, E, align=4, fill=float("nan"))  # padding rows hold NaN
    assert torch.equal(contiguous.src_of_row < 90, contiguous.segment_ids >= 0)
    got = combine_contiguous(contiguous.x_perm, contiguous, weights)
    torch.testing.assert_close(got.double(), want(unpermute_contiguous(contiguous.x_perm, contiguous)))
    masked = masked_layout(x, ids, E, fill=float("nan"))
    got = combine_masked(masked.x_masked, masked, weights)
    torch.testing.assert_close(got.double(), want(unmask(masked.x_masked, masked)))
    assert not torch.isnan(got).any()


def test_chooser_candidates():
    args = dict(num_tokens=64, top_k=8, num_experts=16, hidden_size=256, intermediate_size=128, dtype_bytes=4,
                memory_budget_bytes=2**30)
    assert choose_layout(**args).name == "block_aligned"
    only = choose_layout(candidates=("contiguous", "masked_measured_cap"), align=1, **args)
    assert only.name == "contiguous" and {e.name for e in only.estimates} == {"contiguous", "masked_measured_cap"}
    with pytest.raises(ValueError, match="candidates must be"):
        choose_layout(candidates=("dense",), **args)
