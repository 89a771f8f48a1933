"""A row of ``moekit bench --hf``: one implementation in one mode, its timed samples and their medians, its
errors against the references, and why a metric has no number."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from moekit.bench import hf_measure as hm

NO_REFERENCE = "NoReference: the eager implementation did not run (failed or not attempted), nothing to compare with"
ERR_EAGER, ERR_FP64 = "logits_rel_err_vs_eager", "logits_rel_err_vs_fp64"  # a Row's two error metrics


@dataclass
class Row:
    impl: str
    mode: str  # "eager" (no torch.compile) or "compiled" (static cache + torch.compile of the decode step)
    decode_tok_s: float | None = None  # decode_tokens / median seconds of the whole generate call
    # steady-state decode: (decode_tokens - 1) / (median generate(decode_tokens) - median generate(1)); the
    # prompt's prefill and generate's per-call setup (a static cache, compile guards) cancel out
    step_tok_s: float | None = None
    prefill_ms: float | None = None  # median ms of the B x L forward (eager mode only: generate compiles decode)
    logits_rel_err_vs_eager: float | None = None  # eager mode: prefill logits; compiled: decode step logits
    logits_rel_err_vs_fp64: float | None = None  # the same logits against the float64 model's (hf_fp64)
    # compiled rows (hf_compile_counts): dynamo's graphs and graph breaks in the warm-up, and the frames it compiled
    # again in the timed passes (0: no recompile); None: eager mode, or not measured
    compile_graphs: int | None = None
    compile_graph_breaks: int | None = None
    recompiles: int | None = None
    errors: dict[str, str] = field(default_factory=dict)  # metric -> "Type: first line" where it failed or was skipped
    _samples: dict[str, list[float]] = field(default_factory=dict, repr=False)  # metric -> seconds per repeat

    def attempt(self, metric: str, fn: Callable[[], object]):
        """fn(), or None with the error recorded under ``metric``."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001  (any failure of an implementation is a result, not a crash)
            self.errors[metric] = hm.error_text(err)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    def record(self, metric: str, seconds: float) -> None:
        self._samples.setdefault(metric, []).append(seconds)

    def finish(self, decode_tokens: int) -> dict:
        if "decode" in self._samples and "decode_tok_s" not in self.errors:
            self.decode_tok_s = decode_tokens / statistics.median(self._samples["decode"])
            if "decode1" in self._samples and "step_tok_s" not in self.errors and decode_tokens > 1:
                steps = statistics.median(self._samples["decode"]) - statistics.median(self._samples["decode1"])
                self.step_tok_s = (decode_tokens - 1) / steps if steps > 0 else None
        if "prefill" in self._samples and "prefill_ms" not in self.errors:
            self.prefill_ms = 1e3 * statistics.median(self._samples["prefill"])
        return {k: v for k, v in asdict(self).items() if k != "_samples"}
