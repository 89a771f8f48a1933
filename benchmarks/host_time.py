"""Host time of the Triton experts path on the GPU (issue 13 item 1): what the CPU spends per eager call,
against the GPU time of the same call replayed from a CUDA graph.

    PYTHONPATH=. OUT=/tmp/host python benchmarks/host_time.py [--presets P ...] [--batches 1 8 64 512]
        [--calls 200] [--no-ab] [--no-layer]

For the routed experts of Qwen3-30B-A3B (E=128, N=768, K=2048, k=8), Mixtral-8x7B (E=8, N=14336,
K=4096, k=2) and DeepSeek-V3 (E=256, N=2048, K=7168, k=8) in bf16, at each M (after a throwaway cell: the
first preset at M = 1, since a process's first cell runs slow), under torch.no_grad():
  eager_us    wall per call of N back-to-back ``experts_triton`` calls, one sync at the end (median of 3)
  host_n_us   perf_counter around those N calls, before the sync; once the GPU is the slower side the
              launch queue fills and this becomes the GPU time (back-pressure), so also:
  host_us     the same over 32 calls started on an idle GPU (far below the queue's depth): the CPU cost
  graph_us    per call of a CUDA graph of 16 calls, replayed (``moekit.bench.timing.time_calls``)
  ok          host_us <= 40 and eager_us <= max(1.15 * graph_us, graph_us + 15), the issue's targets
then (e) the same eager / host numbers for the whole layer (``moekit.MoE`` from the preset, eager:
gate, routing, experts, shared expert), with the gate's and the fused router's own host time; (f) an A/B of the
host-path switches of ``LaunchOptions``, each one off and all off, with a check that every variant returns the default's
output bit for bit; (d) ``torch.profiler`` tables of the top self-CPU ops for one cell, default and all off. First,
three checks of what the CPU tests cannot run: a CUDA graph captured after eager calls (which reuse the
workspace) replays right while eager calls run between replays; two streams at once each get their
own workspace; eager equals the path with every switch off. JSON and the tables go to $OUT (default
./host_time_out); a short table is printed last. About 2-3 minutes on an H200.

``moekit.bench.timing`` has no host-time measure yet (the bench work adds ``eager_us``/``host_us``
fields there); the two small loops here measure what the issue's targets name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from moekit.bench.cells import PRESETS, Shape, make_weights, uniform_routing
from moekit.bench import timing
from moekit.bench.timing import time_calls
from moekit.config import MoEConfig
from moekit.experts.triton import clear_launch_caches, experts_triton, held_workspaces
from moekit.experts.triton_launch import LaunchOptions
from moekit.layer import MoE

SWITCHES = ("direct_eager", "cache_plans", "cached_launcher", "reuse_workspace", "raw_launcher")
VARIANTS = {"default": LaunchOptions(), **{f"no_{s}": LaunchOptions(**{s: False}) for s in SWITCHES},
            "all_off": LaunchOptions(**dict.fromkeys(SWITCHES, False))}
HOST_BUDGET_US = 40.0
SMOKE_SCALE = 64  # --smoke: N and K divided by this, on the CPU under TRITON_INTERPRET=1


class Run:
    """Where and at what scale the script runs: the GPU at full size, or the smoke test."""

    device = torch.device("cuda")
    scale = 1


def _sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def eager_and_host(fn, calls: int, repeats: int = 3) -> tuple[float, float]:
    """(wall µs per call, host µs per call) of ``calls`` back-to-back calls and one sync; medians."""
    walls, hosts = [], []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        walls.append((t2 - t0) / calls * 1e6)
        hosts.append((t1 - t0) / calls * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def host_from_idle(fn, calls: int = 32, repeats: int = 5) -> float:
    """Host µs per call of ``calls`` calls started on an idle GPU (no back-pressure); median."""
    return statistics.median(timing.host_from_idle(fn, Run.device, calls=calls, samples=repeats))


def measure(fn, calls: int, graph: bool = True, repeats: int = 3) -> dict:
    """eager_us, host_n_us, host_us (and graph_us, ok) of ``fn`` (see the module docstring)."""
    for _ in range(3):
        fn()  # compile, plan, workspace
    _sync()
    eager, host_n = eager_and_host(fn, calls, repeats)
    row = {"eager_us": eager, "host_n_us": host_n, "host_us": host_from_idle(fn, repeats=repeats + 2)}
    if graph and Run.device.type == "cuda":
        row["graph_us"] = time_calls([fn] * 16, Run.device, graph=True)
        g = row["graph_us"]
        row["ok"] = row["host_us"] <= HOST_BUDGET_US and eager <= max(1.15 * g, g + 15.0)
    return row


def experts_cells(preset: str, batches: list[int], calls: int, ab: bool, out_dir: Path, profile_m: int) -> list:
    shape, dev = Shape.from_preset(preset, Run.scale), Run.device
    weights = make_weights(shape, torch.bfloat16, dev)
    rows = []
    for m in batches:
        x = torch.randn(m, shape.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(m, shape, dev, seed=m)
        args = (x, weights.w13, weights.w2, routing.topk_ids, routing.topk_weights)
        with torch.no_grad():
            row = {"preset": preset, "M": m, **measure(lambda: experts_triton(*args), calls)}
            if ab:
                row["ab"] = ab_variants(args, calls)
            if m == profile_m:
                profile_tables(preset, m, args, out_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del weights
    clear_launch_caches()
    if Run.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def ab_variants(args: tuple, calls: int) -> dict:
    """Each host-path switch off (and all off): eager and host µs, and whether the output is the default's."""
    want = experts_triton(*args)
    result = {}
    for name, options in VARIANTS.items():
        fn = lambda o=options: experts_triton(*args, options=o)  # noqa: E731
        same = torch.equal(fn(), want)
        result[name] = {**measure(fn, calls, graph=False, repeats=1), "same_output": same}
    return result


def profile_tables(preset: str, m: int, args: tuple, out_dir: Path) -> None:
    """torch.profiler's top self-CPU ops over 20 calls, default options and all switches off."""
    for name in ("default", "all_off"):
        fn = lambda o=VARIANTS[name]: experts_triton(*args, options=o)  # noqa: E731
        fn()
        _sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if Run.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(20):
                fn()
            _sync()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        path = out_dir / f"host_profile_{preset}_M{m}_{name}.txt"
        path.write_text(f"{preset} M={m} options={name}: 20 calls\n{table}\n")
        print(f"wrote {path}", flush=True)


def layer_cells(preset: str, batches: list[int], calls: int) -> list:
    """The whole MoE layer from the preset (random weights), eager: gate, routing, experts, shared expert."""
    dev, config = Run.device, MoEConfig.preset(preset)
    if Run.scale > 1:
        config = config.replace(hidden_size=config.hidden_size // Run.scale,
                                moe_intermediate_size=config.moe_intermediate_size // Run.scale)
    router = "auto" if dev.type == "cuda" else "fused"  # the smoke test runs the router interpreted too
    layer = MoE(config, backend="triton", router=router, dtype=torch.bfloat16, device=dev).eval()
    graphed = MoE(config, backend="triton", router=router, dtype=torch.bfloat16, device=dev,
                  eager_graph_rows=max(batches)).eval()
    graphed.load_state_dict(layer.state_dict())
    rows = []
    for m in batches:
        x = torch.randn(m, layer.config.hidden_size, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            row = {"preset": preset, "M": m, **measure(lambda: layer(x), calls, graph=False), **router_host(layer, x)}
            if dev.type == "cuda":
                row["graphed"] = {**measure(lambda: graphed(x), calls, graph=False),
                                  **graphed_agrees(layer, graphed, x)}
        rows.append(row)
        print(json.dumps({"layer": True, **row}), flush=True)
    del layer, graphed
    clear_launch_caches()
    if Run.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def lean_path_checks() -> dict:
    """Reuse against CUDA graphs and streams, at Qwen3-30B-A3B M=64 (see the module docstring)."""
    shape, dev = Shape.from_preset("qwen3-30b-a3b", Run.scale), Run.device
    weights = make_weights(shape, torch.bfloat16, dev)
    inputs = []
    for seed in range(3):
        routing = uniform_routing(64, shape, dev, seed=seed)
        inputs.append((torch.randn(64, shape.k, device=dev, dtype=torch.bfloat16), weights.w13, weights.w2,
                       routing.topk_ids, routing.topk_weights))
    want = [experts_triton(*a, options=VARIANTS["all_off"]) for a in inputs]
    checks = {"eager_equals_all_off": all(torch.equal(experts_triton(*a), w) for a, w in zip(inputs, want))}
    if Run.device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            experts_triton(*inputs[0])
        torch.cuda.current_stream().wait_stream(side)
        pool = {key: buffer.data_ptr() for key, buffer in held_workspaces().items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts_triton(*inputs[0])
        checks["capture_leaves_the_pool_alone"] = pool == {k: b.data_ptr() for k, b in held_workspaces().items()}
        ok = True
        for _ in range(3):
            experts_triton(*inputs[1])  # an eager call between replays, on the reused workspace
            graph.replay()
            ok = ok and torch.equal(captured, want[0])
        checks["graph_replays_between_eager_calls"] = ok
        checks["two_streams_at_once"] = _two_streams(inputs, want)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)
    return checks


def _two_streams(inputs: list, want: list) -> bool:
    streams = [torch.cuda.Stream() for _ in range(2)]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(10):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(experts_triton(*inputs[i + 1]))
    torch.cuda.synchronize()
    return all(torch.equal(o, want[i + 1]) for i in range(2) for o in outs[i])


def graphed_agrees(layer: MoE, graphed: MoE, x: torch.Tensor) -> dict:
    """Whether the layer replayed from CUDA graphs (``eager_graph_rows``) returns the eager layer's output
    bit for bit: on new inputs, and after an in-place update of both layers' w2 (undone after)."""
    same = torch.equal(graphed(x), layer(x))
    x2 = torch.randn_like(x)
    same_new_x = torch.equal(graphed(x2), layer(x2))
    for moe in (layer, graphed):
        moe.w2.mul_(2.0)
    same_updated = torch.equal(graphed(x2), layer(x2))
    for moe in (layer, graphed):
        moe.w2.div_(2.0)
    return {"same_output": same and same_new_x, "same_after_inplace_update": same_updated,
            "captures": graphed.eager_graphs.captures}


def router_host(layer: MoE, x: torch.Tensor) -> dict:
    """Host µs of the layer's stages before the experts, each alone from an idle start: the gate and,
    where the layer routes with it, the fused router's eager call (its bound launch)."""
    logits, bias = layer.gate(x), layer.e_score_correction_bias
    row = {"gate_host_us": host_from_idle(lambda: layer.gate(x))}
    if layer._fused_router is not None:
        layer._fused_router(logits, bias)  # binds this kind of call
        row["router_host_us"] = host_from_idle(lambda: layer._fused_router(logits, bias))
    return row


def _graphed_text(g: dict | None) -> str:
    if not g:
        return "-"
    flag = "" if g["same_output"] and g["same_after_inplace_update"] else "!"
    return f"{g['host_us']:.0f}/{g['eager_us']:.0f}{flag}"


def summary(cells: list, layers: list) -> str:
    lines = [f"{'preset':<15}{'M':>5}{'host':>8}{'host_n':>8}{'eager':>9}{'graph':>9}  ok   "
             f"{'layer host':>10}{'router':>7}{'layer eager':>12}{'graphed host/eager':>19}   A/B host µs (default / "
             f"off: " + ", ".join(SWITCHES) + " / all)"]
    by_key = {(r["preset"], r["M"]): r for r in layers}
    for c in cells:
        layer = by_key.get((c["preset"], c["M"]), {})
        ab = c.get("ab", {})
        ab_text = " / ".join(f"{ab[v]['host_us']:.0f}{'' if ab[v]['same_output'] else '!'}" for v in VARIANTS
                             if v in ab)
        lines.append(f"{c['preset']:<15}{c['M']:>5}{c['host_us']:>8.1f}{c['host_n_us']:>8.1f}{c['eager_us']:>9.1f}"
                     f"{c.get('graph_us', float('nan')):>9.1f}  {_yes(c.get('ok')):<4} "
                     f"{layer.get('host_us', float('nan')):>10.1f}{layer.get('router_host_us', float('nan')):>7.1f}"
                     f"{layer.get('eager_us', float('nan')):>12.1f}"
                     f"{_graphed_text(layer.get('graphed')):>19}   {ab_text}")
    lines.append("host: idle start, 32 calls; host_n: around N back-to-back calls; ok: host <= 40 µs and "
                 "eager <= max(1.15 graph, graph + 15); '!' after an A/B number: output differs from default; "
                 "graphed: the layer with eager_graph_rows ('!': not bit-equal to the eager layer)")
    return "\n".join(lines)


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 512])
    p.add_argument("--calls", type=int, default=200, help="N back-to-back calls per eager timing")
    p.add_argument("--profile", default="qwen3-30b-a3b:8", help="PRESET:M whose profiler tables are written")
    p.add_argument("--no-ab", dest="ab", action="store_false")
    p.add_argument("--no-layer", dest="layer", action="store_false")
    p.add_argument("--smoke", action="store_true", help=f"CPU interpreter, N and K / {SMOKE_SCALE}: checks the script")
    a = p.parse_args()
    if a.smoke:
        Run.device, Run.scale = torch.device("cpu"), SMOKE_SCALE
    out_dir = Path(os.environ.get("OUT", "host_time_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    meta = {"device": torch.cuda.get_device_name() if Run.device.type == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "triton": triton.__version__,
            "commit": _commit(), "calls": a.calls}
    print(meta, flush=True)
    profile_preset, profile_m = a.profile.split(":")
    with torch.no_grad():
        meta["checks"] = lean_path_checks()
    clear_launch_caches()
    # throwaway: a process's first cell runs slow (session 8: Qwen3 M=1 54.9 µs there against 31 in a later cell)
    experts_cells(a.presets[0], [1], a.calls, False, out_dir, -1)
    cells, layers = [], []
    for preset in a.presets:
        cells += experts_cells(preset, a.batches, a.calls, a.ab, out_dir,
                               int(profile_m) if preset == profile_preset else -1)
        if a.layer:
            layers += layer_cells(preset, a.batches, a.calls)
        # after every preset, so a run cut short keeps what it measured
        (out_dir / "host_time.json").write_text(json.dumps({**meta, "experts": cells, "layer": layers}, indent=1))
    text = summary(cells, layers)
    (out_dir / "host_time.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
