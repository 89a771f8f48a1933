"""``bench --hf``'s compiled decode, moekit's rows: one graph a decode step and no recompile after the warm-up, on
every tiny model that has a compiled decode, counted by dynamo itself (its counters; a backend that counts the
graphs each step calls). Session 50 measured Step-3.7's compiled moekit_blocks decode slower than its eager one on an
H100: under transformers 5.17 its unclamped layers hold ``limit = inf``, which moekit refused, so those blocks ran
transformers' own loop, whose ``nonzero`` broke the graph; and a row compiled after ``eager`` inherited the frames
that loop's break left uncompiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is part of the test extras")

from moekit.bench import hf_measure  # noqa: E402
from moekit.bench.hf_compile_counts import GraphCalls, counting_backend, dynamo_counts, fresh_dynamo  # noqa: E402
from moekit.bench.hf_models import available_models, build_model, hf_config, static_cache_gap, use_impl  # noqa: E402
from moekit.bench.hf_run import default_options, make_inputs, measure_compiled  # noqa: E402

DECODE_TOKENS = 4  # 3 compiled decode steps a generate: the first token comes from the (uncompiled) prefill


def _tiny(name: str):
    model = build_model(hf_config(name, 2, tiny=True), torch.float32, torch.device("cpu"))
    return model, make_inputs(256, default_options(name, torch.device("cpu"), tiny=True), torch.device("cpu"))


# every model but DeepSeek-V4, which has no compiled decode (hf_models.static_cache_gap; test_bench_hf_v4_step)
COMPILED_MODELS = [name for name in available_models() if name != "deepseek-v4"]


@pytest.mark.parametrize("impl", ["moekit", "moekit_blocks"])
@pytest.mark.parametrize("name", COMPILED_MODELS)
def test_a_decode_step_is_one_graph_and_nothing_recompiles_after_the_warm_up(name, impl):
    """The bench's pattern after the warm-up: a decode, a 1-token generate (its step-rate baseline), a decode; then a
    prompt 2 tokens longer decoding 2 fewer (the same static cache, another eager prefill; longer, not shorter: the
    tiny gpt-oss's sliding-window cache guards on its fill, which a prompt under its window of 8 changes); none of it
    compiles a frame, and each decode step calls exactly one graph (a graph break would call two or more)."""
    model, inputs = _tiny(name)
    assert static_cache_gap(model) is None
    use_impl(model, impl)
    calls = GraphCalls()
    config = hf_measure.compile_config(torch.device("cpu"), counting_backend(calls))
    fresh_dynamo()
    before = dynamo_counts()
    hf_measure.decode(model, inputs.prompt, DECODE_TOKENS, compiled=config)
    warm = dynamo_counts() - before
    assert warm.graph_breaks == 0 and warm.frames >= 1  # compiled, whole
    calls.count, before = 0, dynamo_counts()
    for tokens in (DECODE_TOKENS, 1, DECODE_TOKENS):
        hf_measure.decode(model, inputs.prompt, tokens, compiled=config)
    longer = torch.cat([inputs.prompt, inputs.prompt[:, :2]], dim=1)  # [1, P + 2]
    hf_measure.decode(model, longer, DECODE_TOKENS - 2, compiled=config)
    after = dynamo_counts() - before
    assert after.frames == 0 and after.graph_breaks == 0  # no recompile
    assert calls.count == 2 * (DECODE_TOKENS - 1) + (DECODE_TOKENS - 3)  # one graph a decode step
    fresh_dynamo()


def test_a_row_compiled_after_eagers_graph_breaks_is_still_one_graph():
    """measure_compiled compiles each implementation on a fresh dynamo state: transformers' own loop (``eager``)
    breaks the graph (the condition that made the rows after it run partly uncompiled: 13 graphs a step for moekit
    on this model), moekit_blocks after it compiles to one graph with no break, and its timed passes recompile
    nothing; both rows carry their counts."""
    model, inputs = _tiny("qwen3")
    opts = default_options("qwen3", torch.device("cpu"), tiny=True, layers=2, repeats=1)
    rows = {r.impl: r for r in measure_compiled(model, ["eager", "moekit_blocks"], inputs, opts, None,
                                                lambda msg: None).rows}
    assert rows["eager"].compile_graph_breaks > 0 and rows["eager"].compile_graphs > 1
    blocks = rows["moekit_blocks"]
    assert (blocks.compile_graphs, blocks.compile_graph_breaks, blocks.recompiles) == (1, 0, 0)
    assert blocks.finish(opts.decode_tokens)["decode_tok_s"] > 0


def test_the_counting_backend_counts_each_graph_a_call_runs():
    """A function with one graph break runs as two graphs: two calls counted a call."""
    calls = GraphCalls()

    def two_pieces(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    fresh_dynamo()
    compiled = torch.compile(two_pieces, backend=counting_backend(calls))
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0)) and calls.count == 2
    compiled(torch.ones(3))
    assert calls.count == 4
    fresh_dynamo()
