"""The work budget: what one ``simulate`` run costs, predicted before it starts, so the server can refuse
a run that would take more than about ``BUDGET_S`` seconds of one CPU core.

    seconds ≈ BASE_S                                       router (a QR of E x E), parameters, report
            + ROUTE_S · E · (routed tokens)                  moekit.route's stable sort of [M, E] scores
            + steps · (STEP_S + BATCH_TOKENS · E · SCORE_S)  balancing: one routed batch per step
            + EPLB_S · (E + spare_slots)^2.5 · (M·k)^0.4     the EP what-if's EPLB placement

Shapes: E = experts (W, the router's columns, for a served config's router: ``check_budget(width=W)``), M = tokens,
k = top_k. Constants measured on one core (``torch.set_num_threads(1)``)
of the development machine (2-core x86 VM, torch 2.13 CPU) in its slower hours (its speed varies by
a third) and rounded up. The EPLB term is the largest
cost seen over skews 0-0.9, k in 1-16, 2-128 GPUs (skew 0 with 3-12 GPUs is the slowest: its greedy
swap refinement finds many small swaps); it is the bound, not the typical cost, which is 5-20x lower.

The server calls ``check_budget``; the library and the CLI run whatever ``SimParams`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.sim.balance import BATCH_TOKENS
from moekit.sim.params import LIMITS, SimParams
from moekit.sim.run import TOUCH_BATCHES, TOUCH_TRIALS

BUDGET_S = 1.8  # predicted; the slowest accepted runs sampled took 1.5-1.9 s on the development machine
BASE_S = 0.1  # QR of a 512 x 512 matrix: 0.08 s
ROUTE_S = 210e-9  # per token and expert routed (E = 512: 20-27 ms for 256 tokens)
STEP_S = {"aux-loss": (1.5e-3, 310e-9), "bias": (0.6e-3, 220e-9)}  # (per step, per token·expert of its batch)
EPLB_S = 6.5e-9  # worst measured: 6.1 s at E + spare = 1024, M·k = 8192 (3-12 GPUs, skew 0)
STEPS_PARAM = {"aux-loss": "aux_steps", "bias": "bias_batches"}


@dataclass(eq=False)
class OverBudgetError(ValueError):
    """A run predicted to cost more than ``BUDGET_S``; names the parameter to lower and how far."""

    message: str
    parameter: str  # the first setting to lower: balancing steps, then spare_slots, tokens, experts
    largest: int  # the largest value of ``parameter`` that fits (with any later changes the message names)

    def __str__(self) -> str:
        return self.message


def predicted_seconds(params: SimParams, width: int | None = None) -> float:
    """Predicted seconds of one core for ``simulate(params)`` (an upper estimate, see the module doc); ``width``: the
    router's columns W of a config's router (E + Z, E + S), None: E."""
    return _seconds(params.to_dict() | {"width": width})


def _seconds(p: dict) -> float:
    balancing = p["balance"] != "none"
    width = p.get("width") or p["experts"]  # the columns each routed token scores
    routed_tokens = p["tokens"] * (2 if balancing else 1) + TOUCH_TRIALS * sum(TOUCH_BATCHES)  # eval (+ before)
    seconds = BASE_S * max(width / 512, 1) ** 3 + ROUTE_S * width * routed_tokens  # the QR grows as W^3
    if balancing:
        per_step, per_score = STEP_S[p["balance"]]
        seconds += p[STEPS_PARAM[p["balance"]]] * (per_step + BATCH_TOKENS * width * per_score)
    slots, assignments = p["experts"] + p["spare_slots"], p["tokens"] * p["top_k"]
    return seconds + EPLB_S * slots**2.5 * assignments**0.4


def check_budget(params: SimParams, width: int | None = None) -> None:
    """Raise ``OverBudgetError`` when ``params`` is predicted to cost more than ``BUDGET_S``; its message
    says which settings to lower and to what (the first candidate that can fit alone, else several). ``width``:
    a served config's router columns W (its E and k are fixed then: never a candidate)."""
    seconds = predicted_seconds(params, width)
    if seconds <= BUDGET_S:
        return
    p = params.to_dict() | {"width": width}
    lowered = dict(p)
    changes: dict[str, int] = {}  # name -> largest value that fits, given the changes before it
    for name in _candidates(params, width):
        largest = _largest_fitting(lowered, name)
        if largest is not None:
            changes[name] = largest
            break
        if _lowest(lowered, name) < lowered[name]:  # not enough alone: lower it all the way
            lowered[name] = changes[name] = _lowest(lowered, name)
    steps = " and ".join(f"{n} to at most {v} (got {p[n]})" for n, v in changes.items())
    alone = [f"{n} to at most {v}" for n in _candidates(params, width) if len(changes) == 1 and n not in changes
             if (v := _largest_fitting(p, n)) is not None]
    name, largest = next(iter(changes.items()))
    raise OverBudgetError(f"this run is over the work budget: about {seconds:.1f} s of CPU predicted, "
                          f"{BUDGET_S:g} s allowed; lower {steps}" + "".join(f", or {a}" for a in alone),
                          name, largest)


def _candidates(params: SimParams, width: int | None = None) -> list[str]:
    steps = [STEPS_PARAM[params.balance]] if params.balance != "none" else []
    return [*steps, "spare_slots", "tokens", *(["experts"] if width is None else [])]


def _lowest(p: dict, name: str) -> int:
    """The smallest valid value of ``name`` given the other settings."""
    lo = int(LIMITS[name][0])
    if name == "experts":  # top_k <= experts, gpus <= experts, spare_slots <= experts·(gpus-1)
        lo = max(lo, p["top_k"], p["gpus"], -(-p["spare_slots"] // max(p["gpus"] - 1, 1)))
    return lo


def _largest_fitting(p: dict, name: str) -> int | None:
    """The largest value of ``name`` below its current one that brings the run within budget (the cost
    grows with each candidate), or None when even its smallest valid value does not."""
    lo, hi = _lowest(p, name), p[name] - 1
    if hi < lo or _seconds({**p, name: lo}) > BUDGET_S:
        return None
    while lo < hi:  # invariant: lo fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _seconds({**p, name: mid}) <= BUDGET_S else (lo, mid - 1)
    return lo
