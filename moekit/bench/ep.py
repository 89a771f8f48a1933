"""Expert-parallel benchmark: ``torchrun --standalone --nproc-per-node 2 -m moekit.bench.ep``.

    [Route] -> [Dispatch] -> [Experts] -> [Combine], each timed alone, beside the raw ``all_to_all_single``
    of the same bytes and the single-GPU ``MoE`` doing the same per-GPU work.

Per dispatch (``exact``: counts all-to-all and one host sync; ``padded``: ``max_tokens_per_rank`` = M
rows to every rank, no sync) and M (tokens per rank) it reports, as the maximum over ranks of each
rank's median:
- ``route_us``: gate + routing of the local tokens;
- ``dispatch_us``: replica choice, (exact: counts all-to-all, the host sync,) payload all-to-all;
- ``experts_us``: the local experts over the received rows; ``experts_half_us``: over the rows of the
  first M/2 tokens (2 x it / experts_us: what splitting the tokens in two chunks costs the experts);
- ``combine_us``: the all-to-all back and the per-token sum;
- ``layer_us``: the whole ``EPMoE.forward``; ``layer_graph_us`` (padded, CUDA): the same replayed as
  one CUDA graph, NCCL all-to-alls included;
- ``raw_dispatch_us`` / ``raw_combine_us``: one ``all_to_all_single`` with exactly the payload and
  split sizes of the dispatch / combine, measured in the same run;
- ``single_gpu_us``: ``MoE`` with E/W experts and the same top-k on M tokens on one GPU (the same
  assignments per GPU when routing is uniform), i.e. the layer without the network;
- ``target_us`` = 1.2 x (experts_us + raw_dispatch_us + raw_combine_us), and whether
  ``best_layer_us`` (the better of layer_us and layer_graph_us) met it;
- ``overlap``: chunks of the micro-batch overlap (``EPMoE(overlap=C)``; 1 = none). Rows with C > 1
  re-time only the layer (the phases are those of the C = 1 row) and carry ``overlap_goal_us`` =
  1.05 x max(experts_us, raw_dispatch_us + raw_combine_us): the layer with the all-to-alls hidden
  under the experts (or the experts under them), and whether ``best_layer_us`` met it.

Default shapes: DeepSeek-V3's routed experts (E=256, N=2048, K=7168, k=8, sigmoid grouped routing,
bf16), 128 experts per GPU on 2 GPUs, M in 128/1024/4096/16384. ``--tiny`` runs small fp32 shapes on
the CPU with gloo (a smoke test). ``--check`` first compares EPMoE with the single-process MoE (fp32).
Rank 0 prints a table and writes the JSON document to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from moekit.bench.ep_profile import as_json, print_profiles, profile_phases
from moekit.bench.run import commit_id, device_name
from moekit.bench.timing import time_calls
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.parallel.layer import EPMoE
from moekit.parallel.eplb import eplb_placement
from moekit.parallel.placement import contiguous_placement, round_robin_placement

DEEPSEEK_V3_ROUTED = MoEConfig(
    hidden_size=7168, moe_intermediate_size=2048, num_experts=256, top_k=8, scoring="sigmoid", renormalize=True,
    routed_scaling_factor=2.5, n_group=8, topk_group=4, use_correction_bias=True,
)
TINY = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16, top_k=4)
GPU_TOKENS = (128, 1024, 4096, 16384)
TINY_TOKENS = (8, 64)


def _setup(timeout_s: float) -> tuple[torch.device, int, int]:
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size()


def _progress(message: str) -> None:
    """One line from rank 0 as each step ends, flushed, so a run cut short still shows how far it got."""
    if dist.get_rank() == 0:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@torch.no_grad()
def check(device: torch.device, world_size: int, backend: str) -> dict[str, float]:
    """EPMoE vs the single-process MoE in fp32 on this group (NCCL or gloo): max relative error per case."""
    config = MoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16, top_k=4, scoring="sigmoid",
                       n_group=4, topk_group=2, use_correction_bias=True, shared_expert_intermediate_size=128)
    torch.manual_seed(0)
    moe = MoE(config, backend=backend, device=device)
    moe.e_score_correction_bias[:3] = 0.3  # skewed: experts 0-2 hot
    rank = dist.get_rank()
    sizes = [0 if r == world_size - 1 else 37 + 11 * r for r in range(world_size)]  # uneven, last rank empty
    x = torch.randn(sum(sizes), config.hidden_size, device=device)
    ref = moe(x)
    start = sum(sizes[:rank])
    counts = moe(x, return_stats=True).stats.counts
    placements = {
        "contiguous": contiguous_placement(16, world_size),
        "round_robin": round_robin_placement(16, world_size),
        "eplb_replicas": eplb_placement(counts, world_size, num_redundant=world_size),
    }
    mine = ref[start : start + sizes[rank]]
    x_local = x[start : start + sizes[rank]]

    def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
        err = float((out - want).abs().max() / ref.abs().max()) if want.numel() else 0.0
        return _max_over_ranks(err, device)

    def after_rebalance() -> torch.Tensor:  # EPLB end to end: track the load, rebalance with replicas, run again
        ep = EPMoE.from_moe(moe)
        ep(x_local)
        ep.rebalance(num_redundant=world_size)
        return ep(x_local)

    cases = {name: (lambda p=placement: EPMoE.from_moe(moe, p)(x_local)) for name, placement in placements.items()}
    cases["after_rebalance"] = after_rebalance
    cases["overlap2_exact"] = lambda: EPMoE.from_moe(moe, overlap=2)(x_local)
    cases["overlap2_padded"] = lambda: EPMoE.from_moe(moe, overlap=2, max_tokens_per_rank=max(sizes))(x_local)
    errors = {}
    for name, run_case in cases.items():
        _progress(f"check {name} ...")
        errors[name] = rel_err(run_case(), mine)
        _progress(f"check {name}: {errors[name]:.1e}")
    # Every token on rank 0's experts (contiguous: experts 0-3 are rank 0's, and group 0 is theirs).
    _progress("check all_on_rank0 ...")
    moe.e_score_correction_bias[:4] = 10.0
    errors["all_on_rank0"] = rel_err(EPMoE.from_moe(moe)(x_local), moe(x)[start : start + sizes[rank]])
    _progress("check empty_everywhere ...")
    empty = EPMoE.from_moe(moe)(x_local[:0])
    errors["empty_everywhere"] = 0.0 if empty.shape == (0, config.hidden_size) else float("inf")
    return errors


def _bench_m(ep: EPMoE, single: MoE, num_tokens: int, device: torch.device, dtype: torch.dtype, reps: int,
             profile_overlaps: list[int] | None = None) -> dict:
    """One row of the table: every phase at M = num_tokens tokens per rank; first, when
    ``profile_overlaps`` is given, profiled (the layer also with those chunk counts)."""
    x = torch.randn(num_tokens, ep.config.hidden_size, device=device, dtype=dtype)
    routing = ep.route_tokens(x).routing
    ids, weights = routing.topk_ids, routing.topk_weights
    sent = ep.dispatch(x, ids, weights)
    y = ep.run_local_experts(sent)
    group = ep.group
    # The raw collectives: the very payload shape and split sizes the layer sends.
    row_bytes = ep.config.hidden_size * dtype.itemsize + 8 * ids.shape[1]
    payload = torch.empty(sum(sent.send_splits), row_bytes, dtype=torch.uint8, device=device)
    received = torch.empty(sum(sent.recv_splits), row_bytes, dtype=torch.uint8, device=device)
    back = torch.empty(sum(sent.send_splits), ep.config.hidden_size, dtype=dtype, device=device)
    raw_dispatch = lambda: dist.all_to_all_single(received, payload, sent.recv_splits, sent.send_splits,  # noqa: E731
                                                  group=group)
    raw_combine = lambda: dist.all_to_all_single(back, y, sent.send_splits, sent.recv_splits, group=group)  # noqa: E731
    x_single = torch.randn(num_tokens, single.config.hidden_size, device=device, dtype=dtype)
    half = num_tokens // 2  # the experts over half the tokens: what a 2-chunk overlap pays per chunk
    sent_half = ep.dispatch(x[:half], ids[:half], weights[:half])

    phases = {
        "route_us": lambda: ep.route_tokens(x),
        "dispatch_us": lambda: ep.dispatch(x, ids, weights),
        "experts_us": lambda: ep.run_local_experts(sent),
        "experts_half_us": lambda: ep.run_local_experts(sent_half),
        "combine_us": lambda: ep.combine(y, sent),
        "layer_us": lambda: ep(x),
        "raw_dispatch_us": raw_dispatch,
        "raw_combine_us": raw_combine,
    }
    row = {"dispatch": "exact" if ep.max_tokens_per_rank is None else "padded", "M": num_tokens, "overlap": 1}
    if profile_overlaps is not None:
        row["profile"] = _profile(ep, phases, device, f"{row['dispatch']} M={num_tokens}", profile_overlaps)
    for name, fn in phases.items():
        dist.barrier()
        # A fixed repetition count: time_calls' budget-based count differs per rank, and ranks that
        # run different numbers of collectives deadlock.
        row[name] = _max_over_ranks(time_calls([fn], device, min_reps=reps, max_reps=reps), device)
    dist.barrier()
    row |= _graph_time(ep, x, device, reps)
    row["single_gpu_us"] = _max_over_ranks(time_calls([lambda: single(x_single)], device), device)
    sent_bytes = payload.numel()
    row["dispatch_bytes_per_rank"] = _max_over_ranks(float(sent_bytes), device)
    row["raw_dispatch_GBps_per_rank"] = row["dispatch_bytes_per_rank"] / row["raw_dispatch_us"] / 1e3
    row["rows_received_max"] = _max_over_ranks(float(sum(sent.recv_splits)), device)
    row["target_us"] = 1.2 * (row["experts_us"] + row["raw_dispatch_us"] + row["raw_combine_us"])
    row["best_layer_us"] = min(v for v in (row["layer_us"], row.get("layer_graph_us")) if v is not None)
    row["target_met"] = row["best_layer_us"] <= row["target_us"]
    return row


def _graph_time(ep: EPMoE, x: torch.Tensor, device: torch.device, reps: int) -> dict:
    """``layer_graph_us`` of the padded forward (no host sync: the whole layer, all-to-alls included,
    replayed as one CUDA graph); nothing for the exact dispatch or off CUDA."""
    if ep.max_tokens_per_rank is None or device.type != "cuda":
        return {}
    try:
        us = _max_over_ranks(time_calls([lambda: ep(x)], device, graph=True, min_reps=reps, max_reps=reps), device)
        out = {"layer_graph_us": us}
    except RuntimeError as err:  # recorded, not fatal: the eager numbers stand on their own
        out = {"layer_graph_us": None, "graph_error": str(err).splitlines()[0][:200]}
    dist.barrier()
    return out


def _overlap_row(ep: EPMoE, base: dict, chunks: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """``base`` (the C = 1 row at the same M) with the layer re-timed at ``chunks`` chunks."""
    x = torch.randn(base["M"], ep.config.hidden_size, device=device, dtype=dtype)
    ep.overlap = chunks
    try:
        row = {k: v for k, v in base.items() if k not in ("layer_graph_us", "graph_error")} | {"overlap": chunks}
        dist.barrier()
        row["layer_us"] = _max_over_ranks(time_calls([lambda: ep(x)], device, min_reps=reps, max_reps=reps), device)
        dist.barrier()
        row |= _graph_time(ep, x, device, reps)
    finally:
        ep.overlap = 1
    row["best_layer_us"] = min(v for v in (row["layer_us"], row.get("layer_graph_us")) if v is not None)
    row["target_met"] = row["best_layer_us"] <= row["target_us"]
    row["overlap_goal_us"] = 1.05 * max(row["experts_us"], row["raw_dispatch_us"] + row["raw_combine_us"])
    row["overlap_goal_met"] = row["best_layer_us"] <= row["overlap_goal_us"]
    return row


def _profile(ep: EPMoE, phases: dict, device: torch.device, title: str, overlaps: list[int]) -> dict:
    """Launches, host syncs, host and device µs per call of each phase (``moekit.bench.ep_profile``),
    and of the layer with every overlap chunk count the run times."""
    wanted = {k.removesuffix("_us"): fn for k, fn in phases.items() if not k.startswith("raw_")}
    profiles = profile_phases(wanted, device)
    for chunks in overlaps:
        ep.overlap = chunks
        try:
            profiles |= profile_phases({f"layer_c{chunks}": phases["layer_us"]}, device)
        finally:
            ep.overlap = 1
    if dist.get_rank() == 0:
        print_profiles(title, profiles)
    return as_json(profiles)


def _print_table(rows: list[dict]) -> None:
    cols = ["dispatch", "M", "overlap", "route_us", "dispatch_us", "experts_us", "experts_half_us", "combine_us",
            "layer_us", "layer_graph_us",
            "raw_dispatch_us", "raw_combine_us", "single_gpu_us", "target_us", "target_met", "overlap_goal_us",
            "overlap_goal_met"]
    print(" ".join(f"{c.removesuffix('_us'):>11}" for c in cols))
    for r in rows:
        cells = [r.get(c, "-") for c in cols]
        print(" ".join(f"{v:>11.1f}" if isinstance(v, float) else f"{v!s:>11}" for v in cells))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (apart from ``main``, so the docs' test parses its lines without running)."""
    parser = argparse.ArgumentParser(prog="python -m moekit.bench.ep",
                                     description=__doc__.split("\n")[0].replace("``", ""))
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="tokens per rank (default 128 1024 4096 16384; tiny: 8 64)")
    parser.add_argument("--dispatch", choices=["exact", "padded", "both"], default="both",
                        help="exact: counts all-to-all + one host sync; padded: max_tokens_per_rank rows, no sync "
                        "(default: both)")
    parser.add_argument("--backend", default="auto",
                        help="experts backend (auto, triton, grouped_mm, reference; default auto)")
    parser.add_argument("--tiny", action="store_true", help="small fp32 shapes (CPU smoke test)")
    parser.add_argument("--check", action="store_true", help="first compare EPMoE with the single-process MoE")
    parser.add_argument("--overlap", type=int, nargs="+", default=[1, 2],
                        help="chunk counts of the micro-batch overlap to time (1 = none; always timed; default 1 2)")
    parser.add_argument("--reps", type=int, default=20,
                        help="timed repetitions of each phase (the same on every rank; default 20)")
    parser.add_argument("--out", type=Path, help="JSON results file (rank 0 writes it)")
    parser.add_argument("--pg-timeout", type=float, default=120.0,
                        help="process group timeout in seconds: a collective that waits longer fails instead of "
                        "hanging (default 120)")
    parser.add_argument("--profile", action="store_true",
                        help="profile every phase at every M first: launches, host syncs, host and device us per call")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # else torch's env:// rendezvous traceback
        parser.error("run it under torchrun, which sets RANK and WORLD_SIZE: torchrun --standalone --nproc-per-node 2 "
                     "-m moekit.bench.ep ...")
    device, rank, world_size = _setup(args.pg_timeout)
    try:
        doc = run(device, rank, world_size, args)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def run(device: torch.device, rank: int, world_size: int, args) -> dict:
    tiny = args.tiny or device.type != "cuda"
    config, dtype = (TINY, torch.float32) if tiny else (DEEPSEEK_V3_ROUTED, torch.bfloat16)
    tokens = args.tokens or (TINY_TOKENS if tiny else GPU_TOKENS)
    doc = {
        "bench": "expert_parallel", "device": device_name(device), "world_size": world_size,
        "backend": dist.get_backend(), "experts_backend": args.backend, "commit": commit_id(),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "config": {"E": config.num_experts, "N": config.moe_intermediate_size, "K": config.hidden_size,
                   "k": config.top_k, "dtype": str(dtype).removeprefix("torch.")},
    }
    _progress(f"{world_size} ranks on {doc['device']} ({doc['backend']}); config {doc['config']}")
    if args.check:
        doc["check_rel_err"] = check(device, world_size, args.backend)
        if rank == 0:
            print("check (max relative error vs single-process MoE, fp32):", doc["check_rel_err"])
    local = config.num_experts // world_size
    single_config = config.replace(num_experts=local, n_group=1, topk_group=1, use_correction_bias=False)
    single = MoE(single_config, backend=args.backend, dtype=dtype, device=device)
    modes = ["exact", "padded"] if args.dispatch == "both" else [args.dispatch]
    rows = []
    with torch.no_grad():
        for mode in modes:
            torch.manual_seed(0)  # the same gate on every rank; experts differ per rank, which timing does not mind
            ep = EPMoE(config, backend=args.backend, track_load=False, dtype=dtype, device=device,
                       max_tokens_per_rank=max(tokens) if mode == "padded" else None)
            for m in tokens:
                if mode == "padded":
                    # every rank passes m tokens: pad to exactly that (same on all ranks)
                    ep.max_tokens_per_rank = max(m, 1)
                overlaps = sorted(set(args.overlap) - {1}) if args.profile else None
                rows.append(_bench_m(ep, single, m, device, dtype, args.reps, overlaps))
                _progress(f"{mode} M={m}: layer {rows[-1]['best_layer_us']:.1f} us, target {rows[-1]['target_us']:.1f} "
                          f"us")
                base = rows[-1]
                for chunks in sorted(set(args.overlap) - {1}):
                    rows.append(_overlap_row(ep, base, chunks, device, dtype, args.reps))
                    _progress(f"{mode} M={m} overlap {chunks}: layer {rows[-1]['best_layer_us']:.1f} us, "
                              f"goal {rows[-1]['overlap_goal_us']:.1f} us")
            del ep
    doc["rows"] = rows
    if rank == 0:
        _print_table(rows)
        ratios = [r["best_layer_us"] / (r["target_us"] / 1.2) for r in rows if r["overlap"] == 1]
        print("layer / (experts + raw a2a both ways), no overlap:", ", ".join(f"{v:.2f}" for v in ratios),
              f"(median {statistics.median(ratios):.2f}; target <= 1.2)")
        halves = [2 * r["experts_half_us"] / r["experts_us"] for r in rows if r["overlap"] == 1 and r["experts_us"] > 0]
        print("2 x experts(M/2) / experts(M), what token chunks cost the experts:",
              ", ".join(f"{v:.2f}" for v in halves))
        hidden = [r["best_layer_us"] / (r["overlap_goal_us"] / 1.05) for r in rows if r["overlap"] > 1]
        if hidden:
            print("layer / max(experts, raw a2a both ways), overlap:", ", ".join(f"{v:.2f}" for v in hidden),
                  "(goal <= 1.05)")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
