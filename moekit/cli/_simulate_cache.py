"""``moekit simulate cache``: the expert-cache what-if over a simulated decode stream (``moekit.sim.cache``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from moekit.cli._args import DefaultsHelpFormatter, ListOption, UsageError, fraction_arg, positive_int
from moekit.offload import POLICIES
from moekit.sim.cache import cache_what_if, decode_trace


def _policy(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"expected one of {POLICIES}, got {text!r}")
    return text


def register(sub) -> None:
    p = sub.add_parser("cache", description="Hit rate of a GPU expert cache by policy, cache size and prefetch, "
                       "over a decode stream of synthetic routers (one per layer).",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--experts", type=positive_int, default=64, help="E, routed experts per layer")
    p.add_argument("--top-k", type=positive_int, default=6, help="k, experts per token")
    p.add_argument("--layers", type=positive_int, default=4, help="MoE layers sharing the cache")
    p.add_argument("--tokens", type=positive_int, default=1, help="tokens per decode step (the batch)")
    p.add_argument("--steps", type=positive_int, default=100, help="decode steps replayed")
    p.add_argument("--skew", type=float, default=0.6, help="router skew in [0, 1] (as `moekit simulate`)")
    p.add_argument("--drift", type=float, default=0.5,
                   help="how far a token's input moves per layer (0: the router prediction is exact)")
    p.add_argument("--fractions", action=ListOption, item=fraction_arg, default=[0.25, 0.5, 0.75],
                   help="cache sizes as fractions of E x layers")
    p.add_argument("--policies", action=ListOption, item=_policy, default=list(POLICIES), help="eviction policies")
    p.add_argument("--seed", type=int, default=0, help="seed of the routers and the tokens")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.top_k > args.experts:
        raise UsageError(f"--top-k must be <= --experts ({args.experts}), got {args.top_k}")
    if not 0.0 <= args.skew <= 1.0:
        raise UsageError(f"--skew must be in [0, 1], got {args.skew}")
    if not args.drift >= 0.0:
        raise UsageError(f"--drift must be >= 0, got {args.drift}")
    trace = decode_trace(args.experts, args.top_k, args.layers, args.steps, args.tokens, args.skew, args.drift,
                         args.seed)
    rows = cache_what_if(trace, args.fractions, args.policies)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(f"Expert cache what-if: E={args.experts}, top-{args.top_k}, {args.layers} layers, {args.tokens} token(s) "
          f"per step, {args.steps} steps, skew {args.skew}, drift {args.drift}")
    print(f"{'policy':>6} {'slots':>6} {'of all':>7} {'prefetch':>9} {'hit rate':>9} {'fetches/step':>13} "
          f"{'prefetch acc':>13}")
    for r in rows:
        print(f"{r.policy:>6} {r.cache_experts:>6} {r.cache_fraction:>7.0%} {r.prefetch:>9} {r.hit_rate:>9.3f} "
              f"{r.fetched_per_step:>13.2f} {r.prefetch_accuracy:>13.2f}")
    return 0
