"""fix50 device check (session 50): the decode fast path (``moekit.layer_fast``) for a router in another dtype than x's
(``RouterCasts``: the gate's inputs upcast into kept buffers), against the full forward it replaced for these layers.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/fix50_device_check.py --out $OUT/fix50 --deadline 60
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/fix50_device_check.py --smoke --out /tmp/fix50  (CPU)

Cases (bf16 activations and experts, the default backend and the fused router):
  fp32-router  Qwen3-30B-A3B's shapes (E 128, K 2048, N 768, top-8) with ``router_dtype="float32"`` and a bf16 gate
               weight: what Kolibri, Lara-Mini, the privacy filter and LongCat-Flash run since fam50
  fp32-gate    DeepSeek-V3's shapes (E 256, K 7168, grouped sigmoid, correction bias) with a float32 gate weight and no
               router_dtype: V3 as transformers loads it (``_keep_in_fp32_modules_strict``)
at M = 1, 8, 64 (the one gate + router launch; the tensor-core gate's above 8).
Correctness first, one line each (PASS / FAIL): the fast path serves (its entry kept, a hit counted); its output equal
bit for bit to the full forward's (``layer_fast.ENABLED = False``); its logits equal to the full forward's
(``route_tokens``), float32, within 1e-4 of the largest |logit| of the float64 GEMM (a bf16 rounding is ~4e-3); its
ids equal to ``moekit.route`` on those logits, weights within 1e-6.
Then host and wall µs per forward (a loop of CALLS calls: host = until the last call returns, wall = until the device
is done), variants interleaved over rounds until --deadline, medians: ``fast`` (this branch), ``full`` (the fast path
off: what these layers ran before), and for fp32-router ``bf16`` (the same layer with router_dtype None: the fast path
of a bf16 router, the cost before fam50's fix, other routing). A table last; JSON to --out/fix50.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moekit import MoE, MoEConfig, layer_fast, route

CALLS = 50  # forwards a timed loop
ROWS = (1, 8, 64)


class Counting:
    """A layer's ``DecodeFast`` with its served calls counted."""

    def __init__(self, inner):
        self.inner, self.hits = inner, 0

    def __call__(self, layer, x2d):
        out = self.inner(layer, x2d)
        self.hits += out is not None
        return out

    def keep(self, layer, x2d):
        self.inner.keep(layer, x2d)

    def clear(self):
        self.inner.clear()


def build(config: MoEConfig, gate_dtype: torch.dtype, device) -> MoE:
    torch.manual_seed(0)
    layer = MoE(config, router="fused", dtype=torch.bfloat16, device=device).eval()
    layer.gate.to(gate_dtype)
    if config.use_correction_bias:
        layer.e_score_correction_bias.copy_(torch.rand(config.num_experts, device=device) * 0.1)
    layer._decode = Counting(layer._decode)
    return layer


def check(name: str, layer: MoE, m: int, device) -> dict:
    """Correctness of the fast path at M = m: served, == the full forward, logits and routing."""
    x = torch.randn(m, layer.config.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer_fast.ENABLED = True
        layer(x)  # keeps
        before = layer._decode.hits
        fast = layer(x)
        served = layer._decode.hits == before + 1
        entry = layer._decode.inner._entries.get(m)
        logits = entry.buffers.logits.clone() if entry is not None else None
        ids = None if entry is None else entry.buffers.ids.clone()
        weights = None if entry is None else entry.buffers.weights.clone()
        layer_fast.ENABLED = False
        full = layer(x)
        slow = layer.route_tokens(x)
        layer_fast.ENABLED = True
    row = {"case": name, "m": m, "served": served,
           "path": "none" if entry is None else "joint" if entry.joint is not None else
           "one" if entry.bound is not None else "two", "casts": entry is not None and entry.casts is not None}
    if entry is None:
        row["check"] = "FAIL not kept"
        return row
    w = layer.gate.weight.detach().double()
    ref = x.double() @ w.t() + (0 if layer.gate.bias is None else layer.gate.bias.detach().double())
    err = float((logits.double() - ref).abs().max() / ref.abs().max())
    r = route(logits, layer.config, layer.e_score_correction_bias)
    k = layer.config.top_k
    checks = {"out==full": torch.equal(fast, full), "logits==full": torch.equal(logits, slow.router_logits),
              "fp32": logits.dtype == torch.float32, "err<=1e-4": err <= 1e-4,
              "ids==route": torch.equal(ids[:, :k].long(), r.topk_ids.long()),
              "weights": float((weights[:, :k] - r.topk_weights).abs().max()) <= 1e-6, "served": served}
    failed = [n for n, ok in checks.items() if not ok]
    row["check"] = ("PASS" if not failed else "FAIL " + ",".join(failed)) + f" err {err:.1e}"
    return row


def timed(layer: MoE, x: torch.Tensor, sync, calls: int) -> tuple[float, float]:
    """(host µs, wall µs) per forward over ``calls`` calls."""
    for _ in range(3):
        layer(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        layer(x)
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def time_case(name: str, layers: dict, m: int, device, stop: float, sync, calls: int) -> dict:
    """Host / wall µs of each variant ({variant: (layer, fast path on)}), rounds interleaved until ``stop``."""
    x = torch.randn(m, next(iter(layers.values()))[0].config.hidden_size, device=device, dtype=torch.bfloat16)
    host, wall = {v: [] for v in layers}, {v: [] for v in layers}
    with torch.no_grad():
        for _ in range(7):
            if time.monotonic() > stop and host[next(iter(layers))]:
                break
            for v, (layer, on) in layers.items():
                layer_fast.ENABLED = on
                h, w = timed(layer, x, sync, calls)
                host[v].append(h)
                wall[v].append(w)
        layer_fast.ENABLED = True
    row = {"case": name, "m": m, "rounds": len(host[next(iter(layers))])}
    for v in layers:
        row[f"{v}_host"] = round(statistics.median(host[v]), 1)
        row[f"{v}_wall"] = round(statistics.median(wall[v]), 1)
    return row


def configs(smoke: bool) -> dict:
    if smoke:
        small = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
        return {"fp32-router": (small.replace(router_dtype="float32"), torch.bfloat16),
                "fp32-gate": (small.replace(scoring="sigmoid", use_correction_bias=True), torch.float32)}
    return {"fp32-router": (MoEConfig.preset("qwen3-30b-a3b").replace(router_dtype="float32"), torch.bfloat16),
            "fp32-gate": (MoEConfig.preset("deepseek-v3"), torch.float32)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fix50")
    p.add_argument("--deadline", type=float, default=60.0)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    start = time.monotonic()
    device = torch.device("cpu" if a.smoke else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = ROWS[:2] if a.smoke else ROWS
    checks, times = [], []
    for name, (config, gate_dtype) in configs(a.smoke).items():
        if time.monotonic() - start > a.deadline * 0.6:
            print(f"SKIPPED {name}: deadline", flush=True)
            continue
        layer = build(config, gate_dtype, device)
        variants = {"fast": (layer, True), "full": (layer, False)}
        if name == "fp32-router":
            bf16 = build(config.replace(router_dtype=None), torch.bfloat16, device)
            bf16.load_state_dict(layer.state_dict())
            variants["bf16"] = (bf16, True)
        for m in rows:
            row = check(name, layer, m, device)
            print(f"{row['check']}  {name} M={m} path={row['path']} casts={row['casts']}", flush=True)
            checks.append(row)
        share = (a.deadline * (0.5 if name == "fp32-router" else 0.9) - (time.monotonic() - start)) / len(rows)
        for m in rows:
            times.append(time_case(name, variants, m, device, time.monotonic() + max(share, 0.0), sync,
                                   2 if a.smoke else CALLS))
        del layer, variants
    Path(a.out).mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    (Path(a.out) / "fix50.json").write_text(json.dumps({"info": info, "checks": checks, "times": times}, indent=1))
    print(f"\n{info}  (µs per forward; host: until the last call returns, wall: until the device is done)")
    print(f"{'case':12} {'M':>4} {'rounds':>6} " + " ".join(f"{v + ' ' + k:>11}" for v in ("fast", "full", "bf16")
                                                           for k in ("host", "wall")))
    for r in times:
        cells = " ".join(f"{r.get(f'{v}_{k}', float('nan')):>11}" for v in ("fast", "full", "bf16")
                         for k in ("host", "wall"))
        print(f"{r['case']:12} {r['m']:>4} {r['rounds']:>6} {cells}")
    print(f"total {time.monotonic() - start:.1f} s", flush=True)
    sys.exit(0 if all(r["check"].startswith("PASS") for r in checks) else 1)


if __name__ == "__main__":
    main()
