"""Where the eager ``moekit.MoE`` layer's host time goes on the GPU (issue 13 item 4: <= 60 µs), stage by stage.

    PYTHONPATH=. OUT=/tmp/lh python benchmarks/layer_host_device_check.py [--presets P ...] [--batches 1 8 64 512]

For each preset (bf16, ``backend="triton"``, ``router="auto"``) and M, under ``torch.no_grad()``, the host µs
per call of 32 calls started on an idle GPU (median of 5 rounds) of:
  layer       the whole forward, default path (gate on its Triton kernel, ``moekit.routing.gate``; the routing
              written into kept buffers, ``moekit.routing.workspace``)
  prev        the whole forward as before this branch: the gate on ``F.linear``, the flag and ``_assert_async``,
              fresh buffers
  gate        ``MoE._router_logits`` into the kept logits (the Triton gate);  gate_torch: ``F.linear``
  route       the fused router on the gate's logits, as the layer calls it (shared slots appended in-kernel;
              nonfinite="raise" asserted in the kernel);  route_flag: the same with the flag and _assert_async
  experts     the layer's experts step on a fixed routing (``MoE._experts_and_shared``)
  glue        layer - gate - route - experts
then ``eager`` (wall µs per call of 200 back-to-back default calls and one sync), the GPU µs of one gate call
(Triton vs F.linear) and of one route call (in-kernel assert vs flag) from a CUDA graph of 20 calls, host
syncs per call (``set_sync_debug_mode("warn")``) of the layer and of each stage, with the Python stack of
the first sync of each kind (``"error"`` mode), and accuracy: gate logits vs a float64 matmul (max |err| / max
|logit|, Triton and F.linear), the fused router's ids vs ``moekit.route`` on the same logits (mismatching rows),
the layer output vs a float64 experts loop on the layer's own routing (relative Frobenius error), and vs the previous
implementation (max |diff|, rows whose experts differ). Once: raw C launches taken (``RawLaunch``) by the gate and route
bound launches, and the host µs of ``torch.empty`` and ``torch._assert_async`` (what one fewer allocation or launch
would save).
Cells run M = 1 first across presets, after a throwaway cell (the first preset at M = 1: a first cell runs slow); a cell
starting after BUDGET_S seconds is skipped (printed). JSON to $OUT/layer_host.json; a table printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from moekit import route
from moekit.bench import timing
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.routing import fused, gate

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
BUDGET_S = 85.0  # cells that start later are skipped: the whole run stays under 2 min
COLS = ("layer", "prev", "gate", "gate_torch", "route", "route_flag", "experts", "glue", "eager", "gate_gpu",
        "gate_torch_gpu", "route_gpu", "route_flag_gpu")
ASSERT_CHECK = """
import torch
from moekit import MoEConfig
from moekit.routing.fused import FusedRouter
router = FusedRouter(MoEConfig.preset("qwen3-30b-a3b"))
logits = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
router(logits), router(logits)
torch.cuda.synchronize()
print("finite logits: no assert", flush=True)
logits[2, 7] = float("nan")
try:
    router(logits)
    torch.cuda.synchronize()
    print("NaN logit: NO ASSERT")
except Exception as err:
    print("NaN logit raised", type(err).__name__, str(err)[:300])
"""
STACKS: dict[str, str] = {}  # the Python stack of each distinct host sync, printed once


def host_from_idle(fn, calls: int = 32, rounds: int = 5) -> float:
    return statistics.median(timing.host_from_idle(fn, torch.device("cuda"), calls=calls, samples=rounds))


def eager_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_gpu_us(fn, calls: int = 20) -> float | None:
    """GPU µs of one call: a CUDA graph of ``calls`` calls replayed, timed with events."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (5 * calls)
    except Exception as err:  # noqa: BLE001 - a measurement that cannot be taken is reported, not fatal
        print(f"graph timing failed: {type(err).__name__}: {err}", flush=True)
        return None


def count_syncs(fn, label: str) -> int:
    """Host syncs in one call of ``fn`` (sync debug warnings); the first sync's stack kept once per label."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count = sum("synchroniz" in str(w.message) for w in caught)
    if count and label not in STACKS:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError:
            STACKS[label] = traceback.format_exc()
            print(f"--- host sync in {label}:\n{STACKS[label]}", flush=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return count


class _NoWorkspace:
    """Stands in for ``MoE._route_ws`` where the previous implementation (fresh buffers) is timed."""

    def get(self, *args):
        return None

    def clear(self) -> None:
        pass


def stage_fns(layer: MoE, x: torch.Tensor) -> dict:
    routed = layer.route_tokens(x)
    logits, bias = routed.router_logits, layer.e_score_correction_bias
    router, in_kernel = layer._fused_router, layer.fuse_shared and layer.capacity_factor is None
    gate_fn, ws, gate_route, gate_mm = layer._gate_fn, layer._route_ws, layer._gate_route, layer._gate_mm
    flag_router = fused.FusedRouter(layer.config, assert_in_kernel=False)
    c = layer.config
    bufs = ws.get(x, c.num_experts, c.top_k + c.num_shared_slots * in_kernel, x.dtype)  # what forward writes

    def previous(fn):
        """fn as before this branch: the gate on F.linear, the flag and _assert_async, fresh buffers."""
        def run():
            layer._gate_fn, layer._fused_router, layer._route_ws = None, flag_router, _NoWorkspace()
            layer._gate_route, layer._gate_mm = None, None  # gate_route_device_check.py times these two
            try:
                return fn()
            finally:
                layer._gate_fn, layer._fused_router, layer._route_ws = gate_fn, router, ws
                layer._gate_route, layer._gate_mm = gate_route, gate_mm
        return run

    return {
        "layer": lambda: layer(x),
        "prev": previous(lambda: layer(x)),
        "gate": lambda: layer._router_logits(x, bufs.logits),
        "gate_torch": previous(lambda: layer._router_logits(x)),
        "route": None if router is None else (lambda: router(logits, bias, None, in_kernel, (bufs.ids, bufs.weights))),
        "route_flag": lambda: flag_router(logits, bias, None, append_shared=in_kernel),
        "experts": lambda: layer._experts_and_shared(x, routed),
    }


def accuracy(layer: MoE, x: torch.Tensor, prev) -> dict:
    """The chain of checks of the module docstring, on one batch."""
    w = layer.gate.weight
    want = x.double() @ w.double().t()  # [M, E]
    scale = want.abs().max().item()
    logits = layer._router_logits(x)
    torch_logits = torch.nn.functional.linear(x, w)
    routed = layer.route_tokens(x)
    ids = routed.routing.topk_ids[:, : layer.config.top_k]
    twin = route(routed.router_logits, layer.config, layer.e_score_correction_bias)
    out, old = layer(x), prev()
    ref = experts_float64(layer, x, routed.routing.topk_ids, routed.routing.topk_weights)
    old_ids = route(torch_logits, layer.config, layer.e_score_correction_bias).topk_ids
    return {
        "gate_err": ((logits.double() - want).abs().max().item() / scale),
        "gate_torch_err": ((torch_logits.double() - want).abs().max().item() / scale),
        "route_id_rows_differ": int((ids != twin.topk_ids).any(dim=1).sum()),
        "route_w_maxdiff": (routed.routing.topk_weights[:, : layer.config.top_k]
                            - twin.topk_weights).abs().max().item(),
        "out_rel_err_f64": ((out.double() - ref).norm() / ref.norm()).item(),
        "out_maxdiff_prev": (out.float() - old.float()).abs().max().item(),
        "rows_experts_differ_prev": int((ids.sort(dim=1).values != old_ids.sort(dim=1).values).any(dim=1).sum()),
    }


def experts_float64(layer: MoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * w2[e] @ (silu(gate) * up)(w13[e] @ x[t]) in float64, expert by expert."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    n = layer.w13.shape[1] // 2
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok].double() @ layer.w13[e].double().t()  # [r, 2N]
        y = (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ layer.w2[e].double().t()  # [r, K]
        out.index_add_(0, tok, weights[tok, slot].double()[:, None] * y)
    if layer.shared_w13 is not None:
        raise NotImplementedError("separate shared MLP: the presets here fuse it")
    return out


def cell(layer: MoE, preset: str, m: int) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    fns = {k: f for k, f in stage_fns(layer, x).items() if f is not None}
    for fn in fns.values():
        fn(), fn()  # compile, bind, plan
    row = {"preset": preset, "M": m, **{k: host_from_idle(f) for k, f in fns.items()}}
    row["glue"] = row["layer"] - row["gate"] - row.get("route", 0.0) - row["experts"]
    row["eager"] = eager_us(fns["layer"])
    row["gate_gpu"] = graph_gpu_us(fns["gate"])
    row["gate_torch_gpu"] = graph_gpu_us(fns["gate_torch"])
    row["route_gpu"] = graph_gpu_us(fns["route"]) if "route" in fns else None  # the debug=True build
    row["route_flag_gpu"] = graph_gpu_us(fns["route_flag"])
    row["syncs"] = {k: count_syncs(f, f"{k} ({preset})") for k, f in fns.items()}
    row.update(accuracy(layer, x, fns["prev"]))
    return row


def cell_or_fallback(layer: MoE, preset: str, m: int) -> dict:
    """``cell``; where it fails, again with the route kernel on the flag, then also the gate on F.linear
    (each error kept in the row), so one failing piece still leaves the others measured."""
    errors = []
    for fallback in ("", "flag router", "flag router, F.linear gate"):
        if "flag" in fallback:
            layer._fused_router = fused.FusedRouter(layer.config, assert_in_kernel=False)
        if "F.linear" in fallback:
            layer._gate_fn = None
        try:
            row = cell(layer, preset, m)
            state = [] if layer._fused_router.assert_in_kernel else ["flag router"]
            return {**row, "fallback": ", ".join(state + ([] if layer._gate_fn else ["F.linear gate"])),
                    "errors": errors}
        except Exception:  # noqa: BLE001 - reported, and the next way is tried
            errors.append(traceback.format_exc())
            print(f"{preset} M={m} failed ({fallback or 'default'}):\n{errors[-1]}", flush=True)
    return {"preset": preset, "M": m, "error": errors[-1], "errors": errors}


def launch_facts() -> dict:
    """Whether the bound launches took the raw C launch, and what an allocation and an assert cost."""
    facts = {"gate_raw": [b.launch._raw is not None for b in gate._BOUND.values()
                          if isinstance(b, gate._BoundGate) and b.launch is not None],
             "route_raw": [b.launch._raw is not None for b in fused._BOUND.values() if b.launch is not None]}
    flag = torch.ones(1, dtype=torch.int32, device="cuda")
    facts["empty_us"] = host_from_idle(lambda: torch.empty(1, 8, dtype=torch.int32, device="cuda"), calls=200)
    facts["assert_async_us"] = host_from_idle(lambda: torch._assert_async(flag, "msg"), calls=200)
    facts["empty_view_pair_us"] = host_from_idle(
        lambda: torch.empty(2, 1, 8, dtype=torch.int32, device="cuda").unbind(0)[1].view(torch.float32), calls=200)
    return facts


def profile_table(fn, path: Path) -> None:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 512])
    a = p.parse_args()
    out = Path(os.environ.get("OUT", "layer_host_out"))
    out.mkdir(parents=True, exist_ok=True)
    start, rows, skipped = time.perf_counter(), [], []
    # The NaN case kills its CUDA context: a process of its own, run alongside.
    check = subprocess.Popen([sys.executable, "-c", ASSERT_CHECK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    layers = {}
    with torch.no_grad():
        layers[a.presets[0]] = MoE(MoEConfig.preset(a.presets[0]), backend="triton", router="auto",
                                   dtype=torch.bfloat16, device="cuda").eval()
        cell_or_fallback(layers[a.presets[0]], a.presets[0], 1)  # throwaway: a process's first cell runs slow
        for m in a.batches:
            for preset in a.presets:
                if time.perf_counter() - start > BUDGET_S:
                    skipped.append((preset, m))
                    continue
                if preset not in layers:  # all three kept: 27 GB of bf16 weights
                    layers[preset] = MoE(MoEConfig.preset(preset), backend="triton", router="auto",
                                         dtype=torch.bfloat16, device="cuda").eval()
                rows.append(cell_or_fallback(layers[preset], preset, m))
                print(json.dumps(rows[-1]), flush=True)
                if m == 1 and preset == a.presets[0] and "error" not in rows[-1]:
                    fns = stage_fns(layers[preset], torch.randn(1, layers[preset].config.hidden_size, device="cuda",
                                                                dtype=torch.bfloat16))
                    profile_table(fns["layer"], out / "profile_layer_M1.txt")
                    profile_table(fns["prev"], out / "profile_prev_M1.txt")
        facts = launch_facts()
    try:
        facts["assert_check"] = check.communicate(timeout=60)[0][-1500:]
    except subprocess.TimeoutExpired:
        check.kill()
        facts["assert_check"] = "timed out"
    summary = {"torch": torch.__version__, "rows": rows, "facts": facts, "skipped": skipped, "sync_stacks": STACKS,
               "seconds": time.perf_counter() - start}
    (out / "layer_host.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"facts": {k: v for k, v in facts.items() if k != "assert_check"}, "skipped": skipped,
                      "seconds": summary["seconds"]}))
    print("in-kernel assert check (subprocess):\n" + facts["assert_check"])
    print_table(rows)


def print_table(rows: list) -> None:
    print(f"{'preset':<14}{'M':>4}" + "".join(f"{c:>15}" for c in COLS) + "  syncs(layer)  id_rows_vs_route  "
          "out_rel_f64  rows_differ_prev   (host µs per call; eager: wall; *_gpu: GPU µs)")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:<14}{r['M']:>4}  FAILED: {r['error'].splitlines()[-1]}")
            continue
        text = "".join(f"{'-' if r.get(c) is None else f'{r[c]:.1f}':>15}" for c in COLS)
        print(f"{r['preset']:<14}{r['M']:>4}{text}{r['syncs']['layer']:>14}{r['route_id_rows_differ']:>18}"
              f"{r['out_rel_err_f64']:>13.2e}{r['rows_experts_differ_prev']:>18}  {r['fallback'] or 'default'}")


if __name__ == "__main__":
    main()
