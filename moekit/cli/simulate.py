"""``moekit simulate``: one simulator run (summary, ASCII histogram, --json, --plot), or an exercise."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from moekit.sim import BALANCE_METHODS, SimParams, simulate
from moekit.sim.exercises import exercise1, exercise2, exercise3
from moekit.sim.report import summary

_DEFAULTS = SimParams()


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="routing / load-balancing simulator and the lesson's exercises")
    p.add_argument("--experts", type=int, default=_DEFAULTS.experts)
    p.add_argument("--top-k", type=int, default=_DEFAULTS.top_k)
    p.add_argument("--tokens", type=int, default=_DEFAULTS.tokens)
    p.add_argument("--capacity-factor", type=float, default=_DEFAULTS.capacity_factor)
    p.add_argument("--skew", type=float, default=_DEFAULTS.skew, help="router skew in [0, 1] (moekit.sim.router)")
    p.add_argument("--balance", choices=BALANCE_METHODS, default=_DEFAULTS.balance)
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--gpus", type=int, default=_DEFAULTS.gpus)
    p.add_argument("--spare-slots", type=int, default=_DEFAULTS.spare_slots, help="EPLB replica slots")
    p.add_argument("--aux-steps", type=int, default=_DEFAULTS.aux_steps)
    p.add_argument("--bias-batches", type=int, default=_DEFAULTS.bias_batches)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="PNG", help="save a figure")
    p.set_defaults(func=_run)
    sub = p.add_subparsers(dest="sim_command", metavar="exercise")
    ex = sub.add_parser("exercise", help="run exercise 1 (sparsity vs batch), 2 (capacity vs quality) or 3 (EP)")
    ex.add_argument("number", type=int, choices=(1, 2, 3))
    ex.add_argument("--json", action="store_true", help="print the result as JSON")
    ex.add_argument("--plot", metavar="PNG", help="save a figure")
    ex.set_defaults(func=_run_exercise)


def _run(args: argparse.Namespace) -> int:
    try:
        params = SimParams(
            experts=args.experts, top_k=args.top_k, tokens=args.tokens, capacity_factor=args.capacity_factor,
            skew=args.skew, balance=args.balance, seed=args.seed, gpus=args.gpus, spare_slots=args.spare_slots,
            aux_steps=args.aux_steps, bias_batches=args.bias_batches,
        )
    except ValueError as e:
        print(f"moekit simulate: error: {e}", file=sys.stderr)
        return 2
    result = simulate(params)
    print(json.dumps(result.to_dict(), indent=1) if args.json else summary(result))
    if args.plot:
        from moekit.sim.plots import plot_run

        plot_run(result, args.plot)
    return 0


_EXERCISES = {1: exercise1, 2: exercise2, 3: exercise3}


def _run_exercise(args: argparse.Namespace) -> int:
    result = _EXERCISES[args.number]()
    print(json.dumps(asdict(result)) if args.json else _ANSWERS[args.number](result))
    if args.plot:
        from moekit.sim import plots

        getattr(plots, f"plot_exercise{args.number}")(result, args.plot)
    return 0


def _answer1(ex) -> str:
    lines = [f"Exercise 1: E={ex.experts}, top-{ex.top_k}; first batch whose step touches > {ex.threshold:.0%} of experts",
             f"  uniform prediction: B = {ex.predicted_first_over} (B_0.9 = ln 0.1 / ln(1 - k/E) = {ex.predicted_b:.1f})"]
    for c in ex.curves:
        at = f"B = {c.first_over}" if c.first_over else f"never up to B = {c.batches[-1]}"
        lines.append(f"  simulated, skew {c.skew}: {at} (fraction at B={c.batches[-1]}: {c.simulated[-1]:.2f})")
    return "\n".join(lines)


def _answer2(ex) -> str:
    lines = [f"Exercise 2: MoE layer, {ex.tokens} tokens, E={ex.experts}, top-{ex.top_k}; capacity dropping vs dropless"]
    for c in ex.curves:
        lines.append(f"  skew {c.skew}: drops at capacity factor <= {c.last_with_drops}; "
                     f"output error > {ex.tolerance:.0%} at capacity factor <= {c.last_over_tolerance}")
        lines += [f"    cf {p.capacity_factor:5.2f}: drop rate {100 * p.drop_rate:5.1f}%  "
                  f"relative error {100 * p.relative_error:6.2f}%" for p in c.points]
    return "\n".join(lines)


def _answer3(ex) -> str:
    lines = [f"Exercise 3: {ex.experts} experts on {ex.gpus} GPUs, {ex.tokens} tokens, top-{ex.top_k}",
             f"  a {ex.target_imbalance:g}x imbalance (max = {ex.target_imbalance:g}·mean) loses "
             f"{100 * ex.analytic_throughput_lost:.0f}% of the throughput: the step waits for the busiest GPU"]
    if ex.at_target is None:
        lines.append(f"  no skew in the sweep reached {ex.target_imbalance:g}x with the contiguous placement")
        return "\n".join(lines)
    lines.append(f"  first skew reaching it: {ex.at_target.skew} ({ex.at_target.ep.cost_model})")
    for r in ex.at_target.ep.placements:
        lines.append(f"    {r.name:11s} step (max) {r.step_time_us:8.1f} us  mean {r.balanced_time_us:8.1f} us  "
                     f"imbalance {r.imbalance:4.2f}x  throughput lost {100 * r.throughput_lost:5.1f}%")
    lines.append(f"  EPLB with {ex.spare_slots} replicas: {ex.at_target.ep.replication_gain:.2f}x the contiguous throughput")
    return "\n".join(lines)


_ANSWERS = {1: _answer1, 2: _answer2, 3: _answer3}
