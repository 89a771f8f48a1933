"""The router options the fused kernels compute (``MoEConfig.changed_router_options``), as their plans take them.

    Route: [soft-cap -> score (softmax, sigmoid or sqrt(softplus)) -> (bias on scores or logits)
      -> (grouped: max / top-2 sum, dropped groups -inf or 0) -> top-k -> weights x scaling (+ shared slots x weight)]

Torch twin: ``moekit.routing.route`` (and ``append_shared_slots``). The defaults are the router of session 33, whose
kernels' machine code the options leave alone (``benchmarks/route_sass_diff_cpu.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.config import MoEConfig


def renorm_log_eps(eps: float, dtype: torch.dtype = torch.float32) -> float:
    """log(eps) rounded to float32 (float64: exact), the constant ``_eps_factor`` / ``_clamp_factor`` (the logits'
    dtype) and the fused kernels (RENORM_LOG_EPS / _CLAMP, float32) read: a float64 router's weights are float64's.
    Python floats only: traced, a tensor's ``.item()`` broke the graph, and ``torch.compiler.assume_constant_result``
    would import dynamo with moekit. The float32 rounding is to nearest, ties to even, on the 24-bit significand
    (log(eps) is 0 at eps = 1, else a normal float32)."""
    log = math.log(eps)  # float64, as torch's float64 log
    if torch.promote_types(dtype, torch.float32) == torch.float64:
        return log
    significand, exponent = math.frexp(log)
    return math.ldexp(round(significand * 2.0**24) / 2.0**24, exponent)


# option -> the values the kernels compute (an option off its default with another value: ``route`` only)
COMPUTED = {"router_logit_softcap": None, "correction_bias_on": ("scores", "logits"),
            "group_score": ("auto", "max", "top2_sum"), "dropped_group_fill": ("-inf", "zero"),
            "shared_expert_combine": ("sum", "average"), "renorm_clamp": None}  # None: every value

def computed_options(config: MoEConfig) -> bool:
    """True when every changed router option of ``config`` is one the kernels compute (every scoring is: softmax,
    sigmoid and DeepSeek-V4's sqrtsoftplus)."""
    return all(
        name in COMPUTED and (COMPUTED[name] is None or value in COMPUTED[name])
        for name, value in config.changed_router_options().items())


@dataclass(frozen=True)
class RouterMath:
    """The router options the kernel computes (``MoEConfig.changed_router_options``), as a plan takes them; the
    defaults: none (the kernels of session 33, the same machine code: ``benchmarks/route_sass_diff_cpu.py``)."""

    softcap: float = 0.0  # router_logit_softcap c: logits -> c * tanh(logits / c)
    bias_on_logits: bool = False  # correction_bias_on="logits": the choice is logits (+ bias), not scores
    group_score: str = "auto"  # "auto" (top-2 sum with a bias, else max), "max", "top2_sum"
    fill_zero: bool = False  # dropped_group_fill="zero"
    shared_weight: float = 1.0  # the appended shared slots' weight factor (0.5: shared_expert_combine="average")
    sqrt_softplus: bool = False  # scoring="sqrtsoftplus" (DeepSeek-V4): sqrt(softplus(logits)) in place of the sigmoid
    renorm_eps: float = 0.0  # MoEConfig.renorm_eps: the renormalised weights times S / (S + eps) (route's _eps_factor)
    renorm_clamp: float = 0.0  # MoEConfig.renorm_clamp c: times min(1, S / c), ERNIE-4.5's (route's _clamp_factor)

    @staticmethod
    def of(config: MoEConfig) -> "RouterMath":
        return RouterMath(float(config.router_logit_softcap), config.correction_bias_on == "logits",
                          config.group_score, config.dropped_group_fill == "zero", config.shared_weight,
                          config.scoring == "sqrtsoftplus", float(config.renorm_eps), float(config.renorm_clamp))

    def constexprs(self) -> dict:
        """The kernels' option constexprs; SOFTCAP_INV is the fp32 reciprocal torch's CUDA division by a Python
        scalar multiplies with (1.0f / float(c)); RENORM_LOG_EPS / RENORM_LOG_CLAMP route's float32 log(eps) / log(c)
        (``renorm_log_eps``), each left out at 0: the kernel's default None compiles no code for it (the kernels of
        session 48)."""
        inv = (1.0 / torch.tensor(self.softcap, dtype=torch.float32)).item() if self.softcap else 0.0
        eps = dict(RENORM_LOG_EPS=renorm_log_eps(self.renorm_eps)) if self.renorm_eps else {}
        if self.renorm_clamp:
            eps.update(RENORM_LOG_CLAMP=renorm_log_eps(self.renorm_clamp))
        return dict(SOFTCAP=self.softcap, SOFTCAP_INV=inv, BIAS_ON_LOGITS=self.bias_on_logits,
                    FILL_ZERO=self.fill_zero, SHARED_SCALE=self.shared_weight, SQRT_SOFTPLUS=self.sqrt_softplus, **eps)
