"""ern49: ERNIE-4.5's renormalisation floor (``MoEConfig.renorm_clamp``: w / max(sum(w), c)) in the fused routers,
and the fused router's time with and without it at an ERNIE-4.5-21B-A3B-like config.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/ern49_device_check.py --out $OUT/ern49 --deadline 60   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/ern49_device_check.py --smoke     # CPU (TRITON_INTERPRET=1): tiny shapes

Phases (each skipped past the deadline; <out>/ern49.json rewritten after each):
  check   ERNIE-like config (E 64, top-6, softmax, the correction bias, renorm_clamp 1e-12, as ``from_hf_config``
          reads ERNIE-4.5-21B-A3B), two row sets with a bias each: 16 ordinary rows (N(0, 4), a small random bias)
          and 20 gap rows (expert 0 the gap above the rest, N(0, 1) / 10; the bias +1 on experts 1..6 chooses those:
          chosen softmax sums ~6 e^-gap, gaps 26 / 28 above the floor, 30 / 40 / 100 below it, 4 rows each).
          ``FusedRouter`` against ``route`` (ids equal; weights rel 2e-5, the ulps recorded), against ``twin64`` (a
          float64 loop written here: p_i / max(sum p, c); rel 2e-5), the kernel with the clamp bit-equal to the
          kernel without it on every row above the floor, the rows below it summing < 0.9 (gap 30: ~0.56). The one
          gate + route launch (M = 6) and the tensor-core gate + route (M = 36) on the gap rows, W the identity, the
          same checks.
  time    The fused router at M = 1 (float32 logits [1, 64], the bias): renorm_clamp 0 (the kernel of session 48)
          against 1e-12, each a CUDA graph of 50 calls, 9 interleaved rounds, median µs a call (``bench_rounds``).
  gate    gate_route (the one launch) at M = 1, x bf16 [1, 2560], W bf16 [64, 2560]: clamp 0 against 1e-12, timed
          the same way.
The table is printed last: medians. Every line PASS on an H100 in session 50, since when router="auto" takes the
fused router for ERNIE on CUDA (it kept ``route`` until then).
"""

from __future__ import annotations

import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before moekit imports its kernels

from bench_rounds import graph_of, interleaved, medians  # noqa: E402
from bench_run import RunLog, phase_args, run_info, run_phases  # noqa: E402

from moekit import MoEConfig, route  # noqa: E402
from moekit.routing import gate_route  # noqa: E402
from moekit.routing.fused import FusedRouter  # noqa: E402
from moekit.routing.workspace import RouteWorkspace  # noqa: E402

E, TOP_K, HIDDEN, CLAMP = 64, 6, (256 if SMOKE else 2560), 1e-12
GAPS = (26.0, 28.0, 30.0, 40.0, 100.0)
ABOVE = 8  # the gap rows above the floor come first (gaps 26, 28: 4 rows each)
CALLS, ROUNDS = (2, 2) if SMOKE else (50, 9)
ERNIE = MoEConfig(hidden_size=HIDDEN, moe_intermediate_size=1536, num_experts=E, top_k=TOP_K, renormalize=True,
                  use_correction_bias=True, renorm_clamp=CLAMP)
PLAIN = ERNIE.replace(renorm_clamp=0.0)
RUN = RunLog("ern49: the fused router at an ERNIE-like config (E 64, top-6), renorm_clamp 0 / 1e-12 (µs a call, "
             "CUDA graph of 50, medians)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 10, "gate": 10}


def row_sets(dev) -> dict:
    """name -> (logits [M, E] float32, bias [E]): "ordinary" (16 rows) and "gap" (20 rows; module doc)."""
    g = torch.Generator().manual_seed(0)
    ordinary = (torch.randn(16, E, generator=g) * 2, torch.randn(E, generator=g) * 0.05)
    gap = torch.randn(4 * len(GAPS), E, generator=g) / 10
    gap[:, 0] = torch.tensor(GAPS).repeat_interleave(4)
    bias = torch.randn(E, generator=g) * 1e-3
    bias[1:TOP_K + 1] += 1.0
    return {name: (x.to(dev), b.to(dev)) for name, (x, b) in {"ordinary": ordinary, "gap": (gap, bias)}.items()}


def twin64(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 weights [M, k] of the chosen ``ids``, a row at a time: p_i / max(sum_j p_j, c), p the softmax."""
    out = []
    for row, chosen in zip(logits.double().cpu(), ids.long().cpu()):
        p = torch.softmax(row, dim=0)[chosen]
        out.append(p / max(float(p.sum()), CLAMP))
    return torch.stack(out)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error relative to each row's largest reference weight."""
    scale = ref.double().abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
    return float(((got.double().cpu() - ref.double().cpu()) / scale.cpu()).abs().max())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How two float32 weight tensors differ: elements that differ, and the largest difference in ulps of b."""
    if a.numel() == 0:
        return {"differ": 0, "max_ulps": 0.0}
    diff = (a.float() - b.float()).abs()
    ulp = torch.nextafter(b.float().abs(), torch.tensor(float("inf"), device=b.device)) - b.float().abs()
    return {"differ": int((diff > 0).sum()), "max_ulps": float((diff / ulp.clamp_min(1e-45)).max())}


def judge(label: str, ids, weights, plain_weights, logits, bias, above: int, res: dict) -> None:
    """The checks of one call (module doc); ``above``: the leading rows at or above the floor."""
    want = route(logits, ERNIE, bias)
    ids_ok = bool(torch.equal(ids, want.topk_ids))
    finite = bool(torch.isfinite(weights).all())
    rel_route, rel64 = _rel(weights, want.topk_weights), _rel(weights, twin64(logits, ids))
    kept = bool(torch.equal(weights[:above], plain_weights[:above]))
    below = float(weights[above:].double().sum(-1).max()) if above < weights.shape[0] else 0.0
    res[label] = dict(ids_equal_route=ids_ok, finite=finite, rel_route=rel_route, rel_float64=rel64,
                      above_floor_bits_kept=kept, below_floor_max_sum=below,
                      vs_route_above=_ulps(weights[:above], want.topk_weights[:above]),
                      vs_route_below=_ulps(weights[above:], want.topk_weights[above:]),
                      plain_kernel_vs_route_above=_ulps(plain_weights[:above], want.topk_weights[:above]))
    RUN.check(f"{label}: ids == route, weights ~ route (rel 2e-5), no NaN", ids_ok and finite and rel_route < 2e-5,
              f"rel {rel_route:.1e}; ulps above {res[label]['vs_route_above']}, below {res[label]['vs_route_below']}")
    RUN.check(f"{label}: weights ~ float64 twin (rel 2e-5)", rel64 < 2e-5, f"rel {rel64:.1e}")
    RUN.check(f"{label}: rows above the floor bit-equal to the kernel without the clamp; below it sum < 0.9",
              kept and below < 0.9, f"max sum below {below:.2e}")


def check_phase(dev) -> None:
    res = RESULT["check"] = {}
    sets = row_sets(dev)
    for name, (x, bias) in sets.items():
        got, plain = FusedRouter(ERNIE)(x, bias), FusedRouter(PLAIN)(x, bias)
        judge(f"fused router, {name} rows", got.topk_ids, got.topk_weights, plain.topk_weights, x, bias,
              x.shape[0] if name == "ordinary" else ABOVE, res)
    x, bias = sets["gap"]
    w = torch.eye(E, device=dev)
    for m in (6, 36):  # 6: the one-program launch; 36: the tensor-core gate (> 8 rows); the rows above the floor lead
        rows = torch.cat([x[:2], x[-4:]]) if m == 6 else torch.cat([x[:ABOVE], x[:ABOVE], x[ABOVE:], x[ABOVE:16]])
        out = {}
        for name, cfg in (("clamp", ERNIE), ("plain", PLAIN)):
            buffers = RouteWorkspace().get(rows, E, TOP_K, rows.dtype)
            out[name] = gate_route.gate_route(FusedRouter(cfg), rows, w, None, bias, None, False, buffers)
        if out["clamp"] is None or out["plain"] is None:
            RUN.check(f"gate_route M={m}: runs", False, "handed back")
            continue
        judge(f"gate_route M={m}", out["clamp"].topk_ids, out["clamp"].topk_weights, out["plain"].topk_weights, rows,
              bias, 2 if m == 6 else 2 * ABOVE, res)


def _time(routers: dict, call, label: str, key: str) -> None:
    """``call(router)`` for each router, CUDA graphs of CALLS calls, ROUNDS interleaved rounds; medians to the table."""
    if SMOKE:  # no graphs on the CPU: one call each, nothing timed
        for router in routers.values():
            call(router)
        return
    graphs = {name: graph_of([lambda r=router: call(r)] * CALLS, torch.device("cuda")) for name, router in
              routers.items()}
    RUN.log(f"timing {label}")
    rounds = interleaved(graphs, CALLS, torch.device("cuda"), ROUNDS, 1)  # name -> [µs a call, each round]
    med = medians(rounds)
    RESULT.setdefault("time_us", {})[key] = {"rounds_us": rounds, "median_us": med}
    RUN.summary.append(f"| {label} | " + " | ".join(f"{med[n]:.2f}" for n in routers) + " |")


def time_phase(dev) -> None:
    logits, bias = torch.randn(1, E, generator=torch.Generator().manual_seed(1)).to(dev), row_sets(dev)["ordinary"][1]
    routers = {"clamp 0 (before)": FusedRouter(PLAIN), "clamp 1e-12 (after)": FusedRouter(ERNIE)}
    _time(routers, lambda r: r(logits, bias), "fused router M=1", "router_m1")


def gate_phase(dev) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, HIDDEN, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(E, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dev, torch.bfloat16)
    bias = row_sets(dev)["ordinary"][1]
    kept = {name: RouteWorkspace().get(x, E, TOP_K, x.dtype) for name in ("plain", "clamp")}
    routers = {"clamp 0 (before)": (FusedRouter(PLAIN), kept["plain"]),
               "clamp 1e-12 (after)": (FusedRouter(ERNIE), kept["clamp"])}
    for name, (router, buffers) in routers.items():
        RUN.check(f"gate_route M=1 K={HIDDEN} bf16, {name}: runs",
                  gate_route.gate_route(router, x, w, None, bias, None, False, buffers) is not None)
    _time(routers, lambda rb: gate_route.gate_route(rb[0], x, w, None, bias, None, False, rb[1]),
          f"gate_route M=1 K={HIDDEN}", "gate_route_m1")


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"check": lambda: check_phase(dev), "time": lambda: time_phase(dev), "gate": lambda: gate_phase(dev)}
    args = phase_args(__doc__, phases, "ern49.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "experts": E, "phases": args.phases}
    RUN.summary.append("| call | clamp 0 (before) | clamp 1e-12 (after) |\n|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
