"""fgrad36: torch.func transforms through the Triton experts and the whole MoE layer on the GPU (``moekit.func_ops``:
under a transform the custom ops run as autograd.Functions with setup_context; the fused router, gate kernel,
one-launch route and CPU loops give way to their torch twins), and what the guards cost the eager forward.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/fgrad36_device_check.py --out $OUT/fgrad36 --deadline 72   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/fgrad36_device_check.py --smoke     # CPU: tiny shapes, Triton interpreted

Cases (``--cases``, each skipped past the deadline; <out>/fgrad36.json rewritten after each):
  experts  ``experts_triton`` bf16 (E = 16, K = 512, N = 256, k = 4, M = 64): torch.func.grad and vjp for x, w13, w2,
           topk_weights against torch.autograd.grad on the same call (rel-L2 < 1e-3) and the reference backend in
           fp32 (< 2e-2); jvp raises the backend's NotImplementedError; jacrev of the routed weights against vjp rows.
  layer    ``MoE`` on CUDA (backend and router "auto": triton, fused router), bf16, M = 8 (gate kernel, one launch)
           and 300: functional_call + grad for every parameter and x against backward() (< 1e-3) and the reference
           backend / torch router in fp32 (< 2e-2); jvp through grouped_mm + the fused router against reference +
           torch router in fp32 (< 1e-4: before, the fused launches met storage-less tensors); fp8_block weights
           refuse grad naming the kernels.
  host     the eager no_grad forward (M = 1 and 64, the decode fast path off: ``layer_fast.ENABLED``), µs host /
           wall, 5 interleaved rounds (``--rounds``): the guards as written ("after") vs each guard rebound to
           ``bool`` (a C call that returns False: main has no call there at all); then the guards a forward calls
           and ns a guard call.
The table is printed last: medians, after / before per round, rounds >= 3% faster / slower.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, case_args, host_and_wall_us, rel_l2, run_cases  # noqa: E402

E, N, K, TOP_K = (4, 128, 128, 2) if SMOKE else (16, 256, 512, 4)
MS = (3, 5) if SMOKE else (8, 300)
DTYPE = torch.float32 if SMOKE else torch.bfloat16
TOL = 1e-4 if SMOKE else 2e-2  # against fp32 reference: bf16 rounding
RUN = RunLog("fgrad36: torch.func through the experts and the layer (µs a forward, medians of interleaved rounds)",
             stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
# every module that guards with moekit.func_ops.transforming, and the name it holds it under
GUARDS = [("moekit.routing.fused", "transforming"), ("moekit.routing.gate", "transforming"),
          ("moekit.routing.gate_route", "transforming"), ("moekit.layer", "transforming"),
          ("moekit.experts.grouped_mm", "transforming"), ("moekit.experts.triton", "_transforming")]


def experts_problem(m: int, dev):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=g).to(dev, DTYPE)  # [M, K]
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dev, DTYPE)  # [E, 2N, K]
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dev, DTYPE)  # [E, K, N]
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).to(dev)  # [M, k]
    weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).to(dev, DTYPE)  # [M, k]
    dout = torch.randn(m, K, generator=g).to(dev, DTYPE)
    return (x, w13, w2, weights), ids, dout


def autograd_grads(fn, primals, ids, dout) -> tuple:
    leaves = [t.detach().clone().requires_grad_() for t in primals]
    out = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    return torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)


def experts_phase(dev) -> None:
    from moekit.experts.reference import experts_reference
    from moekit.experts.triton import experts_triton

    primals, ids, dout = experts_problem(64 if not SMOKE else 5, dev)
    call = lambda x, w13, w2, w: experts_triton(x, w13, w2, ids, w)  # noqa: E731
    got = torch.func.grad(lambda *a: (call(*a) * dout).sum(), argnums=(0, 1, 2, 3))(*primals)
    _, vjp_fn = torch.func.vjp(call, *primals)
    by_vjp = vjp_fn(dout)
    same = autograd_grads(experts_triton, primals, ids, dout)
    ref = autograd_grads(experts_reference, [t.float() for t in primals], ids, dout.float())
    res = RESULT["experts"] = {}
    for name, g, v, a, r in zip(("x", "w13", "w2", "topk_weights"), got, by_vjp, same, ref):
        res[name] = {"vs_autograd": rel_l2(g, a), "vjp_vs_autograd": rel_l2(v, a), "vs_reference": rel_l2(g, r),
                     "bit_equal": torch.equal(g, a)}
        RUN.check(f"experts {name}: func.grad / vjp vs autograd", max(res[name]["vs_autograd"],
                  res[name]["vjp_vs_autograd"]) < 1e-3, str(res[name]))
        RUN.check(f"experts {name}: func.grad vs reference fp32", res[name]["vs_reference"] < TOL)
    try:
        torch.func.jvp(call, primals, tuple(torch.ones_like(t) for t in primals))
        RUN.check("experts jvp refuses", False, "no error")
    except NotImplementedError as e:
        RUN.check("experts jvp refuses", "no forward-mode derivative" in str(e), str(e)[:80])
    RUN.log("experts: jacrev")
    per_token = lambda w: (call(primals[0], primals[1], primals[2], w) * dout).sum(dim=1)  # noqa: E731  [M]
    row = torch.func.jacrev(per_token)(primals[3]).sum(dim=0)  # [M, M, k] summed over the tokens' losses: [M, k]
    RUN.check("experts jacrev(topk_weights) vs vjp", rel_l2(row, by_vjp[3]) < 1e-2, f"{rel_l2(row, by_vjp[3]):.2e}")


def layer_pair(dev, backend: str, router: str, dtype, fuse_shared: bool = True):
    """(the layer under test, its fp32 reference twin: the same weights, reference backend, torch router). The
    router runs in fp32 in both, so a bf16 layer and its twin pick the same experts for the same (rounded) x."""
    from moekit import MoE, MoEConfig

    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, scoring="sigmoid",
                    use_correction_bias=True, shared_expert_intermediate_size=N, router_dtype="float32")
    torch.manual_seed(0)
    moe = MoE(cfg, backend=backend, router=router, dtype=dtype, device=dev, fuse_shared=fuse_shared)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(torch.randn(E, device=dev) * 0.3)
    ref = MoE(cfg, backend="reference", router="torch", dtype=torch.float32, device=dev, fuse_shared=fuse_shared)
    ref.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    return moe, ref


def layer_grads(moe, x, r):
    params = {n: p.detach() for n, p in moe.named_parameters()}
    loss = lambda p, x: (torch.func.functional_call(moe, p, (x,)) * r.to(x.dtype)).sum()  # noqa: E731
    return torch.func.grad(loss, argnums=(0, 1))(params, x)


def layer_phase(dev) -> None:
    res = RESULT["layer"] = {}
    backend, router = ("triton", "fused") if SMOKE else ("auto", "auto")
    moe, ref = layer_pair(dev, backend, router, DTYPE)
    for m in MS:
        g = torch.Generator().manual_seed(m)
        x, r = torch.randn(m, K, generator=g).to(dev, DTYPE).float(), torch.randn(m, K, generator=g).to(dev)
        got_p, got_x = layer_grads(moe, x.to(DTYPE), r)
        ref_p, ref_x = layer_grads(ref, x, r)
        moe.zero_grad()
        leaf = x.to(DTYPE).requires_grad_()
        (moe(leaf) * r.to(DTYPE)).sum().backward()
        errs = {"x": (rel_l2(got_x, leaf.grad), rel_l2(got_x, ref_x))}
        errs.update({n: (rel_l2(got_p[n], p.grad), rel_l2(got_p[n], ref_p[n])) for n, p in moe.named_parameters()})
        res[f"grad_M{m}"] = errs
        RUN.check(f"layer M={m}: func.grad vs backward()", max(e[0] for e in errs.values()) < 1e-3, str(errs))
        RUN.check(f"layer M={m}: func.grad vs reference fp32", max(e[1] for e in errs.values()) < TOL)
        RUN.log(f"layer M={m}: grads")
    jmoe, jref = layer_pair(dev, "grouped_mm", "fused", torch.float32)
    for m in MS:
        g = torch.Generator().manual_seed(m + 1)
        x, t = torch.randn(m, K, generator=g).to(dev), torch.randn(m, K, generator=g).to(dev)
        tangents = [torch.func.jvp(lambda x: torch.func.functional_call(mod, dict(mod.named_parameters()), (x,)),
                                   (x,), (t,))[1] for mod in (jmoe, jref)]
        res[f"jvp_M{m}"] = rel_l2(*tangents)
        RUN.check(f"layer M={m}: jvp grouped_mm + fused router vs reference", res[f"jvp_M{m}"] < 1e-4,
                  f"{res[f'jvp_M{m}']:.2e}")
    fp8_phase(dev)


def fp8_phase(dev) -> None:
    moe, _ = layer_pair(dev, "triton" if SMOKE else "auto", "torch", DTYPE, fuse_shared=False)  # quantize_ wants it
    moe.quantize_("fp8_block")
    params = {n: p.detach() for n, p in moe.named_parameters()}
    x = torch.randn(4, K, device=dev, dtype=DTYPE)
    try:
        torch.func.grad(lambda x: torch.func.functional_call(moe, params, (x,)).float().sum())(x)
        RUN.check("fp8_block layer refuses grad", False, "no error")
    except NotImplementedError as e:
        RUN.check("fp8_block layer refuses grad", "fp8_block kernels have no derivative" in str(e), str(e)[:80])


def guard_modules() -> list:
    import importlib

    return [(importlib.import_module(module), name) for module, name in GUARDS]


def rebind(modules: list, value) -> None:
    """Each guard's module attribute set to ``value`` (six setattrs: the same in both variants)."""
    for module, name in modules:
        setattr(module, name, value)


def host_phase(dev, rounds: int) -> None:
    import moekit.layer_fast as layer_fast

    moe, _ = layer_pair(dev, "triton" if SMOKE else "auto", "fused" if SMOKE else "auto", DTYPE)
    xs = {m: torch.randn(m, K, device=dev, dtype=DTYPE) for m in (1, 64)}
    modules = guard_modules()
    real_fn = getattr(*modules[0])  # moekit.func_ops.transforming, as every module holds it
    fns = {}
    for m, x in xs.items():
        fns[f"M={m} after"] = lambda x=x: (rebind(modules, real_fn), moe(x))
        fns[f"M={m} before"] = lambda x=x: (rebind(modules, bool), moe(x))
    layer_fast.ENABLED = False  # M = 1 through the whole forward (the decode fast path checked transforms already)
    try:
        with torch.no_grad():
            for fn in fns.values():
                fn()
            got = RESULT["host_us"] = host_and_wall_us(fns, dev, 2 if SMOKE else 200, rounds)
            counts = {"n": 0}
            rebind(modules, lambda: (counts.__setitem__("n", counts["n"] + 1), real_fn())[1])
            for m, x in xs.items():
                counts["n"] = 0
                moe(x)
                RESULT[f"guards_M{m}"] = counts["n"]
    finally:
        rebind(modules, real_fn)
        layer_fast.ENABLED = True
    start = time.perf_counter()
    for _ in range(100_000):
        real_fn()
    RESULT["ns_a_guard"] = (time.perf_counter() - start) * 1e4
    RUN.log(f"guards a forward: M=1 {RESULT['guards_M1']}, M=64 {RESULT['guards_M64']}; "
            f"{RESULT['ns_a_guard']:.0f} ns a guard")
    for m in xs:
        new, old = got[f"M={m} after"], got[f"M={m} before"]
        med = statistics.median
        RUN.summary.append(f"| host | M={m} after vs before | {med(new[0]):.1f} / {med(old[0]):.1f} | "
                           f"{med(new[1]):.1f} / {med(old[1]):.1f} | "
                           + " ".join(f"{a / b:.2f}" for a, b in zip(new[0], old[0]))
                           + f" | {wins(new[0], old[0])} / {wins(old[0], new[0])} |")


def main() -> int:
    args = case_args(__doc__, 72.0, ("experts", "layer", "host"))
    dev = torch.device("cpu" if args.smoke else "cuda")
    RESULT["shape"] = [E, N, K, TOP_K]
    RUN.summary.append("| phase | variant | host µs new / old | wall µs new / old | new / old per round | "
                       "rounds >= 3% faster / slower |\n|---|---|---|---|---|---|")
    phases = {"experts": experts_phase, "layer": layer_phase, "host": lambda dev: host_phase(dev, args.rounds)}
    run_cases(RUN, RESULT, args, "fgrad36", lambda name: phases[name](dev))
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
