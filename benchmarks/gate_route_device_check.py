"""The one-launch gate and router (``moekit.routing.gate_route``), the gate GEMM's host call above 4 rows, and
the eager layer's host time step by step (issue 13 item 4: <= 60 µs per layer call), on the GPU.

    PYTHONPATH=$PWD OUT=/tmp/gr python benchmarks/gate_route_device_check.py

Per preset (bf16, ``backend="triton"``) and M in 1, 8, 64, 512 (M = 1 first across presets, after a throwaway cell: the
first preset at M = 1; 2 and 4 for the checks), under ``torch.no_grad()``. Host µs per call: 32 calls from an idle GPU,
7 rounds, median and min:
  layer        the forward as committed: gate + route in one launch at M <= 4, ``torch.mm(out=)`` gate above
  layer_two    the same with the gate and the router as two launches (``_gate_route = None``)
  layer_lin    the same with ``F.linear`` for the gate above 4 rows (``_gate_mm = None``; main's path)
  gr           ``gate_route`` alone (M <= 4);  gate: the layer's gate step;  route: the fused router alone
  experts      the layer's experts step on a fixed routing;  glue = layer - (gr, or gate + route) - experts
  forward      ``layer.forward(x)`` (no nn.Module call);  body: route_tokens then the experts step, back to back
  module_call = layer_min - forward_min;  fwd_checks = forward_min - body_min;  together = body_min -
               route_tokens_min - experts_min (the two steps back to back against each timed alone)
  route_tokens ``MoE.route_tokens`` as forward calls it;  rt_glue = route_tokens - (gr, or gate + route);
               fwd_glue = layer - route_tokens - experts (the module call, forward's checks, the experts step's call)
  mm / addmm / linear / matmul   the gate GEMM alone (M >= 8): ``torch.mm(x, W.t(), out=)``, ``torch.addmm``
               with out=, ``F.linear``, ``torch.matmul(out=)``
GPU µs (CUDA graph of 20 calls): gr against gate + route (and, after the cells if time is left, gr bound
at 1 and 2 warps instead of 4: gr_w1_gpu, gr_w2_gpu); mm against linear. eager: wall µs per call of 200
(50 at M >= 64) default layer calls and one sync (layer and layer_two / layer_lin). Checks: the one launch's logits, ids
and weights bit-equal to the two launches' and ids equal to ``moekit.route`` on its logits at M = 1, 2, 4;
the mm gate bit-equal to ``F.linear``; the layer output bit-equal across the three paths; the in-kernel
assert on a NaN input (a subprocess: it kills its CUDA context). cProfile of one Qwen3 M = 1 call: the
Python functions it runs. A cell starting after BUDGET_S is skipped. JSON to $OUT/gate_route.json; a short
table last.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from moekit import route
from moekit.bench.timing import host_from_idle
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.routing import gate_route

from layer_host_device_check import eager_us, graph_gpu_us  # run as a script: benchmarks/ is on sys.path

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BUDGET_S = 85.0  # cells starting later are skipped
EXTRA_S = 100.0  # the warp-count variants, after the cells, only before this
ASSERT_CHECK = """
import torch
from moekit import MoE, MoEConfig
layer = MoE(MoEConfig.preset("qwen3-30b-a3b"), backend="triton", dtype=torch.bfloat16, device="cuda").eval()
x = torch.randn(2, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    layer(x), layer(x)
    torch.cuda.synchronize()
    print("finite input: no assert", flush=True)
    x[1, 3] = float("nan")
    try:
        layer(x)
        torch.cuda.synchronize()
        print("NaN input: NO ASSERT")
    except Exception as err:
        print("NaN input raised", type(err).__name__, str(err)[:300])
"""


def host(fn, calls: int = 32, rounds: int = 7) -> tuple[float, float]:
    """(median, min) host µs per call over ``rounds`` rounds of ``calls`` calls, each started on an idle GPU."""
    times = host_from_idle(fn, torch.device("cuda"), calls=calls, samples=rounds)
    return statistics.median(times), min(times)


class Paths:
    """Switch the layer between the committed path and the two it replaces."""

    def __init__(self, layer: MoE):
        self.layer, self.gr, self.mm = layer, layer._gate_route, layer._gate_mm

    def run(self, name: str, fn):
        def call():
            layer = self.layer
            layer._gate_route = None if name == "two" else self.gr
            layer._gate_mm = None if name == "lin" else self.mm
            try:
                return fn()
            finally:
                layer._gate_route, layer._gate_mm = self.gr, self.mm
        return call


def step_fns(layer: MoE, x: torch.Tensor, paths: Paths) -> dict:
    c, m = layer.config, x.shape[0]
    in_kernel = layer.fuse_shared and layer.capacity_factor is None
    gx, w, gb, _ = layer._gate_inputs(x)
    ws = layer._route_ws.get(x, c.num_experts, c.top_k + c.num_shared_slots * in_kernel, gx.dtype)
    bias, router = layer.e_score_correction_bias, layer._fused_router
    routed = layer.route_tokens(x)
    logits = routed.router_logits
    fns = {"layer": lambda: layer(x), "forward": lambda: layer.forward(x),
           "body": lambda: layer._experts_and_shared(x, layer.route_tokens(x, layer._route_ws)),
           "layer_two": paths.run("two", lambda: layer(x)),
           "layer_lin": paths.run("lin", lambda: layer(x)),
           "route_tokens": lambda: layer.route_tokens(x, layer._route_ws),  # as forward calls it
           "gate": lambda: layer._gate(gx, w, gb, ws.logits),
           "route": lambda: router(logits, bias, None, in_kernel, (ws.ids, ws.weights)),
           "experts": lambda: layer._experts_and_shared(x, routed)}
    if m <= gate_route.MAX_TOKENS:
        fns["gr"] = lambda: gate_route.gate_route(router, gx, w, gb, bias, None, in_kernel, ws)
    else:
        out = torch.empty(m, c.num_experts, dtype=gx.dtype, device=x.device)
        zero = torch.zeros(c.num_experts, dtype=gx.dtype, device=x.device)
        fns.update(mm=lambda: torch.mm(gx, w.t(), out=out), addmm=lambda: torch.addmm(zero, gx, w.t(), out=out),
                   linear=lambda: torch.nn.functional.linear(gx, w), matmul=lambda: torch.matmul(gx, w.t(), out=out))
    return fns, (gx, w, gb, ws, bias, router, in_kernel)


def gr_warps(layer: MoE, x: torch.Tensor, num_warps: int):
    """One gate_route launch bound with ``num_warps`` warps (the committed one: gate_route.NUM_WARPS)."""
    c, in_kernel = layer.config, layer.fuse_shared and layer.capacity_factor is None
    gx, w, gb, _ = layer._gate_inputs(x)
    ws = layer._route_ws.get(x, c.num_experts, c.top_k + c.num_shared_slots * in_kernel, gx.dtype)
    router, bias = layer._fused_router, layer.e_score_correction_bias
    plan = router._plans[1 if in_kernel and c.num_shared_slots else 0]
    bound = gate_route._BoundGateRoute(plan, gx, w, gb, bias, None, router.assert_in_kernel, num_warps)
    return lambda: bound(gx, w, gb, bias, None, ws)


def checks(layer: MoE, m: int, paths: Paths) -> dict:
    """Bit-equality of the one launch against the two (M <= 4), of the mm gate against F.linear, of the layer."""
    x = torch.randn(m, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    fns, (gx, w, gb, ws, bias, router, in_kernel) = step_fns(layer, x, paths)
    res = {}
    if m <= gate_route.MAX_TOKENS:
        got = fns["gr"]()
        logits1, ids1, w1 = ws.logits.clone(), got.topk_ids.clone(), got.topk_weights.clone()
        logits2 = layer._gate(gx, w, gb, None)
        two = router(logits2, bias, None, in_kernel)
        ref = route(logits2, layer.config, bias)
        k = layer.config.top_k
        res.update(gr_logits_equal=bool(torch.equal(logits1, logits2)),
                   gr_ids_equal=bool(torch.equal(ids1, two.topk_ids)),
                   gr_weights_equal=bool(torch.equal(w1, two.topk_weights)),
                   gr_rows_vs_route=int((ids1[:, :k] != ref.topk_ids).any(dim=1).sum()),
                   gr_count_zero=int(ws.count.item()) == 0)
    else:
        res["mm_equal_linear"] = bool(torch.equal(fns["mm"]().clone(), torch.nn.functional.linear(gx, w)))
    outs = [fns[k]().clone() for k in ("layer", "layer_two", "layer_lin")]
    res["layer_equal_two"] = bool(torch.equal(outs[0], outs[1]))
    res["layer_equal_lin"] = bool(torch.equal(outs[0], outs[2]))
    return res


def cell(layer: MoE, preset: str, m: int, paths: Paths) -> dict:
    x = torch.randn(m, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    fns, _ = step_fns(layer, x, paths)
    for fn in fns.values():
        fn(), fn()
    row = {"preset": preset, "M": m}
    for name, fn in fns.items():
        row[name], row[name + "_min"] = host(fn)
    routing = row["gr"] if "gr" in row else row["gate"] + row["route"]
    row["glue"] = row["layer"] - routing - row["experts"]
    row["rt_glue"] = row["route_tokens"] - routing  # route_tokens' own Python
    row["fwd_glue"] = row["layer"] - row["route_tokens"] - row["experts"]  # module call, forward, _experts_and_shared
    # fwd_glue split, on the mins (the medians of a noisy host spread by tens of µs): the nn.Module call, forward's
    # own checks, and what the two steps cost back to back beyond each timed alone (caches, the GPU queue)
    row["module_call"] = row["layer_min"] - row["forward_min"]
    row["fwd_checks"] = row["forward_min"] - row["body_min"]
    row["together"] = row["body_min"] - row["route_tokens_min"] - row["experts_min"]
    calls = 200 if m <= 8 else 50  # DeepSeek-V3 at M = 512: ~5.5 ms of GPU a call
    row["eager"], row["eager_two"], row["eager_lin"] = (eager_us(fns[k], calls)
                                                        for k in ("layer", "layer_two", "layer_lin"))
    gpu = ("gr", "gate", "route") if "gr" in fns else ("mm", "linear")
    row.update({f"{k}_gpu": graph_gpu_us(fns[k]) for k in gpu})
    row.update(checks(layer, m, paths))
    if m == 1:
        row.update({f"check_M{mm}": checks(layer, mm, paths) for mm in (2, 4)})
    return row


def profile(layer: MoE) -> str:
    x = torch.randn(1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        layer(x)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main() -> None:
    out = Path(os.environ.get("OUT", "gate_route_out"))
    out.mkdir(parents=True, exist_ok=True)
    start, rows, skipped, layers = time.perf_counter(), [], [], {}
    check = subprocess.Popen([sys.executable, "-c", ASSERT_CHECK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    prof_text = ""
    with torch.no_grad():
        layers[PRESETS[0]] = MoE(MoEConfig.preset(PRESETS[0]), backend="triton", dtype=torch.bfloat16,
                                 device="cuda").eval()
        cell(layers[PRESETS[0]], PRESETS[0], 1, Paths(layers[PRESETS[0]]))  # throwaway: a first cell runs slow
        for m in (1, 8, 64, 512):
            for preset in PRESETS:
                if time.perf_counter() - start > BUDGET_S:
                    skipped.append((preset, m))
                    continue
                if preset not in layers:
                    layers[preset] = MoE(MoEConfig.preset(preset), backend="triton", dtype=torch.bfloat16,
                                         device="cuda").eval()
                try:
                    rows.append(cell(layers[preset], preset, m, Paths(layers[preset])))
                except Exception:  # noqa: BLE001 - reported; the other cells still run
                    rows.append({"preset": preset, "M": m, "error": traceback.format_exc()})
                print(json.dumps(rows[-1]), flush=True)
                if m == 1 and preset == PRESETS[0]:
                    prof_text = profile(layers[preset])
        for row in rows:  # last, in the time left: the one launch at other warp counts (compiles 2 kernels each)
            if row["M"] == 1 and "error" not in row and time.perf_counter() - start < EXTRA_S:
                x = torch.randn(1, layers[row["preset"]].config.hidden_size, device="cuda", dtype=torch.bfloat16)
                row.update({f"gr_w{w}_gpu": graph_gpu_us(gr_warps(layers[row["preset"]], x, w)) for w in (1, 2)})
    try:
        assert_text = check.communicate(timeout=60)[0][-1500:]
    except subprocess.TimeoutExpired:
        check.kill()
        assert_text = "timed out"
    summary = {"torch": torch.__version__, "rows": rows, "skipped": skipped, "assert_check": assert_text,
               "profile_qwen3_M1": prof_text, "seconds": time.perf_counter() - start}
    (out / "gate_route.json").write_text(json.dumps(summary, indent=1))
    print(prof_text)
    print("in-kernel assert (subprocess):\n" + assert_text)
    print(f"skipped: {skipped}; {summary['seconds']:.0f} s")
    print_table(rows)


COLS = ("layer", "layer_min", "layer_two", "layer_lin", "gr", "gate", "route", "experts", "glue", "rt_glue", "fwd_glue",
        "module_call", "fwd_checks", "together",
        "mm", "addmm",
        "linear", "matmul", "eager", "eager_two", "eager_lin", "gr_gpu", "gr_w1_gpu", "gr_w2_gpu",
        "gate_gpu", "route_gpu", "mm_gpu", "linear_gpu")


def print_table(rows: list) -> None:
    print("host µs per call (median of 7 rounds; *_min: min), eager: wall µs, *_gpu: GPU µs")
    print(f"{'preset':<14}{'M':>4}" + "".join(f"{c[:10]:>11}" for c in COLS) + "  checks")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:<14}{r['M']:>4}  FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        text = "".join(f"{'-' if r.get(c) is None else f'{r[c]:.1f}':>11}" for c in COLS)
        flags = {k: v for k, v in r.items() if k.endswith(("equal", "equal_two", "equal_lin", "vs_route", "zero"))
                 or k.startswith("check_M")}
        print(f"{r['preset']:<14}{r['M']:>4}{text}  {flags}")


if __name__ == "__main__":
    main()
