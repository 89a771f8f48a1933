"""``moekit simulate``: one simulator run (summary, ASCII histogram, --json, --plot), or an exercise."""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import asdict

from moekit.cli import COMMANDS, _simulate_cache
from moekit.cli._args import DefaultsHelpFormatter, UsageError, plot_path, save_figure, working
from moekit.cli._model_source import ModelSource, add_source_arguments, simulated_source
from moekit.sim import BALANCE_METHODS, SimParams, simulate
from moekit.sim.exercises import exercise1, exercise2, exercise3
from moekit.sim.report import summary

_DEFAULTS = SimParams()


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help=COMMANDS["simulate"],
                              description="One simulator run: a batch routed by the synthetic router, capacity "
                              "drops, balancing, and the expert-parallel what-if.",
                              formatter_class=DefaultsHelpFormatter)
    p.add_argument("--experts", type=int, help=f"E, routed experts; a model's with --preset / --config "
                   f"(default: {_DEFAULTS.experts})")
    p.add_argument("--top-k", type=int, help=f"k, experts per token; a model's with --preset / --config "
                   f"(default: {_DEFAULTS.top_k})")
    add_source_arguments(p, "a transformers config.json: route with its layer's router (E, k, scoring, groups, "
                            "router options), not the default softmax top-k, and price that model's parameters "
                            "and experts, not Mixtral-8x7B's shapes")
    p.add_argument("--tokens", type=int, default=_DEFAULTS.tokens, help="M, tokens in the batch")
    p.add_argument("--capacity-factor", type=float, default=_DEFAULTS.capacity_factor,
                   help="per-expert capacity = ceil(factor * M * k / E); assignments over it are dropped")
    p.add_argument("--skew", type=float, default=_DEFAULTS.skew,
                   help="router skew in [0, 1]: 0 routes uniformly, 1 sends every token to the same experts")
    p.add_argument("--balance", choices=BALANCE_METHODS, default=_DEFAULTS.balance,
                   help="load balancing: none, an aux-loss-trained router, or DeepSeek's bias updates")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the router and the tokens")
    p.add_argument("--gpus", type=int, help=f"GPUs of the expert-parallel what-if (default: {_DEFAULTS.gpus}, or E "
                   "where the model has fewer experts)")
    p.add_argument("--spare-slots", type=int, help=f"redundant expert slots EPLB may fill with replicas of hot experts "
                   f"(default: {_DEFAULTS.spare_slots}, or E·(gpus-1) where fewer fit)")
    p.add_argument("--aux-steps", type=int, default=_DEFAULTS.aux_steps,
                   help="Adam steps of aux-loss training (with --balance aux-loss)")
    p.add_argument("--bias-batches", type=int, default=_DEFAULTS.bias_batches,
                   help="batches of correction-bias updates (with --balance bias)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="PNG", type=plot_path, help="save a figure to this image file")
    p.set_defaults(func=_run)
    # No help= on the "exercise" parser: argparse would list it a second time under the metavar.
    sub = p.add_subparsers(dest="sim_command", metavar="exercise N",
                           help="instead of one run: exercise 1 (sparsity vs batch), 2 (capacity factor vs "
                           "output quality) or 3 (expert parallelism); or `cache`: the expert-cache what-if")
    ex = sub.add_parser("exercise", description="Answer one of the lesson's three exercises.",
                        formatter_class=DefaultsHelpFormatter)
    ex.add_argument("number", type=int, choices=(1, 2, 3),
                    help="1: sparsity vs batch, 2: capacity factor vs output quality, 3: expert parallelism")
    ex.add_argument("--json", action="store_true", help="print the result as JSON")
    ex.add_argument("--plot", metavar="PNG", type=plot_path, help="save a figure to this image file")
    ex.set_defaults(func=_run_exercise)
    _simulate_cache.register(sub)


_SETTINGS = ("tokens", "capacity_factor", "skew", "balance", "seed", "gpus", "spare_slots", "aux_steps",
             "bias_batches")  # SimParams' fields besides E and k, each its flag's value
# a setting read by one --balance method only: given with another, it was dropped in silence
_BALANCE_SETTINGS = {"aux_steps": "aux-loss", "bias_batches": "bias"}


def _run(args: argparse.Namespace) -> int:
    source = _model(args)  # None: the default router (softmax top-k, renormalised)
    config = None if source is None else source.layer
    shape = {"experts": args.experts, "top_k": args.top_k}
    for name, method in _BALANCE_SETTINGS.items():
        if getattr(args, name) != getattr(_DEFAULTS, name) and args.balance != method:
            raise UsageError(f"--{name.replace('_', '-')} applies to --balance {method}, got --balance {args.balance}")
    if config is not None:
        shape = {"experts": config.num_experts, "top_k": config.top_k}
    settings = {n: getattr(args, n) for n in _SETTINGS} | _ep_defaults(args, shape["experts"] or _DEFAULTS.experts)
    try:
        params = SimParams(**{n: v for n, v in shape.items() if v is not None}, **settings)
    except ValueError as err:
        raise UsageError(_as_flag(str(err), args, source)) from err
    with working(f"simulating {params.tokens} tokens on E={params.experts}, top-{params.top_k}"):
        result = simulate(params, None if source is None else source.hf)  # that model's bill, not Mixtral's
    print(json.dumps(result.to_dict(), indent=1) if args.json else summary(result))
    if args.plot:
        from moekit.sim.plots import plot_run

        save_figure(functools.partial(plot_run, result), args.plot, to_stderr=args.json)
    return 0


def _model(args: argparse.Namespace) -> ModelSource | None:
    """The model of ``--preset`` / ``--config`` (its E and k: --experts / --top-k then refused), or None."""
    source = simulated_source(args)  # a model whose every MoE layer hash-routes: refused
    if source is None:
        return None
    if args.experts is not None or args.top_k is not None:
        layer = source.layer
        raise UsageError(f"--experts / --top-k come from --preset / --config ({source.name}: E={layer.num_experts}, "
                         f"k={layer.top_k}); give one or the other")
    return source


def _ep_defaults(args: argparse.Namespace, experts: int) -> dict:
    """--gpus and --spare-slots where not given: the defaults, or as many as E experts fill (``moekit serve``'s rule:
    a model of 7 experts is not refused for the 8 GPUs nobody asked for)."""
    gpus = min(_DEFAULTS.gpus, experts) if args.gpus is None else args.gpus
    spare = min(_DEFAULTS.spare_slots, experts * (gpus - 1)) if args.spare_slots is None else args.spare_slots
    return {"gpus": gpus, "spare_slots": spare}


def _as_flag(message: str, args: argparse.Namespace, source: ModelSource | None) -> str:
    """SimParams names its fields (``top_k must be ...``); say the flag the user typed (``--top-k``), or, for E and k
    a model gave, the model (``--config PATH: its E=1 ...``)."""
    name = message.split(" ", 1)[0]
    if source is not None and name in ("experts", "top_k"):
        value = source.layer.num_experts if name == "experts" else source.layer.top_k
        flag = "--preset" if args.preset else "--config"
        return f"{flag} {source.name}: its {'E' if name == 'experts' else 'k'}={value} is outside the simulator's " \
               f"range: {message}"
    return f"--{name.replace('_', '-')}{message[len(name):]}" if name in _DEFAULTS.to_dict() else message


_EXERCISES = {1: exercise1, 2: exercise2, 3: exercise3}


def _run_exercise(args: argparse.Namespace) -> int:
    with working(f"exercise {args.number}"):
        result = _EXERCISES[args.number]()
    print(json.dumps(asdict(result)) if args.json else _ANSWERS[args.number](result))
    if args.plot:
        from moekit.sim import plots

        save_figure(functools.partial(getattr(plots, f"plot_exercise{args.number}"), result), args.plot,
                    to_stderr=args.json)
    return 0


def _answer1(ex) -> str:
    lines = [f"Exercise 1: E={ex.experts}, top-{ex.top_k}; first batch whose step touches > {ex.threshold:.0%} of "
             f"experts",
             f"  uniform prediction: B = {ex.predicted_first_over} (B_0.9 = ln 0.1 / ln(1 - k/E) = "
             f"{ex.predicted_b:.1f})"]
    for c in ex.curves:
        at = f"B = {c.first_over}" if c.first_over else f"never up to B = {c.batches[-1]}"
        lines.append(f"  simulated, skew {c.skew}: {at} (fraction at B={c.batches[-1]}: {c.simulated[-1]:.2f})")
    return "\n".join(lines)


def _answer2(ex) -> str:
    lines = [f"Exercise 2: MoE layer, {ex.tokens} tokens, E={ex.experts}, top-{ex.top_k}; capacity dropping vs "
             f"dropless"]
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
        lines.append(f"    {r.name:11s} step (max) {r.step_time_us:8.1f} µs  mean {r.balanced_time_us:8.1f} µs  "
                     f"imbalance {r.imbalance:4.2f}x  throughput lost {100 * r.throughput_lost:5.1f}%")
    lines.append(f"  EPLB with {ex.spare_slots} replicas: {ex.at_target.ep.replication_gain:.2f}x the contiguous "
                 f"throughput")
    return "\n".join(lines)


_ANSWERS = {1: _answer1, 2: _answer2, 3: _answer3}
