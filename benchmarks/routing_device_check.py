"""GPU checks and timings of the fused router (``moekit.routing.fused``) against ``route``, its torch twin.

    PYTHONPATH=. python benchmarks/routing_device_check.py [STEP ...]

Steps (all by default):
  agree     real configs x M in {1, 8, 64, 512, 4096, 16384} x fp32/bf16 logits: ids equal to route's
            except where route's own scores tie or nearly tie (counted and classified, never silent),
            weights' max abs difference; shared slots appended in the kernel vs append_shared_slots
  masked    nonfinite="mask" rows: equal to route where route already has the new semantics (ungrouped),
            properties elsewhere (masked slots weigh 0, each row's ids distinct)
  graphs    capture once, replay with new logits: equal to route on the new logits
  compiled  torch.compile(fullgraph=True) around the router: equal to eager
  layer     MoE(router="auto") picks the kernel on CUDA; forward equal to MoE(router="torch")
  timing    per call: eager back-to-back calls with one sync (wall µs, host time included) and
            CUDA-graph replay µs, route vs fused
  raise     nonfinite="raise" with a NaN: a device-side assert (in a child process: it ends the context)
Prints one line per check and the timing table last; writes $OUT/routing_device_check.json when OUT
is set; exit 1 on any failure.

Shapes: M tokens, E experts, k = top_k.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import torch

from moekit import MoEConfig, route
from moekit.bench.timing import time_calls
from moekit.routing import append_shared_slots
from moekit.routing.fused import FusedRouter
from bench_run import RunLog

M_VALUES = (1, 8, 64, 512, 4096, 16384)
DTYPES = (torch.float32, torch.bfloat16)
QWEN3_NEXT = MoEConfig(hidden_size=2048, moe_intermediate_size=512, num_experts=512, top_k=10,
                       shared_expert_intermediate_size=512, shared_expert_gate=True)
CONFIGS = {name: MoEConfig.preset(name) for name in
           ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen1.5-moe-a2.7b", "deepseek-v2-lite")}
CONFIGS["qwen3-next"] = QWEN3_NEXT
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check
RESULTS: dict = {"agree": [], "timing": []}


def problem(cfg, m, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = (torch.randn(m, cfg.num_experts, generator=g, device=dev) * 2).to(dtype)  # [M, E]
    bias = torch.randn(cfg.num_experts, generator=g, device=dev) * 0.1 if cfg.use_correction_bias else None
    return logits, bias


def selection_keys(logits, cfg, bias):
    """route's selection key [M, E] fp32, computed by torch as route computes it (groups not masked)."""
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(x)
    return scores if bias is None else scores + bias


def group_scores(key, cfg, biased):
    grouped = key.view(key.shape[0], cfg.n_group, -1)  # [M, G, E/G]
    if biased and grouped.shape[-1] >= 2:
        return grouped.topk(2, dim=-1).values.sum(-1)  # [M, G]
    return grouped.max(-1).values


def classify(logits, cfg, bias, ref_ids, got_ids):
    """Rows whose ids differ -> counts by kind. 'tie': route's keys at the two id lists are equal;
    'near': within 1e-6 relative (a rounding difference of the scores decided it); 'group': the kept
    groups differ on group scores within 1e-6; 'mismatch': none of these (a failure)."""
    bad = (ref_ids != got_ids).any(dim=1).nonzero()[:, 0]
    kinds = {"tie": 0, "near": 0, "group": 0, "mismatch": 0}
    if bad.numel() == 0:
        return kinds
    key = selection_keys(logits[bad], cfg, bias).double().cpu()  # [B, E]; the row loop runs on the host
    ref, got = ref_ids[bad].long().cpu(), got_ids[bad].long().cpu()
    key_ref, key_got = key.gather(1, ref), key.gather(1, got)  # [B, k]
    size = cfg.num_experts // cfg.n_group
    gs = group_scores(key, cfg, bias is not None) if cfg.n_group > 1 else None
    for i in range(bad.numel()):
        if torch.equal(key_ref[i], key_got[i]):
            kinds["tie"] += 1
        elif torch.allclose(key_ref[i], key_got[i], rtol=1e-6, atol=0.0):
            kinds["near"] += 1
        elif gs is not None and torch.allclose(gs[i, (ref[i] // size).unique()].sort().values,
                                               gs[i, (got[i] // size).unique()].sort().values, rtol=1e-6, atol=0.0):
            kinds["group"] += 1
        else:
            kinds["mismatch"] += 1
    return kinds


def tied_rows(logits, cfg, bias):
    """Rows where route's k-th and (k+1)-th keys (groups ignored) are exactly equal: the tie rule decides."""
    key = selection_keys(logits, cfg, bias)
    if key.shape[1] <= cfg.top_k:
        return 0
    top = key.topk(cfg.top_k + 1, dim=-1).values
    return int((top[:, -1] == top[:, -2]).sum())


def agree(dev):
    for name, cfg in CONFIGS.items():
        router = FusedRouter(cfg)
        for dtype in DTYPES:
            worst, kinds_all, rows, tied = 0.0, {"tie": 0, "near": 0, "group": 0, "mismatch": 0}, 0, 0
            for m in M_VALUES:
                logits, bias = problem(cfg, m, dtype, dev, seed=m)
                ref, got = route(logits, cfg, bias), router(logits, bias)
                kinds = classify(logits, cfg, bias, ref.topk_ids, got.topk_ids)
                same = (ref.topk_ids == got.topk_ids).all(dim=1)
                if same.any():
                    worst = max(worst, (ref.topk_weights[same] - got.topk_weights[same]).abs().max().item())
                kinds_all = {k: kinds_all[k] + kinds[k] for k in kinds}
                rows, tied = rows + m, tied + tied_rows(logits, cfg, bias)
            RESULTS["agree"].append(dict(config=name, dtype=str(dtype), rows=rows, tied_rows=tied,
                                         max_abs_weight_diff=worst, **kinds_all))
            check(f"agree {name} {dtype}", kinds_all["mismatch"] == 0 and worst < 1e-5,
                  f"rows={rows} differing: tie={kinds_all['tie']} near={kinds_all['near']} group={kinds_all['group']} "
                  f"mismatch={kinds_all['mismatch']}; tied rows={tied}; max |dw|={worst:.2e}")
        if cfg.num_shared_slots:
            logits, bias = problem(cfg, 64, torch.bfloat16, dev)
            gate = torch.randn(64, 1, device=dev)
            got = router(logits, bias, gate, append_shared=True)
            ref = append_shared_slots(route(logits, cfg, bias), cfg, gate)
            ok = torch.equal(got.topk_ids, ref.topk_ids) and torch.allclose(got.topk_weights, ref.topk_weights,
                                                                            atol=1e-5)
            check(f"shared slots {name} (S={cfg.num_shared_slots})", ok)


def masked(dev):
    nan, inf = float("nan"), float("inf")
    for name, cfg in CONFIGS.items():
        cfg = cfg.replace(nonfinite="mask")
        logits, bias = problem(cfg, 512, torch.float32, dev, seed=7)
        logits[::3, ::5] = nan
        logits[1::7, 1::3] = inf
        logits[2] = nan  # no finite expert at all
        logits[5, cfg.top_k // 2:] = -inf  # fewer finite experts than slots
        got = FusedRouter(cfg)(logits, bias)
        ids, w = got.topk_ids.long(), got.topk_weights
        finite = torch.isfinite(logits).gather(1, ids)
        ok = bool((w[~finite] == 0).all()) and bool(torch.isfinite(w).all())
        ok &= bool((ids.sort(1).values.diff(dim=1) > 0).all()) and bool((w[2] == 0).all())
        if cfg.n_group == 1:  # route's mask path already follows the definition here
            ref = route(logits, cfg, bias)
            ok &= torch.equal(ref.topk_ids, got.topk_ids) and torch.allclose(ref.topk_weights, w, atol=1e-6)
        check(f"masked {name}", ok)


def graphs(dev):
    cfg = CONFIGS["deepseek-v3"]
    router = FusedRouter(cfg)
    static, bias = problem(cfg, 64, torch.float32, dev)
    out = router(static, bias)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = router(static, bias)
    for seed in (1, 2, 3):
        fresh, _ = problem(cfg, 64, torch.float32, dev, seed=seed)
        static.copy_(fresh)
        g.replay()
        ref = route(fresh, cfg, bias)
        ok = torch.equal(out.topk_ids, ref.topk_ids) and torch.allclose(out.topk_weights, ref.topk_weights, atol=1e-5)
        if not ok:
            return check("graph replay == route on new logits", False, f"seed {seed}")
    check("graph replay == route on new logits", True)


def compiled(dev):
    for name in ("qwen3-30b-a3b", "deepseek-v3"):
        cfg = CONFIGS[name]
        router = FusedRouter(cfg)
        logits, bias = problem(cfg, 37, torch.bfloat16, dev)
        fn = torch.compile(lambda x, b: router(x, b), fullgraph=True)
        got, ref = fn(logits, bias), router(logits, bias)
        check(f"compiled fullgraph {name}", torch.equal(got.topk_ids, ref.topk_ids)
              and torch.equal(got.topk_weights, ref.topk_weights))


def layer(dev):
    from moekit.layer import MoE

    for name in ("deepseek-v3", "qwen1.5-moe-a2.7b"):
        cfg = CONFIGS[name].replace(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256)
        for capacity in (None, 1.0):
            torch.manual_seed(0)
            fused = MoE(cfg, capacity_factor=capacity, dtype=torch.bfloat16, device=dev)
            plain = MoE(cfg, capacity_factor=capacity, router="torch", dtype=torch.bfloat16, device=dev)
            plain.load_state_dict(fused.state_dict())
            if fused.e_score_correction_bias is not None:
                fused.e_score_correction_bias.normal_(std=0.1)
                plain.e_score_correction_bias.copy_(fused.e_score_correction_bias)
            x = torch.randn(33, 256, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                a, b = fused.route_tokens(x).routing, plain.route_tokens(x).routing
                ok = fused._fused_router is not None and torch.equal(a.topk_ids, b.topk_ids)
                ok &= torch.allclose(fused(x).float(), plain(x).float(), atol=2e-2, rtol=2e-2)
            check(f"layer {name} capacity={capacity}: auto picks the kernel, same output", ok)


def _wall_us(fn, reps: int) -> float:
    """Eager calls back to back, one sync at the end: µs of wall clock per call (host time included)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def timing(dev):
    for name, cfg in CONFIGS.items():
        router = FusedRouter(cfg)
        for dtype in DTYPES:
            for m in M_VALUES:
                inputs = [problem(cfg, m, dtype, dev, seed=s) for s in range(8)]  # rotated: no L2 reuse
                calls = {"route": [lambda x=x, b=b: route(x, cfg, b) for x, b in inputs],
                         "fused": [lambda x=x, b=b: router(x, b) for x, b in inputs]}
                row = dict(config=name, dtype=str(dtype).replace("torch.", ""), M=m)
                for kind, fns in calls.items():
                    row[f"{kind}_eager_us"] = _wall_us(fns[0], 200 if m <= 4096 else 50)
                    row[f"{kind}_graph_us"] = time_calls(fns, dev, graph=True, budget_s=0.1)
                RESULTS["timing"].append(row)
    check("timing", True, f"{len(RESULTS['timing'])} rows")


_RAISE_CHILD = """
import torch
from moekit import MoEConfig
from moekit.routing.fused import route_fused
cfg = MoEConfig.preset("qwen3-30b-a3b")
x = torch.randn(8, cfg.num_experts, device="cuda")
x[3, 7] = float("nan")
route_fused(x, cfg)
torch.cuda.synchronize()
print("NO ASSERT")
"""


def raise_(dev):
    child = subprocess.run([sys.executable, "-c", _RAISE_CHILD], capture_output=True, text=True, timeout=300)
    text = child.stdout + child.stderr
    ok = child.returncode != 0 and "NO ASSERT" not in text and "assert" in text.lower()
    check("nonfinite='raise': device-side assert", ok, text.strip().splitlines()[-1][:160] if text.strip() else "")


def print_table():
    print(f"\n{'config':<18} {'dtype':<9} {'M':>6} {'route eager':>12} {'fused eager':>12} {'route graph':>12} "
          f"{'fused graph':>12}   (µs per call)")
    for r in RESULTS["timing"]:
        print(f"{r['config']:<18} {r['dtype']:<9} {r['M']:>6} {r['route_eager_us']:>12.1f} "
              f"{r['fused_eager_us']:>12.1f} {r['route_graph_us']:>12.1f} {r['fused_graph_us']:>12.1f}")


def main() -> int:
    import triton

    dev = torch.device("cuda")
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    try:
        RESULTS["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    except OSError:
        RESULTS["commit"] = None
    print(RESULTS["device"], "torch", RESULTS["torch"], "triton", RESULTS["triton"], flush=True)
    steps = {f.__name__.rstrip("_"): f for f in (agree, masked, graphs, compiled, layer, timing, raise_)}
    for step in [steps[name] for name in sys.argv[1:]] or steps.values():
        try:
            step(dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            check(step.__name__, False, "raised")
    RESULTS["failed"] = FAILED
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "routing_device_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    print("FAILED:", FAILED if FAILED else "none", flush=True)
    if RESULTS["timing"]:
        print_table()
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
