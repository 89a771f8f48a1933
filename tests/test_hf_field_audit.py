"""The config-field audit (tests/_hf_field_audit.py) on two families, and on a reader made to drop a field: it finds
what a reader drops. The whole audit (every family the swap takes) runs as a script (minutes on 2 CPU cores)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import moekit.config_hf as config_hf  # noqa: E402

from _hf_field_audit import audit  # noqa: E402
from test_hf_swap_walk import _FAMILIES  # noqa: E402


def _key(family: str) -> str:
    return next(k for k, f in _FAMILIES.items() if f.family == family)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_every_field_the_block_reads_is_followed(family):
    verdicts = audit(_key(family))
    assert verdicts and all(v.outcome == "followed" for v in verdicts), [v for v in verdicts if v.outcome != "followed"]
    assert any(v.field in ("norm_topk_prob", "num_experts_per_tok") for v in verdicts)


def test_a_dropped_field_is_found(monkeypatch):
    """Qwen3-MoE's reader made to ignore norm_topk_prob: the audit names that field, and only it."""
    reader = config_hf.HF_READERS["qwen3_moe"]
    monkeypatch.setitem(config_hf.HF_READERS, "qwen3_moe", lambda d: dict(reader(d), renormalize=False))
    bad = [v for v in audit(_key("qwen3_moe")) if v.outcome != "followed"]
    assert [v.field for v in bad] == ["norm_topk_prob"] and bad[0].outcome.startswith("MISMATCH")
