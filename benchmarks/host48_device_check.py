"""host48: the decode fast path for a quantized layer with a separate shared MLP and for DeepSeek-V4's hash layer.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/host48_device_check.py --out $OUT/host48 --deadline 60   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/host48_device_check.py --smoke     # CPU (TRITON_INTERPRET=1): tiny shapes

Layers (bf16, built once):
  ds3 int4  DeepSeek-V3's routing and shapes on a 32-expert slice (K 7168, N 2048, top-8, 8 groups of 4 pick 4, the
            correction bias, routed scaling 2.5) and its shared expert (width 2048), ``router="fused"``, then
            ``quantize_("int4_w4a16", group_size=128)`` (the shared expert un-fused: a separate bf16 MLP)
  v4 hash   DeepSeek-V4's hash layer (E 256, K 4096, N 2048, top-6, sqrt(softplus), routed scaling 1.5, V 129280, a
            random table, the shared expert fused), ``HashMoE`` with the one-launch hash router
Phases (each skipped past the deadline; <out>/host48.json rewritten after each):
  check     at M = 1 and 8: the third call (served by the fast path: its entry counted) bit-equal to the full forward
            (``layer_fast.ENABLED = False``); ds3 int4 within 1e-2 rel-L2 of the bf16 layer holding its int4 weights'
            values (dequantized); v4 hash within 1e-2 of ``router="torch"`` (``hash_route``) with the same weights
  time      host and wall µs a call (``bench_run.host_and_wall_us``: interleaved rounds, medians) with the fast path off
            (before: the full forward) and on (after), M = 1 and 8
The table is printed last: medians.
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

from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases, warm_then_time  # noqa: E402

from moekit import HashMoE, MoE, MoEConfig, layer_fast  # noqa: E402

ROUNDS = 1 if SMOKE else 7
ROWS = (1, 8)
DS3_SHAPE = (16, 64, 32, 32) if SMOKE else (32, 7168, 2048, 128)  # E, K, N, int4 group
V4_SHAPE = (16, 64, 32, 50) if SMOKE else (256, 4096, 2048, 129280)  # E, K, N, V
E3, K3, N3, GROUP = DS3_SHAPE
DS3 = MoEConfig.preset("deepseek-v3").replace(hidden_size=K3, moe_intermediate_size=N3, num_experts=E3, n_group=8 if
                                              not SMOKE else 4, topk_group=4 if not SMOKE else 2,
                                              shared_expert_intermediate_size=N3)
E4, K4, N4, V = V4_SHAPE
V4_HASH = MoEConfig(hidden_size=K4, moe_intermediate_size=N4, num_experts=E4, top_k=6, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5, shared_expert_intermediate_size=N4, hash_table_size=V)
RUN = RunLog("host48: the decode fast path off / on (host / wall µs a call, medians)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 20}
LAYERS: dict = {}


def switched(fn, on: bool):
    """``fn`` with the fast path switched on or off (``layer_fast.ENABLED``: both layers' read it) for its call."""
    def call():
        layer_fast.ENABLED = on
        return fn()
    return call


def build(dev) -> dict:
    """name -> (the layer, its reference layer, the reference's tolerance), built once."""
    if not LAYERS:
        torch.manual_seed(0)
        ds3, plain = (MoE(DS3, backend="triton", router="fused", dtype=torch.bfloat16, device=dev,
                          fuse_shared=False).eval() for _ in range(2))  # quantize_ un-fuses it anyway
        ds3.e_score_correction_bias.copy_(torch.randn(E3, device=dev) * 0.1)
        plain.load_state_dict(ds3.state_dict())
        ds3.quantize_("int4_w4a16", group_size=GROUP)
        with torch.no_grad():  # the reference: bf16 experts of the int4 weights' values
            plain.w13.copy_(ds3.w13.dequantize(torch.bfloat16)), plain.w2.copy_(ds3.w2.dequantize(torch.bfloat16))
        table = torch.randint(0, E4, (V, 6), generator=torch.Generator().manual_seed(3)).to(dev)
        hashed = {}
        for router in ("fused", "torch"):
            torch.manual_seed(1)
            hashed[router] = HashMoE(V4_HASH, backend="triton", router=router, dtype=torch.bfloat16,
                                     device=dev).eval().load_table_(table)
        LAYERS.update({"ds3 int4": (ds3, plain, 1e-2), "v4 hash": (hashed["fused"], hashed["torch"], 1e-2)})
    return LAYERS


def calls(dev, m: int) -> dict:
    """name -> the layer's call on M rows (fixed inputs)."""
    g = torch.Generator().manual_seed(m)
    x3 = torch.randn(m, K3, generator=g).to(dev, torch.bfloat16)
    x4 = torch.randn(m, K4, generator=g).to(dev, torch.bfloat16)
    ids = torch.randint(0, V, (m,), generator=g).to(dev)
    layers = build(dev)
    return {"ds3 int4": (lambda layer=layers["ds3 int4"][0]: layer(x3), lambda layer=layers["ds3 int4"][1]: layer(x3)),
            "v4 hash": (lambda layer=layers["v4 hash"][0]: layer(x4, token_ids=ids),
                        lambda layer=layers["v4 hash"][1]: layer(x4, token_ids=ids))}


def entries(layer) -> dict:
    return (layer._hash_decode if isinstance(layer, HashMoE) else layer._decode)._entries


def check_phase(dev) -> None:
    res = RESULT["check"] = {}
    layers = build(dev)
    with torch.no_grad():
        for m in ROWS:
            for name, (fn, ref_fn) in calls(dev, m).items():
                layer, _, tol = layers[name]
                full = switched(fn, False)()
                on = switched(fn, True)
                on(), on()  # kept, then served
                served = on()
                kept = m in entries(layer)
                err = rel_l2(served, ref_fn())
                res[f"{name} M={m}"] = dict(kept=kept, equal=bool(torch.equal(served, full)), rel_l2_ref=err)
                RUN.check(f"{name} M={m}: kept, served == full forward bit for bit", kept and torch.equal(served, full))
                RUN.check(f"{name} M={m}: vs its reference layer", err < tol, f"rel_l2={err:.2e} (< {tol})")
    layer_fast.ENABLED = True


def time_phase(dev) -> None:
    res = RESULT["time_us"] = {}
    for m in ROWS:
        fns = {}
        for name, (fn, _) in calls(dev, m).items():
            fns |= {f"{name} off": switched(fn, False), f"{name} on": switched(fn, True)}
        res[m], med = warm_then_time(RUN, f"timing M={m}", fns, dev, 1 if SMOKE else 30, ROUNDS, 1 if SMOKE else 3)
        row = " | ".join(f"{med[n][0]:.1f} / {med[n][1]:.1f}" for n in fns)
        RUN.summary.append(f"| M={m} | {row} |")
    layer_fast.ENABLED = True


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"check": lambda: check_phase(dev), "time": lambda: time_phase(dev)}
    args = phase_args(__doc__, phases, "host48.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "ds3": list(DS3_SHAPE), "v4": list(V4_SHAPE), "phases": args.phases}
    RUN.summary.append("| M (host / wall µs a call) | ds3 int4 off (before) | ds3 int4 on (after) | v4 hash off "
                       "(before) | v4 hash on (after) |\n|---|---|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
