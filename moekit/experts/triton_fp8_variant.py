"""What an fp8 Triton experts call adds to DeepSeek-V3's recipe (issue #15, session 40): expert biases and the
activation variant (any gated ``ActivationSpec``: gpt-oss's interleaved gate/up rows, alpha, clamp and up_shift;
GELU), as the key and the constexprs of its plan (``triton_fp8_plan``; the kernels: ``_kernels/gemm_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec, as_spec, glu_constexprs


@dataclass(frozen=True)
class Fp8Variant:
    """What a call adds to DeepSeek-V3's recipe (``gemm_fp8``'s biases and activation variant, issue #15), as a plan's
    key: a plan is built for one value (its kernels specialise on the biases' presence, dtype and 16-byte alignment
    and on the spec's constexprs), and each call passes its own bias tensors, so a cached plan never runs with another
    call's biases nor with another kind's constexprs."""

    activation: str | ActivationSpec = "silu"  # gated; ``activations.plan_activation``'s: a name for a plain spec
    b13: tuple | None = None  # (dtype, data_ptr % 16) of b13 [E, 2N] contiguous; None: no b13
    b2: tuple | None = None  # (dtype, data_ptr % 16) of b2 [E, K] contiguous; None: no b2

    @staticmethod
    def of(activation: str | ActivationSpec, b13: torch.Tensor | None, b2: torch.Tensor | None) -> "Fp8Variant":
        """The variant of a call (PLAIN, one object, for the plain SiLU without biases, named or as its spec: no
        dataclass built)."""
        if b13 is None and b2 is None and (activation == "silu" or activation == _SILU):
            return PLAIN
        spec = as_spec(activation)
        return Fp8Variant(spec.name if spec.plain else spec, *(
            None if b is None else (b.dtype, b.data_ptr() & 15) for b in (b13, b2)))

    @property
    def plain(self) -> bool:
        """No bias, the plain SiLU: the plan of before (persistent GEMMs, TMA and PAIR_DOT as the rules allow)."""
        return self.activation == "silu" and self.b13 is None and self.b2 is None

    @property
    def interleaved(self) -> bool:
        """Gate column j at w13 row 2j, up at 2j + 1 (gpt-oss's order)."""
        return as_spec(self.activation).interleaved

    def constexprs(self) -> dict:
        """The gate-up kernel's activation constexprs: none for the plain call (ACT None: its SiLU-and-mul written as
        before, so the kernel is the one before), else ACT and the spec's fields (b13 or b2 alone: the plain SiLU's)."""
        if self.plain:
            return {}
        spec = as_spec(self.activation)
        return dict(ACT=spec.kernel_id, INTERLEAVED=spec.interleaved, **glu_constexprs(spec))


PLAIN = Fp8Variant()
_SILU = ActivationSpec("silu")
