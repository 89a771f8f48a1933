"""``moekit train``: what training-time load balancing buys, on a small MoE language model.

    stdlib bytes (``data``) -> TinyMoELM (``model``) x 3 runs (``loop``) -> curves JSON (``curves``) + PNG (``plot``)

``ep``: the same runs with the MoE layers expert-parallel over N spawned processes (``moekit train --ep N``).
"""

from moekit.train.data import ByteCorpus, load_stdlib_bytes
from moekit.train.loop import METHODS, Curve, StepReport, TrainResult, TrainSettings, train_side_by_side
from moekit.train.model import TinyMoELM

__all__ = ["ByteCorpus", "load_stdlib_bytes", "METHODS", "Curve", "StepReport", "TrainResult", "TrainSettings",
           "train_side_by_side", "TinyMoELM"]
