"""usr42: what the second hour's fixes change on a GPU: a float32 ``MoE`` under bf16 autocast (its experts follow
autocast, on the Triton backend and through the decode fast path's misses), ``router_dtype`` inside autocast with the
fused router, ``return_stats=True`` under ``torch.compile``; then the host cost of the one check the experts calls
gained (``x.dtype is not w13.dtype``), before / after, in interleaved rounds.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/usr42_device_check.py --out $OUT/usr42 --deadline 72   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/usr42_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Phases (each skipped past the deadline; <out>/usr42.json rewritten after each):
  correct   Qwen3-30B-A3B experts (E = 128, K = 2048, N = 768, k = 8), a float32 layer given a bf16 x under bf16
            autocast at M = 1, 64, 512: out bf16 and against the same layer cast to bf16 without autocast (rel-L2
            PASS < 1e-2), three repeated no_grad calls at M = 1 equal to the first (the fast path serves only x of the
            weights' dtype), backward reaches the float32 weights; a bf16 layer with router_dtype="float32" under
            autocast: float32 logits equal to the float32 GEMM (PASS < 1e-6); return_stats=True compiled (aot_eager):
            one graph break, aux_loss equal to eager's.
  host      host µs a layer call (bf16 layer, bf16 x, no autocast, no_grad; queued behind ~1 ms of GPU work) at
            M = 1 and 512, and of ``run_experts`` at M = 1: after (this branch) against before (the experts call
            without the dtype check: ``BeforeCache``, ``call_backend_before``), 5 interleaved rounds.
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import weakref

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, host_and_wall_us, rel_l2, run_info, run_phases  # noqa: E402

from moekit import MoE, MoEConfig  # noqa: E402
from moekit.experts import _FAST_PATHS as FAST_PATHS  # noqa: E402
from moekit.experts import ExpertsCallCache, call_checked_backend, check_experts_args  # noqa: E402

ROUNDS = 2 if SMOKE else 5
E, N, K, TOP_K = (8, 32, 64, 2) if SMOKE else (128, 768, 2048, 8)
MS = (1, 5, 17) if SMOKE else (1, 64, 512)
HOST_MS = (1, 17) if SMOKE else (1, 512)
RUN = RunLog("usr42: autocast, router_dtype, return_stats compiled; host µs of the experts call's dtype check", 60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()


def config(**changes) -> MoEConfig:
    return MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, **changes)


def autocast(dev):
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def correct_phase(dev) -> None:
    res = RESULT["correct"] = {}
    torch.manual_seed(0)
    moe = MoE(config(), device=dev)  # float32
    twin = copy.deepcopy(moe)  # its experts rounded to bf16 as autocast rounds them, its gate the same float32 one
    twin.w13, twin.w2 = (torch.nn.Parameter(w.detach().bfloat16()) for w in (moe.w13, moe.w2))
    for m in MS:
        x = torch.randn(m, K, device=dev).bfloat16()
        with torch.no_grad(), autocast(dev):
            got, want = moe(x), twin(x)  # the twin's x has its experts' dtype: no cast, the same routing
        err = res[f"autocast_M{m}"] = rel_l2(got, want)
        RUN.check(f"M={m} float32 layer, bf16 x, autocast: bf16 out vs the bf16-experts twin",
                  got.dtype == torch.bfloat16 and err < 1e-2, f"{got.dtype} rel_l2={err:.2e} "
                  f"bit-equal={torch.equal(got, want)}")
    x = torch.randn(1, K, device=dev).bfloat16()
    with torch.no_grad(), autocast(dev):
        outs = [moe(x) for _ in range(4)]
    RUN.check("M=1 repeated autocast calls equal the first", all(torch.equal(o, outs[0]) for o in outs[1:]))
    x = torch.randn(8, K, device=dev).bfloat16()
    with autocast(dev):
        moe(x).float().square().sum().backward()
    RUN.check("backward reaches the float32 weights", moe.w13.grad is not None and moe.w13.grad.dtype == torch.float32
              and bool(torch.isfinite(moe.w13.grad).all()))
    routed = MoE(config(router_dtype="float32", z_loss_coef=1e-3), dtype=torch.bfloat16, device=dev)
    x = torch.randn(8, K, device=dev).bfloat16()
    with torch.no_grad(), autocast(dev):
        stats = routed(x, return_stats=True)
    want = x.float() @ routed.gate.weight.float().t()
    err = res["router_dtype"] = rel_l2(stats.router_logits, want)
    RUN.check("router_dtype float32 inside autocast: float32 logits", stats.router_logits.dtype == torch.float32
              and err < 1e-6, f"{stats.router_logits.dtype} rel_l2={err:.2e}")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(routed)(x, return_stats=True)
    compiled = torch.compile(routed, backend="aot_eager")(x, return_stats=True)
    eager = routed(x, return_stats=True)
    same = abs(compiled.aux_loss.item() - eager.aux_loss.item()) <= 1e-6 * abs(eager.aux_loss.item())
    RUN.check("return_stats compiled: one graph break, aux_loss as eager", explained.graph_break_count == 1 and same,
              f"breaks={explained.graph_break_count} aux {compiled.aux_loss.item():.6g} / {eager.aux_loss.item():.6g}")


class BeforeCache(ExpertsCallCache):
    """``ExpertsCallCache.__call__`` as main has it (87f368f6): no autocast step; the rest is the class's own."""

    __slots__ = ()

    def __call__(self, fn, x, w13, w2, topk_ids, topk_weights, *, activation, b13=None, b2=None):
        fast = FAST_PATHS.get(fn)
        if fast is not None:  # the backend's own record of this call (it checks the weights are the same)
            out = (fast(x, w13, w2, topk_ids, topk_weights, activation) if b13 is None and b2 is None
                   else fast(x, w13, w2, topk_ids, topk_weights, activation, b13=b13, b2=b2))
            if out is not None:
                return out
        if self._passed(x, (w13, w2, b13, b2)):
            return call_checked_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)
        out = call_backend_before(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)
        tensors = (w13, w2, b13, b2)
        self._refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._shapes = tuple(None if t is None else t.shape for t in tensors)
        self._dtype, self._device, self._hidden = x.dtype, x.device, x.shape[-1]
        return out


def call_backend_before(fn, x, w13, w2, topk_ids, topk_weights, *, activation="silu", expert_map=None, b13=None,
                        b2=None):
    """``call_backend`` before this branch: the check, then the backend."""
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation=activation, b13=b13, b2=b2)
    return call_checked_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                                b13=b13, b2=b2)


def host_phase(dev) -> None:
    import moekit.experts as experts

    torch.manual_seed(1)
    after = MoE(config(), dtype=torch.bfloat16, device=dev)
    before = copy.deepcopy(after)
    before._experts_call = BeforeCache()
    fns = {}
    for m in HOST_MS:
        x = torch.randn(m, K, device=dev).bfloat16()
        fns[f"layer M={m} after"] = lambda x=x: after(x)
        fns[f"layer M={m} before"] = lambda x=x: before(x)
    x = torch.randn(1, K, device=dev).bfloat16()
    ids = torch.randint(0, E, (1, TOP_K), device=dev, dtype=torch.int32)
    weights = torch.softmax(torch.randn(1, TOP_K, device=dev), -1)
    fn = experts.backend_fn("auto", dev)
    fns["run_experts M=1 after"] = lambda: experts.call_backend(fn, x, after.w13, after.w2, ids, weights)
    fns["run_experts M=1 before"] = lambda: call_backend_before(fn, x, after.w13, after.w2, ids, weights)
    with torch.no_grad():
        for name, call in fns.items():
            call()
        same = all(torch.equal(fns[f"layer M={m} after"](), fns[f"layer M={m} before"]()) for m in HOST_MS)
        RUN.check("before and after bit-equal", same and torch.equal(fns["run_experts M=1 after"](),
                                                                    fns["run_experts M=1 before"]()))
        RUN.log("host: warm")
        got = RESULT["host_us"] = host_and_wall_us(fns, dev, 3 if SMOKE else 200, ROUNDS)
    med = statistics.median
    for name in [n for n in fns if n.endswith(" after")]:
        new, old = got[name], got[name.replace(" after", " before")]
        RUN.summary.append(f"| host | {name[:-6]} | {med(new[0]):.1f} / {med(old[0]):.1f} | {med(new[1]):.1f} / "
                           f"{med(old[1]):.1f} | " + " ".join(f"{a / b:.3f}" for a, b in zip(new[0], old[0]))
                           + f" | {wins(new[0], old[0])} / {wins(old[0], new[0])} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=72.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("correct", "host"))
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K], "phases": ARGS.phases}
    RUN.summary.append("| phase | call | host µs after / before | wall µs after / before | after / before per round "
                       "| rounds >= 3% faster / slower |\n|---|---|---|---|---|---|")
    phases = {"correct": lambda: correct_phase(dev), "host": lambda: host_phase(dev)}
    return run_phases(RUN, phases, ARGS.phases, ARGS.deadline, {"host": 15},
                      ARGS.out and os.path.join(ARGS.out, "usr42.json"), RESULT)


if __name__ == "__main__":
    sys.exit(main())
