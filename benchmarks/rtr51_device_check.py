"""rtr51 device check (session 51): the float32 router without its copies. The gate kernels read x and the gate weights
in their stored dtypes and upcast in registers (``moekit.routing.gate.reads_as``), in the full forward and on the
decode fast path (``layer_fast``: no ``RouterCasts``), against session 50's casts (``gate.READ_STORED = False``: x and
W copied to float32 before the same launch).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/rtr51_device_check.py --out $OUT/rtr51 --deadline 60
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/rtr51_device_check.py --smoke --out /tmp/rtr51  (CPU)

Cases (bf16 activations and experts, the default backend, the fused router; ``fix50_device_check``'s):
  fp32-router  Qwen3-30B-A3B's shapes (E 128, K 2048) with ``router_dtype="float32"`` and a bf16 gate weight
  fp32-gate    DeepSeek-V3's shapes (E 256, K 7168, grouped sigmoid, correction bias) with a float32 gate weight
at M = 1, 8 (the row-loop gate + router launch) and 64 (the tensor-core one).
Correctness first, one line each (PASS / FAIL): the fast path serves with no cast buffers; its output equal bit for bit
to the full forward's; the full forward's output, logits, ids and weights equal bit for bit to the cast path's (float32
inputs made explicitly, then the same launch); the logits within 1e-4 of the largest |logit| of the float64 GEMM; the
ids ``moekit.route``'s on those logits.
Then DeepSeek-V4's routers at subnormal sqrt(softplus) scores (``rtr51_subnormal``: the fused hash and top-k routers
against ``hash_route`` / ``route`` and a float64 formula at logits -80 .. -110 and ordinary ones).
Then host and wall µs per forward (``fix50_device_check.time_case``: loops of 50 calls, variants interleaved over
up to 7 rounds until --deadline, medians): ``fast`` / ``full`` (this branch's fast path and full forward),
``fast_copy`` / ``full_copy`` (session 50's casts), and for fp32-router ``bf16`` (router_dtype None, for scale). A
table last; JSON to --out/rtr51.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from fix50_device_check import build, configs, time_case  # noqa: E402
from rtr51_subnormal import checks as subnormal_checks  # noqa: E402
from moekit import MoE, layer_fast, route  # noqa: E402
from moekit.routing import gate  # noqa: E402

CALLS = 50  # forwards a timed loop (fix50's)
ROWS = (1, 8, 64)
VARIANTS = ("fast", "fast_copy", "full", "full_copy", "bf16")


def _full(layer: MoE, x: torch.Tensor, stored: bool):
    """(output, RoutedTokens) of the full forward with the gate reading as stored or on the casts."""
    gate.READ_STORED, layer_fast.ENABLED = stored, False
    try:
        return layer(x), layer.route_tokens(x, layer._route_ws)
    finally:
        gate.READ_STORED, layer_fast.ENABLED = True, True


def check(name: str, layer: MoE, m: int, device) -> dict:
    """Correctness at M = m: served without casts, == the full forward, == the cast path, logits and ids."""
    x = torch.randn(m, layer.config.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)  # keeps
        before = layer._decode.hits
        fast = layer(x)
        served = layer._decode.hits == before + 1
        entry = layer._decode.inner._entries.get(m)
        out, routed = _full(layer, x, True)
        logits, ids = routed.router_logits.clone(), routed.routing.topk_ids.clone()
        weights = routed.routing.topk_weights.clone()
        old_out, old = _full(layer, x, False)
    row = {"case": name, "m": m, "served": served, "casts": entry is not None and entry.casts is not None,
           "path": "none" if entry is None else "joint" if entry.joint is not None else
           "one" if entry.bound is not None else "two"}
    w = layer.gate.weight.detach().double()
    ref = x.double() @ w.t() + (0 if layer.gate.bias is None else layer.gate.bias.detach().double())
    err = float((logits.double() - ref).abs().max() / ref.abs().max())
    r = route(logits, layer.config, layer.e_score_correction_bias)
    k = layer.config.top_k
    checks = {"served": served, "no_casts": not row["casts"], "fast==full": torch.equal(fast, out),
              "out==cast": torch.equal(out, old_out), "logits==cast": torch.equal(logits, old.router_logits),
              "ids==cast": torch.equal(ids, old.routing.topk_ids),
              "weights==cast": torch.equal(weights, old.routing.topk_weights), "fp32": logits.dtype == torch.float32,
              "err<=1e-4": err <= 1e-4, "ids==route": torch.equal(ids[:, :k].long(), r.topk_ids.long())}
    failed = [n for n, ok in checks.items() if not ok]
    row["check"] = ("PASS" if not failed else "FAIL " + ",".join(failed)) + f" err {err:.1e}"
    return row


class Stored:
    """A layer called with ``gate.READ_STORED`` = ``stored`` (its variant's path) for ``fix50_device_check.time_case``
    (which sets the fast path on or off around it); the same global store in every variant, so no side pays more."""

    def __init__(self, layer: MoE, stored: bool) -> None:
        self.layer, self.stored, self.config = layer, stored, layer.config

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate.READ_STORED = self.stored
        try:
            return self.layer(x)
        finally:
            gate.READ_STORED = True


def variants_of(name: str, config, gate_dtype, device) -> dict:
    """{variant: (Stored layer, fast path on)}; ``fast_copy``'s layer keeps its entries under the casts."""
    layer = build(config, gate_dtype, device)
    copy = build(config, gate_dtype, device)
    copy.load_state_dict(layer.state_dict())
    out = {"fast": (Stored(layer, True), True), "fast_copy": (Stored(copy, False), True),
           "full": (Stored(layer, True), False), "full_copy": (Stored(copy, False), False)}
    if name == "fp32-router":
        bf16 = build(config.replace(router_dtype=None), torch.bfloat16, device)
        bf16.load_state_dict(layer.state_dict())
        out["bf16"] = (Stored(bf16, True), True)
    return out


def keep_copies(copy: MoE, m: int, device) -> bool:
    """Keep ``copy``'s entry for M = m under the casts (session 50's path); whether it holds them."""
    x = torch.randn(m, copy.config.hidden_size, device=device, dtype=torch.bfloat16)
    gate.READ_STORED = False
    try:
        with torch.no_grad():
            copy(x)
    finally:
        gate.READ_STORED = True
    entry = copy._decode.inner._entries.get(m)
    return entry is not None and entry.casts is not None


def correctness(cases: dict, rows: tuple, device, smoke: bool) -> list[dict]:
    """Every PASS / FAIL line, before any timing: each case's M (and the A/B layer's entry kept under the casts),
    then the subnormal-score routers."""
    out = []
    for name, layers in cases.items():
        for m in rows:
            row = check(name, layers["fast"][0].layer, m, device)
            row["copy_kept"] = keep_copies(layers["fast_copy"][0].layer, m, device)
            print(f"{row['check']}  {name} M={m} path={row['path']} casts={row['casts']} "
                  f"(A/B copy entry casts={row['copy_kept']})", flush=True)
            out.append(row)
    for row in subnormal_checks(device, smoke):
        verdict = "PASS" if row["ok"] else "FAIL"
        print(f"{verdict} {row['check']} bits_equal={row['bits_equal']} {row['note']}", flush=True)
        out.append(row | {"check": f"{verdict} {row['check']}"})
    return out


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/rtr51", help="the folder rtr51.json goes to")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds after which no timing round starts")
    p.add_argument("--smoke", action="store_true", help="the CPU at tiny shapes (with TRITON_INTERPRET=1)")
    return p.parse_args()


def main() -> None:
    a, start = _args(), time.monotonic()
    device = torch.device("cpu" if a.smoke else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = ROWS[:2] if a.smoke else ROWS
    cases = {name: variants_of(name, config, gate_dtype, device)
             for name, (config, gate_dtype) in configs(a.smoke).items()}
    checks = correctness(cases, rows, device, a.smoke)
    times, slots = [], [(name, m) for name in cases for m in rows]
    for i, (name, m) in enumerate(slots):  # the time left shared by the slots left (one round at the least)
        stop = time.monotonic() + max(0.0, (start + a.deadline - time.monotonic()) / (len(slots) - i))
        times.append(time_case(name, cases[name], m, device, stop, sync, 2 if a.smoke else CALLS))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    (Path(a.out) / "rtr51.json").write_text(json.dumps({"info": info, "checks": checks, "times": times}, indent=1))
    print(f"\n{info}  (µs per forward; host: until the last call returns, wall: until the device is done)")
    heads = " ".join(f"{v + ' ' + k:>14}" for v in VARIANTS for k in ("host", "wall"))
    print(f"{'case':12} {'M':>4} {'rounds':>6} {heads}")
    for r in times:
        cells = " ".join(f"{r.get(f'{v}_{k}', float('nan')):>14}" for v in VARIANTS for k in ("host", "wall"))
        print(f"{r['case']:12} {r['m']:>4} {r['rounds']:>6} {cells}")
    print(f"total {time.monotonic() - start:.1f} s", flush=True)
    sys.exit(0 if all(r["check"].startswith("PASS") for r in checks) else 1)


if __name__ == "__main__":
    main()
