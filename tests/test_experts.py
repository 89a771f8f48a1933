"""Every experts backend against a float64 per-token loop (``_helpers.experts_loop``)."""

import functools

import pytest
import torch

from _helpers import TOLERANCE, experts_loop, make_problem, rel_l2
from moekit.experts import available_backends, call_backend, get_backend, run_experts

BACKENDS = ["reference", "grouped_mm"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, e, hidden, inter",
                         [(1, 1, 4, 16, 8), (33, 6, 8, 24, 20), (64, 2, 5, 32, 48), (7, 3, 3, 17, 13)])
def test_backend_matches_float64_loop(backend, dtype, m, k, e, hidden, inter):
    x, w13, w2, ids, weights = make_problem(m, k, e, hidden, inter, seed=m * e, skips=True)
    ref = experts_loop(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)
    got = run_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights, backend=backend)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_l2(got, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_other_activations(backend, activation):
    x, w13, w2, ids, weights = make_problem(9, 2, 4, 16, 8, seed=4)
    ref = experts_loop(x, w13, w2, ids, weights, spec=activation)
    assert rel_l2(run_experts(x, w13, w2, ids, weights, activation=activation, backend=backend), ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_markers_expert_map_and_sentinels(backend):
    x, w13, w2, ids, weights = make_problem(20, 3, 8, 16, 8, seed=9)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1])
    ref = experts_loop(x, w13[:4], w2[:4], ids, weights, expert_map=expert_map.tolist())
    got = run_experts(x, w13[:4], w2[:4], ids, weights, expert_map=expert_map, backend=backend)
    assert rel_l2(got, ref) < 1e-5
    sentinel = torch.where(ids >= 4, 4, ids)  # transformers' EP sentinel: id >= num_experts
    ref = experts_loop(x, w13[:4], w2[:4], sentinel, weights)
    assert rel_l2(run_experts(x, w13[:4], w2[:4], sentinel, weights, backend=backend), ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_on_one_expert_and_empty_batch(backend):
    x, w13, w2, _, _ = make_problem(10, 1, 6, 16, 8, seed=2)
    ids, weights = torch.full((10, 1), 4, dtype=torch.int32), torch.ones(10, 1)
    assert rel_l2(run_experts(x, w13, w2, ids, weights, backend=backend),
                  experts_loop(x, w13, w2, ids, weights)) < 1e-5
    empty = run_experts(x[:0], w13, w2, ids[:0], weights[:0], backend=backend)
    assert empty.shape == (0, 16)
    direct = get_backend(backend)(x[:0], w13, w2, ids[:0], weights[:0])  # the backend itself, no shortcut
    assert direct.shape == (0, 16)


def test_auto_picks_an_available_backend_on_cpu():
    assert available_backends("cpu")[0] == "grouped_mm"


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda p: p.__setitem__(1, p[1][:, :, :5]), ValueError, "w13 must have shape"),
        (lambda p: p.__setitem__(2, p[2][:, :, :3]), ValueError, "w2 must have shape"),
        (lambda p: p.__setitem__(3, p[3].float()), TypeError, "topk_ids must be int32 or int64"),
        (lambda p: p.__setitem__(4, p[4][:, :1]), ValueError, "topk_weights must have the shape"),
        (lambda p: p.__setitem__(1, p[1].double()), TypeError, "must share a dtype"),
    ],
)
def test_bad_arguments_are_named(mutate, error, match):
    problem = list(make_problem(4, 2, 3, 8, 4, seed=0))
    mutate(problem)
    with pytest.raises(error, match=match):
        run_experts(*problem)
    with pytest.raises(ValueError, match="backend must be one of"):
        run_experts(*make_problem(4, 2, 3, 8, 4, seed=0), backend="cutlass")


@pytest.mark.parametrize("position, name", [(0, "x"), (1, "w13"), (2, "w2"), (3, "topk_ids"), (4, "topk_weights")])
@pytest.mark.parametrize("value", [None, [[1.0, 2.0]]])
@pytest.mark.parametrize("entry", ["run_experts", "call_backend"])
def test_an_argument_that_is_no_tensor_is_named(position, name, value, entry):
    """None or a list where a tensor goes raised AttributeError ('NoneType' object has no attribute 'device'); now a
    TypeError naming the argument and what it must be, from both public entries."""
    problem = list(make_problem(4, 2, 3, 8, 4, seed=0))
    problem[position] = value
    kind = "a torch.Tensor or a moekit.quant QuantizedWeight" if name in ("w13", "w2") else "a torch.Tensor"
    call = run_experts if entry == "run_experts" else functools.partial(call_backend, get_backend("reference"))
    with pytest.raises(TypeError, match=f"^{name} must be {kind}.*, got {type(value).__name__}$"):
        call(*problem)
    problem = list(make_problem(4, 2, 3, 8, 4, seed=0))
    with pytest.raises(TypeError, match="^expert_map must be a torch.Tensor, got list$"):
        call(*problem, expert_map=[0, 1, 2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_duplicate_ids_in_a_row(backend, dtype):
    """A token routed twice to one expert (from a user, or transformers' EP sentinel id >= E) counts twice."""
    x, w13, w2, _, weights = make_problem(24, 3, 4, 16, 8, seed=6)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 5, (24, 3), generator=g).int()  # id 4 = E: the sentinel, often twice in a row
    ids[:3] = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 1, 4]])
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    ref = experts_loop(x, w13, w2, ids, weights)
    assert rel_l2(run_experts(x, w13, w2, ids, weights, backend=backend), ref) < TOLERANCE[dtype]
