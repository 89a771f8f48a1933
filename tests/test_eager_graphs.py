"""``MoE(eager_graph_rows=...)``: small eager calls replayed from CUDA graphs (``moekit.eager_graphs``).

Real CUDA graphs run only on the GPU (``benchmarks/host_time.py`` checks replayed layers against eager
ones there, in-place weight updates included). Here a stand-in graph that re-runs the captured function
on its static input holds the bookkeeping to account: which calls replay, which capture anew, which run
eagerly, what is kept and what is returned.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from moekit import MoEConfig
from moekit.eager_graphs import Captured, EagerGraphs
from moekit.layer import MoE


class StandInGraphs(EagerGraphs):
    """EagerGraphs on the CPU: every CPU tensor is eligible (rows permitting); a "graph" re-runs fn on
    the static input into the static output, as a replayed CUDA graph writes the same buffer."""

    def eligible(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows

    def _capture(self, fn, x, tensors):
        static_x = x.clone()
        static_out = fn(static_x)

        class Graph:
            def replay(self):
                static_out.copy_(fn(static_x))

        self.captures += 1
        return Captured(Graph(), static_x, static_out, tensors)


CONFIG = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2)


def _layer(rows=8, **kwargs):
    torch.manual_seed(0)
    layer = MoE(CONFIG, backend="reference", eager_graph_rows=rows, **kwargs)
    layer.eager_graphs = StandInGraphs(rows)
    return layer


def _eager(layer, x):
    graphs, layer.eager_graphs = layer.eager_graphs, None
    try:
        return layer(x)
    finally:
        layer.eager_graphs = graphs


def test_replayed_calls_equal_eager_and_capture_once_per_kind():
    layer = _layer()
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(layer(x), _eager(layer, x))
        assert layer.eager_graphs.captures == 1  # three calls, one kind
        layer(torch.randn(2, 16))
        layer(torch.randn(2, 3, 16))  # [.., K] input: flattened to 6 rows, a third kind
        assert layer.eager_graphs.captures == 3


def test_what_runs_eagerly():
    layer = _layer(rows=4)
    x = torch.randn(3, 16)
    layer(x)  # autograd on: the parameters need gradients
    with torch.no_grad():
        layer(torch.randn(5, 16))  # more rows than eager_graph_rows
        out = layer(x, return_stats=True)  # stats read counts back
    assert layer.eager_graphs.captures == 0
    assert torch.equal(out.out, _eager(layer, x).detach())


def test_capacity_dropping_runs_eagerly():
    layer = _layer(capacity_factor=1.0)
    with torch.no_grad():
        layer(torch.randn(4, 16))
    assert layer.eager_graphs.captures == 0


def test_a_new_weight_tensor_captures_again_and_in_place_updates_do_not():
    layer = _layer()
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)
        layer.w2.mul_(2.0)  # in place: the same memory, the graph reads the new values
        assert torch.equal(layer(x), _eager(layer, x))
        assert layer.eager_graphs.captures == 1
        layer.w13 = torch.nn.Parameter(layer.w13 * 0.5)  # a new tensor: a new graph
        assert torch.equal(layer(x), _eager(layer, x))
        assert layer.eager_graphs.captures == 2


def test_the_returned_tensor_is_not_the_graphs_buffer():
    layer = _layer()
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = layer(x)
        kept = first.clone()
        layer(torch.randn(4, 16))  # a replay rewrites the static output
    assert torch.equal(first, kept)


def test_oldest_graph_dropped_past_the_limit():
    graphs = StandInGraphs(64, max_graphs=2)
    for rows in (1, 2, 3, 1):
        graphs.run(lambda x: x * 2, torch.ones(rows, 4), ("k",))
    assert graphs.captures == 4 and len(graphs) == 2  # 1 was dropped when 3 came, then captured again


def test_graphs_keep_their_tensors_and_clear_lets_them_go():
    graphs = StandInGraphs(8)
    weight = torch.ones(4)
    graphs.run(lambda x: x * weight, torch.ones(2, 4), (weight.data_ptr(),), (weight,))
    assert len(graphs) == 1
    graphs.clear()
    assert len(graphs) == 0


def test_quantize_and_device_moves_clear_the_graphs():
    layer = _layer()
    with torch.no_grad():
        layer(torch.randn(4, 16))
    layer.to(torch.float64)
    assert len(layer.eager_graphs) == 0
    with torch.no_grad():
        layer(torch.randn(4, 16, dtype=torch.float64))
    layer.quantize_("int8_w8a16")
    assert len(layer.eager_graphs) == 0


@pytest.mark.parametrize("rows", [0, -1, 1.5, True])
def test_bad_rows_are_refused(rows):
    with pytest.raises((ValueError, TypeError), match="eager_graph_rows"):
        MoE(CONFIG, eager_graph_rows=rows)


def test_cpu_tensors_never_graph():
    graphs = EagerGraphs(8)
    assert graphs.run(lambda x: x, torch.ones(2, 4), ()) is None


def test_two_threads_on_one_stream_each_get_their_own_tokens():
    """Thread A's replay (the stand-in graph) lets thread B call the layer with other tokens, then goes on: B must
    wait for A's copy, replay and clone (they share the graph of one stream), so each gets its own tokens' output.
    Before session 54 B's input copy landed in A's static input first, and A got B's output."""
    layer = _layer()
    x_a, x_b = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        want_a, want_b = _eager(layer, x_a), _eager(layer, x_b)
        layer(x_a)  # captured: A's next call replays
    got = {}

    def call_b():
        with torch.no_grad():
            got["b"] = layer(x_b)

    thread_b = threading.Thread(target=call_b)
    captured = next(iter(layer.eager_graphs._graphs.values()))
    replay = captured.graph.replay

    def replay_letting_b_in():
        captured.graph.replay = replay  # once
        thread_b.start()
        thread_b.join(timeout=0.5)  # B waits on the lock (passes the time); unlocked, B ran whole meanwhile
        replay()

    captured.graph.replay = replay_letting_b_in
    with torch.no_grad():
        got["a"] = layer(x_a)
    thread_b.join()
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)


def test_a_copy_of_a_layer_with_graphs_starts_with_none():
    layer = _layer()
    with torch.no_grad():
        layer(torch.randn(4, 16))
    twin = copy.deepcopy(layer)
    assert len(twin.eager_graphs) == 0 and twin.eager_graphs.max_rows == 8 and len(layer.eager_graphs) == 1
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(twin(x), _eager(layer, x))  # its own graph, over its own tensors
