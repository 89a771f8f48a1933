"""``moekit analyze --offload``: the decode step with host-resident experts (``moekit.analysis.offload``)."""

from __future__ import annotations

from dataclasses import asdict

from moekit.analysis.offload import OffloadCost, offload_cost
from moekit.cli._args import UsageError

DEFAULT_LINK_GBPS = 25.0  # a PCIe 4.0 x16 host link's practical pinned copy rate


def add_arguments(p) -> None:
    g = p.add_argument_group("offload (host-resident experts behind a GPU expert cache)")
    g.add_argument("--offload", action="store_true", help="add the offloaded decode step's prediction")
    g.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help=f"host -> GPU copy rate, GB/s (default {DEFAULT_LINK_GBPS:g}: PCIe 4.0 x16, pinned copies)")
    g.add_argument("--cache-experts", type=int,
                   help="GPU expert slots for the whole model (default: half of all routed experts)")
    g.add_argument("--hit-rate", type=float,
                   help="measured cache hit rate in [0, 1] (e.g. from `moekit simulate cache`); default C / (E x "
                        "layers)")
    g.add_argument("--cpu-tflops", type=float, help="the CPU's expert rate, TFLOP/s: adds the misses-on-CPU column")
    g.add_argument("--cpu-gbps", type=float, help="the CPU path's weight streaming rate, GB/s (bench --offload: expert "
                   "bytes / cpu_expert_us): adds the misses-on-CPU column")
    g.add_argument("--cpu-step-us", type=float, default=0.0,
                   help="the CPU path's fixed price per layer forward with CPU misses, µs (bench --offload's "
                        "cpu_step_us)")


def check_offload_flags(args) -> None:
    """An offload setting given without ``--offload`` would change nothing, silently: refuse it, naming it."""
    defaults = {"link_gbps": DEFAULT_LINK_GBPS, "cache_experts": None, "hit_rate": None, "cpu_tflops": None,
                "cpu_gbps": None, "cpu_step_us": 0.0}  # as add_arguments declares them
    given = [f"--{name.replace('_', '-')}" for name, default in defaults.items() if getattr(args, name) != default]
    if given and not args.offload:
        raise UsageError(f"{', '.join(given)}: settings of the offload prediction, which only --offload adds; "
                         "add --offload (without it they change nothing)")


def offload_rows(args, cfg, fmt, gpu) -> list[OffloadCost]:
    """One row per batch of the sweep; a UsageError naming the flag for a bad value."""
    if not 0 < args.link_gbps < float("inf"):
        raise UsageError(f"--link-gbps must be positive and finite, got {args.link_gbps}")
    if args.hit_rate is not None and not 0.0 <= args.hit_rate <= 1.0:
        raise UsageError(f"--hit-rate must be in [0, 1], got {args.hit_rate}")
    if args.cpu_tflops is not None and not 0 < args.cpu_tflops < float("inf"):
        raise UsageError(f"--cpu-tflops must be positive and finite, got {args.cpu_tflops}")
    if args.cpu_gbps is not None and not 0 < args.cpu_gbps < float("inf"):
        raise UsageError(f"--cpu-gbps must be positive and finite, got {args.cpu_gbps}")
    if not 0 <= args.cpu_step_us < float("inf"):
        raise UsageError(f"--cpu-step-us must be >= 0 and finite, got {args.cpu_step_us}")
    total = cfg.num_experts * (cfg.num_moe_layers or 1)
    cache = total // 2 if args.cache_experts is None else args.cache_experts
    if not 0 <= cache <= total:
        raise UsageError(f"--cache-experts must be in [0, {total}] (E x MoE layers), got {cache}")
    cpu = None if args.cpu_tflops is None else args.cpu_tflops * 1e12
    return [offload_cost(cfg, b, fmt, gpu, link_bytes_s=args.link_gbps * 1e9, cache_experts=cache,
                         hit_rate=args.hit_rate, cpu_flops=cpu,
                         cpu_read_bytes_s=None if args.cpu_gbps is None else args.cpu_gbps * 1e9,
                         cpu_step_s=args.cpu_step_us * 1e-6) for b in args.batches]


def offload_to_json(rows: list[OffloadCost]) -> list[dict]:
    return [asdict(r) for r in rows]


def offload_table(rows: list[OffloadCost]):
    from rich.table import Table

    t = Table(title="Offloaded decode step: misses fetched over the host link (or computed on the CPU)")
    for col in ("batch", "touched/layer", "hit rate", "misses/layer", "GPU ms/layer", "link ms/layer",
                "step ms (fetch)", "step ms (CPU)", "tok/s (fetch)"):
        t.add_column(col, justify="right")
    for r in rows:
        cpu = "-" if r.step_time_cpu_s is None else f"{1e3 * r.step_time_cpu_s:.2f}"
        t.add_row(str(r.batch), f"{r.experts_touched:.1f}", f"{r.hit_rate:.2f}", f"{r.missed_experts:.1f}",
                  f"{1e3 * r.gpu_time_s:.3f}", f"{1e3 * r.link_time_s:.3f}", f"{1e3 * r.step_time_s:.2f}", cpu,
                  f"{r.batch / r.step_time_s:.1f}")
    return t
