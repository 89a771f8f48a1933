"""``progress=`` of ``moekit.hf.use_moekit_blocks`` and ``offload_experts`` on a tiny transformers model built
offline (Qwen3-MoE, 3 MoE blocks): a callable gets (done, total) after every block, the default writes a line on a
terminal's stderr and nothing into a pipe, True writes it anywhere, False nothing; the swap itself is unchanged."""

from __future__ import annotations

import io
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import offload_experts, restore_blocks, use_moekit_blocks  # noqa: E402

import _hf_tiny_models as tiny  # noqa: E402

EXPERT_BYTES = 3 * 32 * 16 * 4  # one float32 expert of the tiny model: w13 [2N, K] + w2 [K, N]


class Terminal(io.StringIO):
    """A captured stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _walks():
    """Each long walk as ``walk(model, progress)`` with its name on the line."""
    return {
        "use_moekit_blocks": lambda model, **kw: use_moekit_blocks(model, quant="int8_w8a16", backend="reference",
                                                                   **kw),
        "offload_experts": lambda model, **kw: offload_experts(model, gpu_budget_bytes=4 * EXPERT_BYTES,
                                                               device="cpu", backend="grouped_mm", **kw),
    }


@pytest.mark.parametrize("name", ["use_moekit_blocks", "offload_experts"])
def test_a_callable_gets_every_block(name):
    model, calls = tiny.qwen3_moe_small(), []
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    _walks()[name](model, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_callable_counts_a_block_that_is_left_too(monkeypatch):
    """A block moekit cannot take (its config unreadable: blocks 2 and 3 here, by a stand-in) is still walked."""
    import moekit.hf.swap as swap

    model, calls = tiny.qwen3_moe_small(), []
    unreadable = {id(layer.mlp) for layer in model.model.layers[1:]}
    real = swap._swap_of

    def swap_of(block, *args, **kwargs):
        if id(block) in unreadable:
            raise ValueError("a config this test made unreadable")
        return real(block, *args, **kwargs)

    monkeypatch.setattr(swap, "_swap_of", swap_of)
    report = use_moekit_blocks(model, progress=lambda done, total: calls.append((done, total)))
    assert len(report.swapped) == 1 and len(report.left) == 2
    assert calls == [(1, 3), (2, 3), (3, 3)]
    restore_blocks(model)


@pytest.mark.parametrize("name", ["use_moekit_blocks", "offload_experts"])
def test_the_default_writes_on_a_terminal_only(name, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _walks()[name](tiny.qwen3_moe_small())
    text = terminal.getvalue()
    assert text.startswith(f"\r{name}: block 1/3 (") and f"\r{name}: block 3/3 (" in text and text.endswith(" s)\n")
    assert text.count("\n") == 1  # rewritten in place, one newline at the end
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    _walks()[name](tiny.qwen3_moe_small())
    assert pipe.getvalue() == ""


@pytest.mark.parametrize("name", ["use_moekit_blocks", "offload_experts"])
def test_true_writes_a_line_a_block_into_a_pipe_and_false_nothing(name, monkeypatch):
    for progress, lines in ((True, 3), (False, 0)):
        pipe, terminal = io.StringIO(), Terminal()
        monkeypatch.setattr(sys, "stderr", pipe if progress else terminal)
        _walks()[name](tiny.qwen3_moe_small(), progress=progress)
        text = (pipe if progress else terminal).getvalue()
        assert text.count("\n") == lines and "\r" not in text
        assert all(line.startswith(f"{name}: block {i}/3 (") for i, line in enumerate(text.splitlines(), 1))


@pytest.mark.parametrize("name", ["use_moekit_blocks", "offload_experts"])
def test_a_bad_progress_is_named_before_any_block_changes(name):
    model = tiny.qwen3_moe_small()
    with pytest.raises(TypeError, match=r"^progress must be None \(a line on a terminal\), True, False or a "
                                        r"callable\(done, total\), got str$"):
        _walks()[name](model, progress="yes")
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
