"""v4r48: DeepSeek-V4's sqrt(softplus) scoring in the fused router, and V4's layers' host time before / after it.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/v4r48_device_check.py --out $OUT/v4r48 --deadline 60   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/v4r48_device_check.py --smoke     # CPU (TRITON_INTERPRET=1): tiny shapes

Phases (each skipped past the deadline; <out>/v4r48.json rewritten after each):
  router    V4's real gate (E 256, hidden 4096, top-6, the correction bias, renormalised, routed scaling 1.5; no
            groups): logits x @ W^T of bf16 x and W (as the model computes them), then ``FusedRouter`` against
            ``route`` (its torch twin: ids equal, weights within fp32 rounding) and against a float64 twin written
            here (ids equal except where the float64 k-th and (k+1)-th choices are within 1e-5: counted; weights rel
            1e-5), at M = 1, 8, 64, 1024; and the scores at large logits (+-200, +-110, +-103, 20 +- 0.01, 89, 1e4)
            against torch's ``F.softplus(x).sqrt()`` on the GPU (its threshold 20; denormals kept: no ftz) and
            float64; the one-launch hash router (``FusedHashRouter``, V4's shared slot appended) against
            ``hash_route`` and float64 at the same M, a random table of V 129280 rows.
  layer     V4's top-k layer (E 256, K 4096, N 256 here: the router's shapes, small experts; float32, the shared
            expert fused) with ``router="fused"`` (the one gate + router launch up to 8 rows, the tensor-core one up
            to 256, the decode fast path kept) against the same layer with ``router="torch"`` (rel-L2 < 1e-5) at
            M = 1, 8, 64, its repeated call bit-equal to its first; a ``HashMoE`` with ``router="torch"`` (hash_route,
            masked_tokens None now) and ``"fused"`` (one launch) against a float64 reference.
  time      host and wall µs a call (``bench_run.host_and_wall_us``: 7 interleaved rounds, medians), bf16, the real
            V4 layer (E 256, K 4096, N 2048, top-6, V 129280): the top-k layer before (``router="torch"``: ``route``
            in torch, the full forward, as hash48 measured it) and after (``router="fused"``: the lean path); the
            hash layer with ``router="torch"`` (before) and ``"fused"`` (after). M = 1 and 32.
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

from moekit import HashMoE, MoE, MoEConfig, route  # noqa: E402
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.routing.fused import FusedRouter  # noqa: E402
from moekit.routing.hash_fused import FusedHashRouter  # noqa: E402
from moekit.routing.hash_route import hash_route  # noqa: E402
from moekit.routing.shared import append_shared_slots  # noqa: E402

ROUNDS = 2 if SMOKE else 7
E, K, N, TOP_K, V = (16, 64, 32, 6, 50) if SMOKE else (256, 4096, 2048, 6, 129280)
N_CHECK = 16 if SMOKE else 256  # the layer phase's expert width: the router's shapes, small experts
ROWS = (1, 8, 64) if SMOKE else (1, 8, 64, 1024)
TIME_ROWS = (1, 32)
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, scoring="sqrtsoftplus",
                   use_correction_bias=True, routed_scaling_factor=1.5, shared_expert_intermediate_size=N,
                   activation=ActivationSpec(name="silu", limit=10.0))  # transformers' DeepseekV4Config defaults
RUN = RunLog("v4r48: DeepSeek-V4's layers, sqrt(softplus) in the fused router (µs a call, medians)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 25, "layer": 10}
EXTREMES = [-200.0, -110.0, -103.0, -100.0, -50.0, -17.0, -1e-3, 0.0, 15.0, 19.99, 20.0, 20.01, 89.0, 1e4, 110.0, 200.0]


def sqrt_softplus64(x: torch.Tensor) -> torch.Tensor:
    """float64 sqrt(log(1 + e^x)) without overflow: max(x, 0) + log1p(e^-|x|)."""
    x = x.double()
    return (x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))).sqrt()


def twin64(logits: torch.Tensor, bias: torch.Tensor):
    """The float64 twin: scores s, the choice s + bias, top-k (stable: the lower id on a tie), weights s / sum(s) x
    the scale -> (ids [M, k], weights [M, k] float64, gap [M]: the k-th minus the (k+1)-th choice)."""
    s = sqrt_softplus64(logits)  # [M, E]
    choice = s + bias.double()
    order = torch.sort(choice, dim=1, descending=True, stable=True)
    ids = order.indices[:, :TOP_K]  # [M, k]
    w = s.gather(1, ids)
    w = w / w.sum(1, keepdim=True) * CONFIG.routed_scaling_factor
    return ids, w, order.values[:, TOP_K - 1] - order.values[:, TOP_K]


def router_phase(dev) -> None:
    res = RESULT["router"] = {}
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(E, K, generator=g) * K ** -0.5).to(dev, torch.bfloat16)  # [E, K]
    bias = (torch.randn(E, generator=g) * 0.1).to(dev)  # [E] fp32, as V4's buffer
    router = FusedRouter(CONFIG)
    for m in ROWS:
        x = torch.randn(m, K, generator=g).to(dev, torch.bfloat16)
        logits = torch.nn.functional.linear(x, weight)  # [M, E] bf16
        got, want = router(logits, bias), route(logits, CONFIG, bias)
        ids, w64, gap = twin64(logits.float(), bias)
        near = gap < 1e-5  # [M]: rows whose k-th and (k+1)-th choices are within 1e-5 (a flip is rounding)
        same_ids = bool(torch.equal(got.topk_ids, want.topk_ids))
        ids_ok = bool((got.topk_ids.long() == ids).all(1)[~near].all())
        w_err = ((got.topk_weights.double() - w64).abs() / w64.abs().clamp_min(1e-30))[~near].max().item()
        tw = (got.topk_weights - want.topk_weights).abs().max().item()
        res[m] = dict(ids_equal_route=same_ids, ids_equal_float64=ids_ok, near_rows=int(near.sum()),
                      weights_rel_float64=w_err, weights_abs_route=tw)
        RUN.check(f"fused router M={m}: ids == route, weights ~ route", same_ids and tw < 1e-6, f"max |dw|={tw:.1e}")
        RUN.check(f"fused router M={m}: vs float64 twin", ids_ok and w_err < 1e-5,
                  f"rel w={w_err:.1e}, rows within 1e-5 (not compared): {int(near.sum())}")
    extremes_check(dev, res)
    hash_router_check(dev, res, weight)


def hash_router_check(dev, res, weight) -> None:
    """The one-launch hash router (``FusedHashRouter``, the shared slot appended) against ``hash_route`` and float64
    (the table's experts, s / (sum + 1e-20) x 1.5) on V4's gate and a random table of V rows."""
    cfg = CONFIG.replace(hash_table_size=V, use_correction_bias=False)
    g = torch.Generator().manual_seed(5)
    table = torch.randint(0, E, (V, TOP_K), generator=g).to(dev)
    router = FusedHashRouter(cfg)
    for m in ROWS:
        x = torch.randn(m, K, generator=g).to(dev, torch.bfloat16)
        logits = torch.nn.functional.linear(x, weight)  # [M, E] bf16
        ids = torch.randint(0, V, (m,), generator=g).to(dev)
        got = router(logits, ids, table, append_shared=True)
        want = append_shared_slots(hash_route(logits, ids, table, cfg), cfg)
        s = sqrt_softplus64(logits.float()).gather(1, table[ids])
        w64 = s / (s.sum(1, keepdim=True) + 1e-20) * CONFIG.routed_scaling_factor
        same = bool(torch.equal(got.topk_ids, want.topk_ids))
        tw = (got.topk_weights - want.topk_weights).abs().max().item()
        err = ((got.topk_weights[:, :TOP_K].double() - w64).abs() / w64).max().item()
        res[f"hash M={m}"] = dict(ids_equal=same, weights_abs_twin=tw, weights_rel_float64=err)
        RUN.check(f"fused hash router M={m}: ids == hash_route, weights ~ it and float64", same and tw < 1e-6 and
                  err < 1e-5 and bool((got.topk_weights[:, TOP_K:] == 1).all()), f"|dw|={tw:.1e}, rel64={err:.1e}")


def extremes_check(dev, res) -> None:
    """All E experts of a 16-wide config chosen (k = 16, not renormalised), so each score comes back."""
    cfg = CONFIG.replace(num_experts=16, top_k=16, renormalize=False, routed_scaling_factor=1.0,
                         use_correction_bias=False, shared_expert_intermediate_size=0)
    x = torch.tensor([EXTREMES, [-v for v in EXTREMES]], device=dev)  # [2, 16]
    got = FusedRouter(cfg)(x)
    scores = got.topk_weights.gather(1, got.topk_ids.long().argsort(1))  # [2, 16] in expert order
    torch_fp32 = torch.nn.functional.softplus(x).sqrt()
    exact = sqrt_softplus64(x)
    d_torch = ((scores - torch_fp32).abs() - 2e-6 * torch_fp32).max().item()  # <= 0: within 2e-6 relative
    d64 = ((scores.double() - exact).abs() - 2e-6 * exact).max().item()  # <= 0: within 2e-6 relative
    res["extremes"] = dict(abs_vs_torch=d_torch, excess_vs_float64=d64)
    # torch's CPU kernel (the smoke) flushes some denormals of e^x: its score at -103 is 0, the kernel's 3.7e-23
    limit = 5e-23 if dev.type == "cpu" else 1e-23
    RUN.check("sqrt(softplus) at large logits vs torch on the device (2e-6 rel)", d_torch <= limit, f"{d_torch:.1e}")
    RUN.check("sqrt(softplus) at large logits vs float64 (2e-6 rel, denormal ulps)", d64 <= 1e-23, f"{d64:.1e}")


def reference(moe: MoE, x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], experts rows [M, k], weights w [M, k] float64 -> [M, K] float64, the shared MLP unweighted; the
    clamped SwiGLU act(g.clamp(max=L)) * u.clamp(-L, L) at the config's limit."""
    xd, limit = x.double(), CONFIG.activation.limit

    def mlp(w13, w2, v):  # w13 [.., 2n, K], w2 [.., K, n], v [.., K]
        h = (w13.double() @ v.unsqueeze(-1)).squeeze(-1)  # [.., 2n]
        g, u = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
        return (w2.double() @ act.unsqueeze(-1)).squeeze(-1)  # [.., K]

    out = mlp(moe.shared_w13, moe.shared_w2, xd)  # [M, K]
    for j in range(rows.shape[1]):
        out = out + w[:, j:j + 1] * mlp(moe.w13[rows[:, j]], moe.w2[rows[:, j]], xd)
    return out


def layer_phase(dev) -> None:
    res = RESULT["layer"] = {}
    cfg = CONFIG.replace(moe_intermediate_size=N_CHECK, shared_expert_intermediate_size=N_CHECK)
    layers = {}
    for router in ("fused", "torch"):
        torch.manual_seed(0)
        layers[router] = MoE(cfg, backend="triton", router=router, device=dev).eval()
        layers[router].e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(1)) * .1)
    fast, slow = layers["fused"], layers["torch"]
    with torch.no_grad():
        for m in ROWS[:3]:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dev)
            first, again, want = fast(x), fast(x), slow(x)
            kept = fast._decode._entries.get(m) is not None
            err = res[f"fused vs torch M={m}"] = rel_l2(again, want)
            RUN.check(f"V4 layer M={m}: fused router (fast path) vs torch router", err < 1e-5 and kept and bool(
                torch.equal(first, again)), f"rel_l2={err:.2e}, kept={kept}, repeat bit-equal")
        for router in ("torch", "fused"):
            torch.manual_seed(0)
            hashed = HashMoE(cfg.replace(hash_table_size=V, use_correction_bias=False), backend="triton", device=dev,
                             fuse_shared=False, router=router).eval()
            g = torch.Generator().manual_seed(2)
            hashed.load_table_(torch.randint(0, E, (V, TOP_K), generator=g).to(dev))
            x = torch.randn(13, K, generator=g).to(dev)
            ids = torch.randint(0, V, (13,), generator=g).to(dev)
            rows = hashed.tid2eid[ids]  # [M, k]
            s = sqrt_softplus64(x.double() @ hashed.gate.weight.double().T).gather(1, rows)
            w = s / (s.sum(1, keepdim=True) + 1e-20) * CONFIG.routed_scaling_factor
            err = res[f"hash {router} vs float64"] = rel_l2(hashed(x, token_ids=ids), reference(hashed, x, rows, w))
            RUN.check(f"HashMoE(router={router!r}) vs float64", err < 1e-5, f"rel_l2={err:.2e}")


def time_phase(dev) -> None:
    res = RESULT["time_us"] = {}
    layers = {}
    for router in ("torch", "fused"):
        torch.manual_seed(0)
        layers[f"top-k {router}"] = MoE(CONFIG, router=router, dtype=torch.bfloat16, device=dev).eval()
    hashed = {}
    for router in ("torch", "fused"):
        torch.manual_seed(0)
        hashed[f"hash {router}"] = HashMoE(CONFIG.replace(hash_table_size=V, use_correction_bias=False), router=router,
                                           dtype=torch.bfloat16, device=dev).eval()
        hashed[f"hash {router}"].load_table_(torch.randint(0, E, (V, TOP_K), generator=torch.Generator().manual_seed(3))
                                             .to(dev))
    for m in TIME_ROWS:
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, V, (m,), device=dev)
        fns = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
        fns |= {name: (lambda layer=layer: layer(x, token_ids=ids)) for name, layer in hashed.items()}
        res[m], med = warm_then_time(RUN, f"timing M={m}", fns, dev, 5 if SMOKE else 30, ROUNDS)
        row = " | ".join(f"{med[n][0]:.1f} / {med[n][1]:.1f}" for n in ("top-k torch", "top-k fused", "hash torch",
                                                                         "hash fused"))
        RUN.summary.append(f"| M={m} | {row} |")
    RESULT["kept"] = {m: layers["top-k fused"]._decode._entries.get(m) is not None for m in TIME_ROWS}
    RUN.check("the fused V4 layer kept its decode entries", all(RESULT["kept"].values()), str(RESULT["kept"]))


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"router": lambda: router_phase(dev), "time": lambda: time_phase(dev), "layer": lambda: layer_phase(dev)}
    args = phase_args(__doc__, phases, "v4r48.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, K, N, TOP_K, V], "phases": args.phases}
    RUN.summary.append("| M (host / wall µs a call) | top-k router=torch (before) | top-k fused (after) | hash "
                       "router=torch (before) | hash fused (after) |\n|---|---|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
