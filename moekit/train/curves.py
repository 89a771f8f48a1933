"""The curves of ``moekit train`` as JSON, and a summary of how each run ended.

JSON layout: ``{"settings": TrainSettings fields, "runs": {method: {"loss": [...], "imbalance": [...],
"dropped": [...], "seconds": s}}, "data": {"root", "files", "bytes"}, "torch": version, "summary":
{method: {"loss", "imbalance", "dropped"}}}``; per-step lists have one value per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moekit.train.data import ByteCorpus
from moekit.train.loop import TrainResult

TAIL_FRACTION = 0.2  # the summary averages the last 20% of the steps: one step's imbalance is noisy


def tail_mean(values: list[float], fraction: float = TAIL_FRACTION) -> float:
    """Mean of the last ``fraction`` of ``values`` (at least one)."""
    if not values:
        raise ValueError("values must not be empty")
    n = max(1, round(len(values) * fraction))
    return sum(values[-n:]) / n


def summary(result: TrainResult) -> dict[str, dict[str, float]]:
    """method -> the tail means of loss, imbalance and dropped fraction."""
    return {m: {"loss": tail_mean(c.loss), "imbalance": tail_mean(c.imbalance), "dropped": tail_mean(c.dropped)}
            for m, c in result.curves.items()}


def curves_document(result: TrainResult, corpus: ByteCorpus) -> dict:
    doc = result.to_dict()
    doc["data"] = {"root": corpus.root, "files": corpus.files, "bytes": int(corpus.data.numel())}
    doc["torch"] = torch.__version__
    doc["summary"] = summary(result)
    return doc


def write_curves(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
