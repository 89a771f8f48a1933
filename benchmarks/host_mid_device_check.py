"""Host time per eager call at M = 1..1024 (issue 13: experts <= 40 µs at every M, the layer <= 60 µs): why the
same experts path costs 20-40 µs more on DeepSeek-V3 and Mixtral than on Qwen3, and the layer at M = 8.

    PYTHONPATH=$PWD OUT=/tmp/hm python benchmarks/host_mid_device_check.py [--budget-s 105]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_mid_device_check.py --smoke   (CPU: checks the script)

Per preset (Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B; bf16, no_grad, uniform routing), M = 1, 8, 64, 256, 1024,
cells in ORDER (the layer at 8 and 1, the experts, the layer's others) until --budget-s:
1. layer (``MoE``, backend triton, router auto), variants ``old`` (the gate kernel and the one gate+router launch
   up to 4 rows: main) and ``new`` (up to 8: this branch; the same code above 8 rows, so only ``new`` runs there):
   host µs as ``moekit bench`` measures it (``time_eager``: 16 calls, one sync, per call), split into the first
   call after the sync and the rest's mean; GPU µs (graph replay); old against new: equal, ids equal, max |diff|
   over max |old|; eager against a CUDA graph of the layer: equal.
2. experts (``experts_triton``, the bench's weights and inputs, 2 rotated sets): host µs as the bench measures it
   and split into first / rest, variants ``old`` (main: the k-sum folded into the down GEMM at M = 1 only) and
   ``new`` (this branch: up to M = 8, one launch fewer; bit-equal by construction); at M = 1024 ``old`` = main's
   pool size (``REUSE_MAX_BYTES`` 128 MiB: DeepSeek-V3's h and y allocated per call) against the branch's 256 MiB
   (pooled); elsewhere the same plan as main, so only ``new`` runs; GPU µs each; eager against a CUDA graph:
   equal. Candidates for fewer launches (CANDIDATES, not defaults): ``fold512`` at M = 64, ``one2048`` at M = 256,
   their host and GPU µs. The first call's diagnosis (at --diagnose-at M; the first run showed that neither a
   spinning wait nor 300 µs of Python work before it removes its cost): the same 16-call loop after ``sync``
   (torch.cuda.synchronize, as the bench), ``kick`` (sync, then one tiny kernel launch) and ``torch`` (sync, then an
   allocation and three tiny torch kernels, as a model's next ops), each as first / rest; and the first call's steps
   (``host_trim2_probe.timed_call``: out, stream and addresses, each launch) right after the sync of a 16-call loop,
   against the same steps back to back.
Look for: every ``same``/``graph`` yes (layer old/new at M = 8: same and ids yes); the first call's share of the
bench's host µs (first >> rest) and whether ``torch`` moves it onto the torch ops (then it is the first CUDA work
after a long GPU run, whoever issues it); experts new rest < old at M = 8 with GPU µs equal; layer new host < old
at M = 8 and its GPU µs within ~25 µs (DeepSeek-V3's gate kernel at 8 rows). JSON to $OUT/host_mid.json; a table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import host_align_device_check as ha
import host_trim2_probe as probe
from moekit import MoEConfig, layer as layer_module, layer_fast
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import time_calls, time_eager
from moekit.experts.triton import _WORKSPACES, clear_launch_caches, experts_triton
from moekit.experts import triton_fast
from moekit.experts.triton_cache import REUSE_MAX_BYTES
from moekit.experts.triton_launch import LaunchOptions
from moekit.layer import MoE
from moekit.routing import gate, gate_route

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (8, 1, 64, 256, 1024)
# cells of a preset in priority order (the budget stops the rest): the layer's decode cells, the experts, the layer's
# others
ORDER = (("layer", 8), ("layer", 1), ("experts", 8), ("experts", 64), ("experts", 256), ("experts", 1024),
         ("experts", 1), ("layer", 64), ("layer", 256), ("layer", 1024))
DIAGNOSE_AT = (8, 256)  # experts cells with the other waits and the first call's steps
GATE_ROWS = {"old": 4, "new": gate.MAX_TOKENS}  # the layer's variants: rows of the gate kernel / one launch
MAIN_OPTIONS = LaunchOptions(sum_fold_max=1)  # main's k-sum fold (M = 1 only); the branch folds up to M = 8
# candidates for fewer launches past M = 8, measured for their GPU cost (not defaults): the alignment folded into
# gate-up up to A = 512 (M = 64), the one-launch alignment up to A = 2048 (M = 256)
MAIN_POOL_BYTES = 128 << 20  # main's REUSE_MAX_BYTES: above it h and y are allocated per call (DeepSeek-V3 M = 1024)
CANDIDATES = {64: ("fold512", LaunchOptions(align_fold_max=512)),
              256: ("one2048", LaunchOptions(align_one_launch_max=2048))}
WAITS = ("sync", "kick", "torch")
LOOP_CALLS = 16  # as moekit.bench.timing.EAGER_CALLS


class Run:
    device = torch.device("cuda")
    scale = 1
    samples = 5
    loop_calls = LOOP_CALLS
    warm = 3  # calls before timing: compile, record, keep


def sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def wait(kind: str) -> None:
    """Let the GPU finish the queued work, the way ``kind`` says (module docstring)."""
    if Run.device.type != "cuda":
        return
    torch.cuda.synchronize()
    if kind == "kick":
        torch.cuda._sleep(1)
    elif kind == "torch":  # plain torch work first: an allocation and three tiny kernels, as a model's next ops
        scratch = torch.empty(256, device=Run.device)
        for _ in range(3):
            scratch.add_(1.0)


def loop_split(fns: list, kind: str = "sync") -> dict:
    """``Run.loop_calls`` calls cycling through ``fns`` after a wait of ``kind``, ``Run.samples`` times: medians of the
    mean per call, of the first call and of the rest's mean (µs)."""
    means, firsts, rests = [], [], []
    clock = time.perf_counter
    for fn in fns:
        fn()
    for _ in range(Run.samples):
        wait(kind)
        t0 = clock()
        fns[0]()
        t1 = clock()
        for i in range(1, Run.loop_calls):
            fns[i % len(fns)]()
        t2 = clock()
        means.append((t2 - t0) / Run.loop_calls * 1e6)
        firsts.append((t1 - t0) * 1e6)
        rests.append((t2 - t1) / (Run.loop_calls - 1) * 1e6)
    sync()
    return {"mean": round(statistics.median(means), 2), "first": round(statistics.median(firsts), 2),
            "rest": round(statistics.median(rests), 2)}


def bench_host(fns: list) -> float:
    """Host µs per call exactly as ``moekit bench`` reports it (``time_eager``)."""
    if Run.device.type != "cuda":
        return float("nan")
    return round(time_eager(fns, Run.device).host_us, 2)


def gpu_us(fn) -> float:
    return float("nan") if Run.device.type != "cuda" else round(time_calls([fn] * 8, Run.device, graph=True), 2)


def graph_equal(fn, want: torch.Tensor) -> bool | str:
    """Whether ``fn`` captured in a CUDA graph and replayed returns ``want`` bit for bit (CPU: not run)."""
    if Run.device.type != "cuda":
        return "cpu"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    sync()
    return torch.equal(out, want)


def first_steps(sequence, args: tuple) -> dict:
    """The kept call's steps (µs, medians): right after the sync of a 16-call loop, and back to back."""
    x, w13, w2, ids, weights = args
    names = None
    after_wait, back_to_back = [], []
    for _ in range(Run.samples):
        for _ in range(Run.loop_calls):
            experts_triton(*args)
        sync()
        after_wait.append(probe.timed_call(sequence, x, ids, weights, w13, w2, True)[1])
        back_to_back.append(probe.timed_call(sequence, x, ids, weights, w13, w2, True)[1])
    sync()
    entry = probe.kept_entry(*args)
    names = ["alloc_out", "alloc_h_y", "stream_addresses"] + probe.step_names(entry) + ["free_h_y"]
    return {"after_sync": probe._medians(after_wait, names), "back_to_back": probe._medians(back_to_back, names)}


def set_pool(max_bytes: int) -> None:
    """The reused workspace's size limit, and the kept fast-path entries dropped if it changed (an entry keeps the
    sequence it recorded, h and y pooled or per call, and does not look at the limit again)."""
    if _WORKSPACES.max_bytes != max_bytes:
        _WORKSPACES.max_bytes = max_bytes
        triton_fast.clear_fast()


def experts_cell(shape: Shape, weights, m: int, diagnose: bool) -> dict:
    sets = make_sets(shape, m, 2, torch.bfloat16, Run.device)
    w13, w2 = weights.w13, weights.w2
    variants = {"old": MAIN_OPTIONS if m <= 8 else None, "new": None} if m <= 8 or m == 1024 else {"new": None}
    if m in CANDIDATES:
        variants[CANDIDATES[m][0]] = CANDIDATES[m][1]
    pools = {name: MAIN_POOL_BYTES if name == "old" and m == 1024 else REUSE_MAX_BYTES for name in variants}
    fns = {name: [lambda s=s, o=o: experts_triton(s.x, w13, w2, s.topk_ids, s.topk_weights, options=o) if o else
                  experts_triton(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
           for name, o in variants.items()}
    row = {}
    want = None
    for name, calls in fns.items():
        set_pool(pools[name])
        for _ in range(Run.warm):
            out = calls[0]()
        sync()
        want = out if want is None else want
        row[f"{name}_same"] = torch.equal(out, want)
        row[f"{name}_graph"] = graph_equal(calls[0], out)
        row[f"{name}_bench_host"] = bench_host(calls)
        row[f"{name}_sync"] = loop_split(calls, "sync")
        row[f"{name}_gpu"] = gpu_us(calls[0])
    set_pool(REUSE_MAX_BYTES)
    if not diagnose:
        return row
    for kind in WAITS[1:]:
        row[f"new_{kind}"] = loop_split(fns["new"], kind)
    s = sets[0]
    args = (s.x, w13, w2, s.topk_ids, s.topk_weights)
    entry = probe.kept_entry(*args)
    row["steps"] = "no kept entry" if entry is None else first_steps(entry.sequence, args)
    return row


def set_gate_rows(rows: int, layer: MoE) -> None:
    """The gate kernel's and the one launch's row limit (read where each path decides), their kept decisions
    dropped, and the layer's kept decode calls (each holds a bound launch or the router's)."""
    gate.MAX_TOKENS = gate_route.MAX_TOKENS = layer_module.GATE_ROUTE_ROWS = layer_fast.MAX_TOKENS = rows
    gate._BOUND.clear()
    gate_route._BOUND.clear()
    layer._decode.clear()


def layer_cell(layer: MoE, m: int) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device=Run.device, dtype=torch.bfloat16)
    names = list(GATE_ROWS) if m <= max(GATE_ROWS.values()) and m > min(GATE_ROWS.values()) else ["new"]
    row, outs, ids = {}, {}, {}
    for name in names:
        set_gate_rows(GATE_ROWS[name], layer)
        fn = lambda: layer(x)  # noqa: E731
        for _ in range(Run.warm):
            outs[name] = fn()
        ids[name] = layer.route_tokens(x).routing.topk_ids.clone()
        sync()
        row[f"{name}_graph"] = graph_equal(fn, outs[name])
        row[f"{name}_bench_host"] = bench_host([fn])
        row[f"{name}_sync"] = loop_split([fn], "sync")
        row[f"{name}_gpu"] = gpu_us(fn)
    if "old" in outs:  # new's one launch (kept buffers) against its two launches (what a CUDA graph captures)
        one, two = layer.route_tokens(x, layer._route_ws), layer.route_tokens(x)
        row["one_vs_two"] = {part: torch.equal(getattr(one.routing, f), getattr(two.routing, f)) for part, f in
                             (("ids", "topk_ids"), ("weights", "topk_weights"))}
        row["one_vs_two"]["logits"] = torch.equal(one.router_logits, two.router_logits)
        old, new = outs["old"].float(), outs["new"].float()
        row["same"] = torch.equal(outs["old"], outs["new"])
        row["ids_same"] = torch.equal(ids["old"], ids["new"])
        row["rel_diff"] = float((old - new).abs().max() / old.abs().max().clamp_min(1e-30))
    set_gate_rows(GATE_ROWS["new"], layer)
    return row


def layer_config(preset: str) -> MoEConfig:
    config = MoEConfig.preset(preset)
    if Run.scale == 1:
        return config
    return config.replace(hidden_size=config.hidden_size // Run.scale,
                          moe_intermediate_size=config.moe_intermediate_size // Run.scale,
                          shared_expert_intermediate_size=config.shared_expert_intermediate_size // Run.scale)


def free_memory() -> None:
    clear_launch_caches()
    if Run.device.type == "cuda":
        torch.cuda.empty_cache()


def measure(a, start: float, results: dict) -> None:
    """Preset by preset, its layer and its experts weights side by side, cells in ORDER (the budget may stop it)."""
    with torch.no_grad():
        for preset in a.presets:
            layer = MoE(layer_config(preset), backend="triton", router="auto", dtype=torch.bfloat16,
                        device=Run.device).eval()
            shape = Shape.from_preset(preset, Run.scale)
            weights = make_weights(shape, torch.bfloat16, Run.device)
            for kind, m in ORDER:
                if m not in (a.layer_batches if kind == "layer" else a.batches):
                    continue
                cell = (lambda m=m: layer_cell(layer, m)) if kind == "layer" else (
                    lambda m=m: experts_cell(shape, weights, m, m in a.diagnose_at))
                ha.budgeted_cell(results, f"{kind} {preset} M={m}", start, a.budget_s, cell)
            del layer, weights
            free_memory()


def _f(v) -> str:
    return f"{v:7.1f}" if isinstance(v, float) else f"{str(v):>7}"


def table(results: dict) -> str:
    lines = ["host µs per call: bench = moekit bench's host_us (16 calls, one sync); first / rest = that loop's "
             "first call after the sync / the other calls' mean; gpu = graph replay"]
    for key, r in results.items():
        if not isinstance(r, dict) or "skipped" in r or "error" in r:
            lines.append(f"{key:30} {r}")
            continue
        variants = [k[:-5] for k in r if k.endswith("_sync")]
        cells = []
        for v in variants:
            s = r[f"{v}_sync"]
            cells.append(f"{v}: bench {_f(r[f'{v}_bench_host'])} first {_f(s['first'])} rest {_f(s['rest'])} "
                         f"gpu {_f(r[f'{v}_gpu'])} "
                         f"graph {ha._yn(r[f'{v}_graph']) if r[f'{v}_graph'] != 'cpu' else '-'}")
        lines.append(f"{key:30} " + " | ".join(cells))
        if "rel_diff" in r:
            lines.append(f"{'':32}old vs new: same {ha._yn(r['same'])} ids {ha._yn(r['ids_same'])} "
                         f"rel diff {r['rel_diff']:.1e}; new one launch vs two (graph's): {r.get('one_vs_two')}")
        sames = [f"{k[:-5]} {ha._yn(v)}" for k, v in r.items() if k.endswith("_same")][1:]  # against the first
        if key.startswith("experts") and sames:
            lines.append(f"{'':32}bit-equal to {variants[0]}: " + " ".join(sames))
        waits = [f"{k} {r[f'new_{k}']['first']:.1f}/{r[f'new_{k}']['rest']:.1f}" for k in WAITS[1:] if f"new_{k}" in r]
        if waits:
            lines.append(f"{'':32}first/rest after other waits: " + "  ".join(waits))
        steps = r.get("steps")
        if isinstance(steps, dict):
            for way, st in steps.items():
                lines.append(f"{'':32}steps {way:12} " + " ".join(f"{n}={v}" for n, v in st.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=105.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=135, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--layer-batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--diagnose-at", nargs="+", type=int, default=list(DIAGNOSE_AT))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale, Run.samples, Run.loop_calls, Run.warm = torch.device("cpu"), ha.SMOKE_SCALE, 1, 2, 3
        a.budget_s = 1e9  # the interpreter takes minutes: every cell runs
        if a.batches == list(BATCHES):
            a.batches, a.layer_batches, a.presets, a.diagnose_at = [8], [8], ["mixtral-8x7b"], [8]
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = Run.device
    out_dir = Path(os.environ.get("OUT", "host_mid_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "host_mid.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()
