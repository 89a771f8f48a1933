"""One preset's packed expert weights for the weight-only device checks (``wo38_device_check.py``): per scheme the
(w13, w2) ``WoWeight``s, built on first use. Shapes: E experts, N the expert width, K the hidden size; w13 packs
[E, 2N, K], w2 [E, K, N]. (Session 28's ``wo8_variants.py`` held it beside that check's cells, with bf16 weights of
the same shapes: ``git show 87f368f6:benchmarks/wo8_variants.py``.)"""

from __future__ import annotations

from moekit.bench.cells import Shape
from moekit.experts.triton_wo import WoWeight
from wo_device_check import quantized


class Weights:
    """One preset's weights: per scheme the (w13, w2) WoWeights, random from ``seed`` (None: uninitialised, for
    compiling), each built on first use and held."""

    def __init__(self, s: Shape, dev, seed: int | None):
        self.s, self.dev, self.seed, self.held = s, dev, seed, {}

    def wo(self, scheme: str) -> tuple[WoWeight, WoWeight]:
        if scheme not in self.held:
            s, seed = self.s, self.seed
            self.held[scheme] = (quantized(scheme, s.num_experts, 2 * s.n, s.k, self.dev, seed=seed),
                                 quantized(scheme, s.num_experts, s.k, s.n, self.dev, seed=None if seed is None
                                           else seed + 1))
        return self.held[scheme]
