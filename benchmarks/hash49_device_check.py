"""hash49: DeepSeek-V4's hash layer on the top-k layer's decode stages (the gate kernel, the router's own device-side
asserts, the fast path tried first) and the offloaded hash layer on the one-launch router; host time before / after.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/hash49_device_check.py --out $OUT/hash49 --deadline 65   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/hash49_device_check.py --smoke     # CPU (TRITON_INTERPRET=1): tiny shapes

Layers (bf16, one set of weights: V4's E 256, K 4096, N 2048, top-6, sqrt(softplus), routed scaling 1.5, the shared
expert fused, V 129280 and a random table; offloaded: E 64, K 2048, N 1024 as hash48's, every expert cached):
  hash        ``HashMoE`` as this tree builds it (router "auto" on CUDA: the gate kernel up to 8 rows, the one-launch
              hash router asserting in its kernel, the fast path tried before forward's checks, its gate, router and
              experts' launches joined in one C call)
  hash48      the same weights with session 48's stages: ``_gate_fn = None`` (F.linear) and
              ``FusedHashRouter(assert_in_kernel=False)`` (its flags and two torch._assert_async; so nothing joined);
              forward's order is this tree's (its checks after the fast path: not in this A/B, the CPU harness
              measures it)
  unjoined    hash with ``layer_fast.JOINED`` off when its entries are kept: its launches one by one (the join's share)
  topk        V4's top-k layer (the correction bias) on the same experts: ``layer_fast``, the reference
  off hash48  ``OffloadedMoE.from_moe(hash)`` with ``router = "torch"``: what session 48's got (``from_moe`` handed it
              MoE's "torch"); off hash: this tree's (the HashMoE's "auto"); off topk: the top-k layer offloaded
Phases (each skipped past the deadline; <out>/hash49.json rewritten after each):
  check     at M = 1 and 8: hash's third call (served: its entry kept) bit-equal to its full forward (fast path off)
            and within 1e-2 rel-L2 of a float64 per-token loop written here; hash48 within 1e-2 of it too; the
            offloaded hash (this tree's router) within 1e-2 of float64; a bf16 top-k layer with Qwen2-MoE's separate
            gated shared MLP served (its launches joined on a GPU) == its full forward, within 1e-2 of float64; and,
            started after M = 1's checks and collected last (time-boxed: 30 s for both), two child processes (V4's
            layer at M = 1, the parent's kernels from Triton's cache), each serving a call with an id outside the
            table / a NaN in x after two good ones: each must end in a device-side assert (its message reported)
  time      host and wall µs a call (``bench_run.host_and_wall_us``: interleaved rounds, medians) at M = 1 and 8
  graph     CUDA-graph replay µs of hash and hash48 (GPU time: the gate kernel against cuBLAS), outputs equal to eager
The table is printed last: medians.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases, smoke_mode, warm_then_time  # noqa: E402

SMOKE = smoke_mode()  # before moekit imports its kernels
from host48_device_check import switched  # noqa: E402

from moekit import HashMoE, MoE, MoEConfig, layer_fast  # noqa: E402
from moekit.offload import OffloadedMoE  # noqa: E402
from moekit.routing.hash_fused import FusedHashRouter  # noqa: E402

ROUNDS = 1 if SMOKE else 7
ROWS = (1, 8)
E, K, N, V = (16, 64, 32, 50) if SMOKE else (256, 4096, 2048, 129280)
OFF_E, OFF_K, OFF_N = (16, 64, 32) if SMOKE else (64, 2048, 1024)
HASH = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=6, scoring="sqrtsoftplus",
                 routed_scaling_factor=1.5, shared_expert_intermediate_size=N, hash_table_size=V)
TOPK = HASH.replace(hash_table_size=None, use_correction_bias=True)
OFF_HASH = HASH.replace(hidden_size=OFF_K, moe_intermediate_size=OFF_N, num_experts=OFF_E,
                        shared_expert_intermediate_size=OFF_N)
RUN = RunLog("hash49: V4 hash layers before / after (host / wall µs a call; graph: replay µs; medians)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 12, "graph": 6}  # ~6 s and ~3 s measured
LAYERS: dict = {}


def _hash(config: MoEConfig, dev, table: torch.Tensor) -> HashMoE:
    torch.manual_seed(1)
    router = "fused" if SMOKE else "auto"  # interpreted on the CPU: "auto" would take the torch twin
    return HashMoE(config, backend="triton", router=router, dtype=torch.bfloat16, device=dev).eval().load_table_(table)


def _share(layer, source) -> None:
    """``layer`` reads ``source``'s gate and experts (one copy of V4's 13 GB of experts)."""
    layer.gate.weight, layer.w13, layer.w2 = source.gate.weight, source.w13, source.w2


def build(dev) -> dict:
    if LAYERS:
        return LAYERS
    table = torch.randint(0, E, (V, 6), generator=torch.Generator().manual_seed(3)).to(dev)
    hashed = _hash(HASH, dev, table)
    hash48 = _hash(HASH, dev, table)
    _share(hash48, hashed)  # one at a time: its own experts freed before the next is built
    unjoined = _hash(HASH, dev, table)
    _share(unjoined, hashed)
    hash48._gate_fn, hash48._hash_router = None, FusedHashRouter(HASH, assert_in_kernel=False)
    topk = MoE(TOPK, backend="triton", router="fused", dtype=torch.bfloat16, device=dev).eval()
    _share(topk, hashed)
    topk.e_score_correction_bias.copy_(torch.randn(E, device=dev) * 0.1)
    small = _hash(OFF_HASH, dev, table % OFF_E)
    off = {name: OffloadedMoE.from_moe(small, cache_experts=OFF_E, prefetch=None) for name in ("hash48", "hash")}
    off["hash48"].router = "torch"
    small_topk = MoE(OFF_HASH.replace(hash_table_size=None), backend="triton", router="fused",
                     dtype=torch.bfloat16, device=dev).eval()
    small_topk.load_state_dict({k: v for k, v in small.state_dict().items() if k != "tid2eid"})
    off["topk"] = OffloadedMoE.from_moe(small_topk, cache_experts=OFF_E, prefetch=None)
    LAYERS.update(hash=hashed, hash48=hash48, unjoined=unjoined, topk=topk, off=off, small=small)  # small: the
    # offloaded layers' reference
    return LAYERS


def loop64(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The hash layer per token in float64: sum over tid2eid[id] of w / (sum w) x 1.5 x w2 @ (silu(gate) * up), w =
    sqrt(softplus(logit)), + the fused shared slots (weight 1). x [M, K], ids [M] -> [M, K] float64."""
    c, n = layer.config, layer.config.moe_intermediate_size
    logits = x.double() @ layer.gate.weight.double().t()  # [M, E]
    out = []
    for t in range(x.shape[0]):
        row = layer.tid2eid[ids[t]].tolist()
        s = torch.nn.functional.softplus(logits[t]).sqrt()  # [E]
        experts = [(i, float(s[i]) / (sum(float(s[j]) for j in row) + 1e-20) * c.routed_scaling_factor) for i in row]
        experts += [(i, 1.0) for i in range(c.num_experts, layer.w13.shape[0])]
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for i, w in experts:
            h = layer.w13[i].double() @ x[t].double()  # [2N]
            acc += w * (layer.w2[i].double() @ (torch.nn.functional.silu(h[:n]) * h[n:]))
        out.append(acc)
    return torch.stack(out)


def inputs(dev, m: int, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return torch.randn(m, k, generator=g).to(dev, torch.bfloat16), torch.randint(0, V, (m,), generator=g).to(dev)


def _child(case: str) -> subprocess.Popen:
    """This script in a child process that serves a bad call (``case``: "ids" or "nan") after keeping its entry."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bad", case], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def bad_call(case: str) -> int:
    """The child: V4's hash layer at M = 1 (on CUDA the parent's kernels, from Triton's disk cache), two good calls
    (kept, served), then the bad one. With --smoke on the CPU (interpreted): the twin's ValueError instead."""
    dev = torch.device("cpu" if SMOKE else "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    layer = _hash(HASH, dev, torch.randint(0, E, (V, 6), generator=torch.Generator().manual_seed(3)).to(dev))
    x, ids = inputs(dev, 1)
    with torch.no_grad():
        layer(x, token_ids=ids), layer(x, token_ids=ids)
        sync()
        print(f"kept: {1 in layer._hash_decode._entries}", flush=True)
        bad_x, bad_ids = (x, torch.full_like(ids, V)) if case == "ids" else (torch.full_like(x, float("nan")), ids)
        try:
            layer(bad_x, token_ids=bad_ids)
            sync()
        except (RuntimeError, ValueError) as exc:
            print(f"RAISED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            ctypes.CDLL(None).fflush(None)  # the device's assert message, in C's stdout buffer
            os._exit(0)  # the CUDA context is lost: no teardown
    print("NOT RAISED", flush=True)
    return 1


def check_phase(dev) -> None:
    res = RESULT["check"] = {}
    RUN.log("building the layers")
    layers = build(dev)
    hashed, off = layers["hash"], layers["off"]["hash"]
    children = {}
    with torch.no_grad():
        for m in ROWS:
            if m == 8 and not SMOKE:  # M = 1's kernels are compiled (on disk): the children load them
                children = {case: _child(case) for case in ("ids", "nan")}
                RUN.log("asserts: two children started, alongside the checks (nothing timed meanwhile)")
            RUN.log(f"check M={m} (the first calls compile)")
            x, ids = inputs(dev, m)
            full = switched(lambda: hashed(x, token_ids=ids), False)()
            on = switched(lambda: hashed(x, token_ids=ids), True)
            on(), on()  # kept, then served
            served = on()
            kept = m in hashed._hash_decode._entries
            joined = kept and hashed._hash_decode._entries[m].joint is not None  # gate, router, experts: one C call
            ref = loop64(hashed, x, ids)
            err, err48 = rel_l2(served, ref), rel_l2(layers["hash48"](x, token_ids=ids), ref)
            xs = x[:, :OFF_K].contiguous()
            err_off = rel_l2(off(xs, token_ids=ids), loop64(layers["small"], xs, ids))
            res[f"M={m}"] = dict(kept=kept, joined=joined, equal=bool(torch.equal(served, full)), rel_l2=err,
                                 rel_l2_hash48=err48, rel_l2_offloaded=err_off)
            RUN.check(f"hash M={m} (joined: {joined}): kept, served == full forward bit for bit",
                      kept and torch.equal(served, full))
            RUN.check(f"hash M={m}: vs float64", err < 1e-2, f"rel_l2={err:.2e}")
            RUN.check(f"hash48 M={m}: vs float64", err48 < 1e-2, f"rel_l2={err48:.2e}")
            RUN.check(f"offloaded hash M={m} (one-launch router: {off._hash_router is not None}): vs float64",
                      err_off < 1e-2 and (SMOKE or off._hash_router is not None), f"rel_l2={err_off:.2e}")
    RUN.log("check: top-k + separate shared MLP")
    shared_check(dev, res)
    layer_fast.ENABLED = True
    collect_children(children)


def collect_children(children: dict) -> None:
    """The bad-call children's verdicts, each time-boxed (a hung child is killed and reported)."""
    res = RESULT["asserts"] = {}
    until = time.perf_counter() + 30  # both children together
    for case, child in children.items():
        RUN.log(f"asserts: waiting for child {case} (time-boxed: 30 s for both)")
        try:
            text = child.communicate(timeout=max(1.0, until - time.perf_counter()))[0]
        except subprocess.TimeoutExpired:
            child.kill()
            text = "TIMED OUT: " + (child.communicate()[0] or "")
        want = "token_ids outside" if case == "ids" else "router_logits contains NaN"
        ok = "RAISED" in text and "device-side assert" in text
        res[case] = text[-600:]
        RUN.check(f"a served call with bad {case}: a device-side assert", ok, f"the kernel's message '{want}' in the "
                  f"child's output: {want in text}; {text.strip().splitlines()[-1][:160] if text.strip() else ''}")


def shared_check(dev, res: dict) -> None:
    """A bf16 top-k layer with Qwen2-MoE's separate, sigmoid-gated shared MLP on ``layer_fast``: where its gate +
    router launch joins the experts' one C call (a GPU), the served call still adds the shared MLP (host48 dropped it
    there): equal to the full forward, within 1e-2 of a float64 twin of the routed experts plus the shared MLP."""
    cfg = MoEConfig(hidden_size=OFF_K, moe_intermediate_size=OFF_N, num_experts=OFF_E, top_k=4,
                    shared_expert_intermediate_size=OFF_N, shared_expert_gate=True)
    torch.manual_seed(2)
    layer = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16, device=dev, fuse_shared=False).eval()
    x = inputs(dev, 2, OFF_K)[0]
    with torch.no_grad():
        full = switched(lambda: layer(x), False)()
        on = switched(lambda: layer(x), True)
        on(), on()
        served, entry = on(), layer._decode._entries.get(2)
        routing = layer.route_tokens(x).routing
        xd, w13, w2 = x.double(), layer.w13.double(), layer.w2.double()
        ref = torch.zeros_like(xd)
        for t in range(x.shape[0]):
            for i, w in zip(routing.topk_ids[t].tolist(), routing.topk_weights[t].tolist()):
                h = w13[i] @ xd[t]
                ref[t] += w * (w2[i] @ (torch.nn.functional.silu(h[:OFF_N]) * h[OFF_N:]))
        h = xd @ layer.shared_w13.double().t()  # [M, 2 SN]
        shared = (torch.nn.functional.silu(h[:, :OFF_N]) * h[:, OFF_N:]) @ layer.shared_w2.double().t()
        ref += torch.sigmoid(xd @ layer.shared_gate.weight.double().t()) * shared
    joined = entry is not None and entry.joint is not None
    err = rel_l2(served, ref)
    res["shared mlp"] = dict(joined=joined, equal=bool(torch.equal(served, full)), rel_l2=err)
    RUN.check(f"top-k + separate gated shared MLP (joined: {joined}): served == full forward",
              torch.equal(served, full))
    RUN.check("top-k + separate gated shared MLP: vs float64", err < 1e-2, f"rel_l2={err:.2e}")


def without_join(fn):
    """``fn`` with ``layer_fast.JOINED`` off for its call (read when an entry is kept: its first)."""
    def call():
        layer_fast.JOINED = False
        try:
            return fn()
        finally:
            layer_fast.JOINED = True
    return call


def time_phase(dev) -> None:
    res = RESULT["time_us"] = {}
    layers = build(dev)
    for m in ROWS:
        x, ids = inputs(dev, m)
        xs = x[:, :OFF_K].contiguous()
        off = layers["off"]
        fns = {"topk": lambda: layers["topk"](x), "hash48": lambda: layers["hash48"](x, token_ids=ids),
               "hash unjoined": without_join(lambda: layers["unjoined"](x, token_ids=ids)),
               "hash": lambda: layers["hash"](x, token_ids=ids), "off topk": lambda: off["topk"](xs),
               "off hash48": lambda: off["hash48"](xs, token_ids=ids),
               "off hash": lambda: off["hash"](xs, token_ids=ids)}
        res[m], med = warm_then_time(RUN, f"timing M={m}", fns, dev, 1 if SMOKE else 30, ROUNDS, 1 if SMOKE else 3)
        RUN.summary.append(f"| M={m} | " + " | ".join(f"{med[n][0]:.1f} / {med[n][1]:.1f}" for n in fns) + " |")


def graph_phase(dev) -> None:
    """CUDA-graph replay of hash and hash48 (the full forward captured: the fast path stands aside in a capture)."""
    res = RESULT["graph_us"] = {}
    layers = build(dev)
    for m in ROWS:
        x, ids = inputs(dev, m)
        graphs, times = {}, {}
        with torch.no_grad():
            for name in ("hash48", "hash"):
                RUN.log(f"graph {name} M={m}: capture")
                layer = layers[name]
                eager = layer(x, token_ids=ids)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = layer(x, token_ids=ids)
                graph.replay()
                torch.cuda.synchronize()
                RUN.check(f"graph {name} M={m}: replay == eager", torch.equal(out, eager))
                graphs[name], times[name] = graph, []
        for _ in range(ROUNDS):
            for name, graph in graphs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / 20)
        res[m] = times
        RUN.summary.append(f"| graph M={m} | hash48 {statistics.median(times['hash48']):.1f} | hash "
                           f"{statistics.median(times['hash']):.1f} |")


def main() -> int:
    if "--bad" in sys.argv:
        return bad_call(sys.argv[sys.argv.index("--bad") + 1])
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"check": lambda: check_phase(dev), "time": lambda: time_phase(dev)}
    if not SMOKE:
        phases["graph"] = lambda: graph_phase(dev)
    args = phase_args(__doc__, phases, "hash49.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "phases": args.phases, "v4": [E, K, N, V],
                     "offloaded": [OFF_E, OFF_K, OFF_N]}
    RUN.summary.append("| M (host / wall µs a call) | topk | hash48 (before) | hash unjoined | hash (after) | off topk "
                       "| off hash48 (before) | off hash (after) |\n|---|---|---|---|---|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
