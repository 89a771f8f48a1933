"""DeepSeek-V4's hash layers (``HashMoE``: a token-id table chooses the experts) on the fuzzer's seeded configs
(``_fuzz_cases.draw_hash_case``): the forward (plain, stats, repeated 3-D and strided calls, the routing, counts and
drops) and the gradients (x, the gate, w13 / w2, biases, the shared expert, the aux losses) through ``reference``,
``grouped_mm`` and ``triton`` (interpreted), with the torch and the fused (interpreted) hash router, against the
float64 loop of ``_fuzz_reference`` (``hash_route_token``: the table's experts, their scores / (sum + 1e-20)).

A failure prints the seed; ``python3 benchmarks/fuzz_layer.py --hash --grad --seeds S:S+1`` reruns it.
"""

from __future__ import annotations

import pytest
import torch

from _fuzz_cases import build, draw_hash_case, token_ids
from _fuzz_check import Outcome, check_case
from _fuzz_experts import rounded_gate_up
from _fuzz_grad import check_grads, compare, grad_case, layer_grads, projection, reference_grads, trainable
from _triton_helpers import router_and_experts_interpreted  # noqa: F401 (autouse: the kernels interpreted)

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

# softmax, sigmoid and sqrt(softplus) scores; the fused and the torch router; renormalised or not; a soft cap;
# capacity (float32 all: chosen for M <= 7 and the suite's time; benchmarks/fuzz_layer.py --hash runs every dtype)
SEEDS = (15, 19, 23, 25)


@pytest.mark.parametrize("seed", SEEDS)
def test_hash_layers_match_the_float64_loop(seed):
    case = draw_hash_case(seed)
    outcome = check_case(case)
    check_grads(case, ("reference", "grouped_mm", "triton"), outcome)
    assert outcome.compared and not outcome.failures, f"{case.describe()}\n" + "\n".join(outcome.failures)


def test_the_hash_seeds_reach_every_scoring_and_router():
    cases = [draw_hash_case(seed) for seed in SEEDS]
    assert all(trainable(c) and c.hash_table is not None and len(c.token_ids) == c.m for c in cases)
    assert {c.config.scoring for c in cases} == {"softmax", "sigmoid", "sqrtsoftplus"}
    assert {c.router for c in cases} == {"torch", "fused"}
    assert {c.config.renormalize for c in cases} == {True, False}
    assert any(c.capacity_factor for c in cases) and any(c.config.router_logit_softcap for c in cases)


def test_the_hash_reference_is_the_table_and_the_scores():
    """The float64 loop's hash routing by hand: V4's sqrt(softplus) at the table's experts (a repeated one counted
    twice), / (sum + 1e-20), times the scale."""
    from moekit import MoEConfig

    from _fuzz_reference import hash_route_token

    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=3, top_k=2, scoring="sqrtsoftplus",
                    hash_table_size=2, routed_scaling_factor=2.5)
    route = hash_route_token([0.0, 1.0, -2.0], cfg, [2, 2])
    assert route.ids == [2, 2] and route.weights == pytest.approx([1.25, 1.25], rel=1e-15)
    route = hash_route_token([0.0, 1.0, -2.0], cfg, [1, 0])
    s1, s0 = torch.tensor([1.0, 0.0], dtype=torch.float64).exp().log1p().sqrt().tolist()
    assert route.weights == pytest.approx([2.5 * s1 / (s1 + s0), 2.5 * s0 / (s1 + s0)], rel=1e-15)


def test_a_gate_up_product_rounded_across_the_clamp_s_kink_matches_the_rounding_loop():
    """Hash seed 499 (fp16, gelu_tanh clamped at 0.5 after the activation, fused shared slots): one |up| of shared
    slot 6 lies 2.2e-4 from the limit, and the fp16 product grouped_mm rounds before the clamp sits on its other side,
    so that element's gradient is 0 in one and not in the other: against the float64 loop slot 6's w13 gradient is
    26% off, against the loop that rounds the product as the layer does (``rounded_gate_up``) it is the rounding's
    own. ``check_grads`` takes either loop for a clamped low-precision case."""
    case = grad_case(draw_hash_case(499)).case
    assert case.dtype == torch.float16 and case.config.activation.limit == 0.5
    layer, x = build(case, "grouped_mm")
    got, forward = layer_grads(layer, x, projection(case), token_ids(case, case.m))
    plain, rounded = Outcome(), Outcome()
    compare(got, reference_grads(layer, case, x, forward.router_logits, projection(case)), case, "grouped_mm", plain)
    with rounded_gate_up(case.dtype):
        want = reference_grads(layer, case, x, forward.router_logits, projection(case))
    compare(got, want, case, "grouped_mm", rounded)
    assert any("grad w13" in f for f in plain.failures) and rounded.compared and not rounded.failures


def test_a_float64_layer_routed_in_float32_holds_its_gate_gradient_to_float32_s_bound():
    """Hash seed 70405 (float64, router_dtype float32, softmax over 3 experts, logits 0.3 / 4.0 / 0.3, 5 tokens kept):
    the gate's gradient is float32's softmax backward, 2.99e-6 off the float64 loop (a float32 torch twin of it the
    same bits), over the 1e-6 the rest of such a layer is held to: its gate's gradients (and x's) at float32's 1e-5."""
    case = draw_hash_case(70405)
    assert case.dtype == torch.float64 and case.config.router_dtype == "float32"
    outcome = Outcome()
    check_grads(case, ("reference",), outcome)
    assert outcome.compared and not outcome.failures, "\n".join(outcome.failures)
