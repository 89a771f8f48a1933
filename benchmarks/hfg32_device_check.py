"""The real client on the GPU: transformers' eager decode (``generate``, batch 1) of the ``moekit bench --hf`` Qwen3
model (8 Qwen3-MoE layers at Qwen3-30B-A3B widths, random weights, bf16) through moekit, and where the experts call's
time goes (mission "measure in the real client"; ``hfg32_probes`` holds what is installed in the client).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/hfg32_device_check.py --out $OUT/hfg32 --deadline 66   # H200
    PYTHONPATH=$PWD python3 benchmarks/hfg32_device_check.py --smoke     # CPU: 1 tiny layer, Triton interpreted

Phases (each skipped past the deadline; the JSON <out>/hfg32.json rewritten after each):
  correctness  the experts call transformers makes at decode (layer 0, M = 1, captured with its dtypes and strides):
               moekit's forward, the candidate ``moekit_cc`` (the module's own ``ExpertsCallCache``: the check once
               per weight set) and ``grouped_mm`` against a float64 loop (rel-L2 PASS < 1e-2), moekit_cc
               bit-equal to moekit; the prompt's logits of each and of ``moekit_block`` (each layer's block
               replaced by ``moe_from_hf``'s MoE: moekit's router and layer decode fast path) against transformers'
               eager (< 3e-2); ``moekit_blocks`` (session 33: ``moekit.hf.use_moekit_blocks``, the same MoEs
               behind the blocks' own modules) bit-equal to moekit_block.
  decode       ms per decode step (a logits processor stamps each step; median over a 33-token generate), the
               implementations (--impls) interleaved, --rounds rounds, the order turned each round; moekit's gap to
               the ceiling (``no_experts``: experts returning zeros), moekit_cc's wins over moekit, moekit_block's
               and moekit_blocks' over moekit, moekit_blocks' against moekit_block (rounds >= 3% faster).
  host         host µs of each M = 1 experts call inside the decode (the call timed in place), moekit's forward by
               step (plan, backend_fn, check, backend call, run_fast in it) and the triton backend's
               routes (fast path hits / misses, full path).
  alone        the captured call alone, eager: host µs (16 calls queued behind 1 ms of GPU work) and wall µs, through
               each layer of the path (the hf forward, ``call_backend``, the backend function as ``moekit bench``
               calls it) and with the bench's own inputs (int32 ids, float32 weights); GPU µs in CUDA-graph replay.
  profile      ``torch.profiler`` of a 5-token generate per implementation: per M = 1 experts call the host µs,
               launches, syncs, allocator events and aten ops (medians), its GPU µs; per step GPU µs and kernels.
--phases picks the phases after decode (default host,alone,profile). The table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hfg32_probes as probes  # noqa: E402
from bench_rounds import eager_us, graph_of, interleaved, wins  # noqa: E402
from bench_run import RunLog, rel_l2, run_info, write_json  # noqa: E402

DECODE_IMPLS = ("moekit", "moekit_cc", "moekit_block", "moekit_blocks", "grouped_mm", "no_experts")
HOST_IMPLS = ("moekit", "moekit_cc", "grouped_mm", "no_experts", "moekit_staged")  # experts implementations
ROUNDS, TOKENS, HOST_TOKENS, TOL = (2, 3, 3, 1e-2) if SMOKE else (5, 33, 17, 1e-2)
RUN = RunLog("hfg32: transformers Qwen3-MoE eager decode through moekit (medians; µs unless said)", stall_s=40.0)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()  # main's options


def dump() -> None:
    if ARGS.out:
        write_json(os.path.join(ARGS.out, "hfg32.json"), RESULT)


def build():
    """The model (the bench's: ``hf_models``), a 16-token prompt, the device."""
    import moekit.experts as experts
    import moekit.hf as mh
    from moekit.bench.hf_models import build_model, hf_config

    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:  # the CUDA default's backend, interpreted
        mh.HF_BACKEND = "triton"
        experts._RESOLVED.clear()
    config = hf_config("qwen3", 1 if SMOKE else 8, tiny=SMOKE)
    model = build_model(config, torch.bfloat16, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=g).to(dev)
    return model, prompt, dev


def generate(model, impl: str, prompt, tokens: int, clock=None):
    from transformers import LogitsProcessorList

    BLOCKS.use(impl)
    model.set_experts_implementation(_experts_impl(impl))
    kwargs = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, disable_compile=True)
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    with torch.no_grad():
        return model.generate(prompt, **kwargs)


class Blocks:
    """Each decoder layer's transformers MoE block and, made on first use, moekit's ``MoE`` of it (``moe_from_hf``: the
    same Parameters, the layer's decode fast path): ``use("moekit_block")`` puts the MoEs in, any other name the
    blocks back; ``use("moekit_blocks")`` switches the blocks to moekit's forward (``use_moekit_blocks``, once)."""

    def __init__(self):
        self.layers, self.hf, self.moe = [], [], None

    def bind(self, model) -> None:
        self.layers = list(model.model.layers)
        self.hf = [layer.mlp for layer in self.layers]

    def use(self, impl: str) -> None:
        from moekit.hf import moe_from_hf, use_moekit_blocks
        from moekit.hf.swap import set_blocks_active

        if impl == "moekit_block" and self.moe is None:
            self.moe = [moe_from_hf(block) for block in self.hf]
        for layer, mlp in zip(self.layers, self.moe if impl == "moekit_block" else self.hf):
            layer.mlp = mlp
        for layer in self.layers:  # after the blocks are back in place
            if not set_blocks_active(layer, impl == "moekit_blocks") and impl == "moekit_blocks":
                use_moekit_blocks(layer)


BLOCKS = Blocks()


def _experts_impl(impl: str) -> str:
    return "moekit" if impl in ("moekit_block", "moekit_blocks") else impl


def capture(model, prompt) -> tuple:
    """(layer 0's experts module, x, ids, weights) of its last M = 1 call in a moekit decode."""
    module, seen = model.model.layers[0].mlp.experts, []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args) if args[0].shape[0] == 1 else None)
    generate(model, "moekit", prompt, 3)
    handle.remove()
    x, ids, w = seen[-1]
    RESULT["run"]["call"] = {"x": [str(x.dtype), list(x.shape), list(x.stride())], "ids": [str(ids.dtype),
                             list(ids.shape)], "weights": [str(w.dtype), list(w.shape)]}
    RUN.log(f"transformers' call: {RESULT['run']['call']}")
    return module, x, ids, w


def correctness(model, prompt, call) -> None:
    import moekit.hf as mh
    from moekit.experts.reference import experts_reference
    from transformers.integrations.moe import grouped_mm_experts_forward

    module, x, ids, w = call
    uniq, local = ids.unique(return_inverse=True)
    with torch.no_grad():
        ref = experts_reference(x.double(), module.gate_up_proj[uniq].double(), module.down_proj[uniq].double(),
                                local, w.double())
        outs = {"moekit": mh.moekit_experts_forward(module, x, ids, w),
                "moekit_cc": probes.cc_forward(module, x, ids, w),
                "grouped_mm": grouped_mm_experts_forward(module, x, ids, w)}
        logits = {}
        for impl in ("eager", "moekit", "moekit_cc", "grouped_mm", "moekit_block", "moekit_blocks"):
            BLOCKS.use(impl)
            model.set_experts_implementation(_experts_impl(impl))
            logits[impl] = model(prompt).logits.float()
        BLOCKS.use("moekit")
    res = RESULT["correctness"] = {}
    for name, out in outs.items():
        err = rel_l2(out, ref)
        res[name] = {"rel_l2_vs_fp64": err, "logits_rel_l2_vs_eager": rel_l2(logits[name], logits["eager"])}
        RUN.check(f"decode call {name} vs float64", err < TOL, f"rel_l2={err:.2e}, prompt logits vs eager "
                  f"{res[name]['logits_rel_l2_vs_eager']:.2e}")
    RUN.check("moekit_cc bit-equal to moekit", torch.equal(outs["moekit_cc"], outs["moekit"])
              and torch.equal(logits["moekit_cc"], logits["moekit"]))
    err = res["moekit_block_logits_rel_l2_vs_eager"] = rel_l2(logits["moekit_block"], logits["eager"])
    RUN.check("moekit_block prompt logits vs eager", err < 3e-2, f"rel_l2={err:.2e}")
    RUN.check("moekit_blocks bit-equal to moekit_block", torch.equal(logits["moekit_blocks"], logits["moekit_block"]))


def decode_rounds(model, prompt) -> dict:
    """impl -> [ms a decode step, each round]."""
    names = ARGS.impls
    per = {n: [] for n in names}
    for r in range(ARGS.rounds):
        if r and RUN.elapsed() > ARGS.deadline - 4 - 4 * len(ARGS.phases):  # ~4 s a later phase
            RUN.log(f"decode: deadline, {r} rounds")
            break
        for n in names[r % len(names):] + names[:r % len(names)]:
            clock = probes.StepClock()
            generate(model, n, prompt, TOKENS, clock)
            per[n].append(statistics.median(clock.steps_ms()))
        RUN.log(f"decode round {r}: " + ", ".join(f"{n} {v[-1]:.3f} ms" for n, v in per.items()))
    RESULT["decode_ms_per_step"] = per
    return per


def host_split(model, prompt) -> None:
    """The experts calls timed in place in a decode per implementation (two passes, interleaved), and moekit's
    forward by step with the backend's routes."""
    probes.clear()
    routes = {}
    for _ in range(2):
        for n in [n for n in HOST_IMPLS if n in ARGS.impls or n == "moekit_staged"]:
            before = dict(probes.ROUTES)
            generate(model, f"t_{n}", prompt, HOST_TOKENS)
            routes[n] = {k: v - before.get(k, 0) for k, v in probes.ROUTES.items()}
    RESULT["host_us_in_client"] = {n: probes.us_summary(v) for n, v in probes.HOST.items()}
    RESULT["moekit_stages_us"] = {n: probes.us_summary(v) for n, v in probes.STAGES.items()}
    RESULT["routes_last_pass"] = routes
    for n, s in RESULT["host_us_in_client"].items():
        RUN.log(f"host in client {n}: {s}")
    for n, s in RESULT["moekit_stages_us"].items():
        RUN.log(f"moekit stage {n}: {s}")
    RUN.log(f"routes ({HOST_TOKENS}-token generate: 1 prefill + {HOST_TOKENS - 1} steps a layer): {routes}")


def alone(call, dev) -> None:
    """The captured call alone: eager host / wall µs through each layer of the path, and GPU µs in graph replay."""
    import moekit.hf as mh
    from moekit.bench.cells import Shape, make_sets
    from moekit.bench.hf_models import _no_experts_forward
    from moekit.experts import backend_fn, call_backend
    from transformers.integrations.moe import grouped_mm_experts_forward

    module, x, ids, w = call
    fn = backend_fn(mh.HF_BACKEND, dev)
    act = module.__dict__[mh.PLAN_ATTR].activation
    w13, w2 = module.gate_up_proj, module.down_proj
    sets = [] if SMOKE else make_sets(Shape.from_preset("qwen3-30b-a3b"), 1, 3, x.dtype, dev)  # the bench's M = 1
    calls = {
        "hf forward moekit": [lambda: mh.moekit_experts_forward(module, x, ids, w)],
        "hf forward moekit_cc": [lambda: probes.cc_forward(module, x, ids, w)],
        "call_backend": [lambda: call_backend(fn, x, w13, w2, ids, w, activation=act)],
        "backend fn (bench's call)": [lambda: fn(x, w13, w2, ids, w, activation=act)],
        "bench inputs (int32, fp32)": [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets],
        "grouped_mm forward": [lambda: grouped_mm_experts_forward(module, x, ids, w)],
        "no_experts forward": [lambda: _no_experts_forward(module, x, ids, w)],
    }
    calls = {k: v for k, v in calls.items() if v}
    if SMOKE:
        RESULT["alone"] = {k: [f() is not None for f in v] for k, v in calls.items()}
        return
    with torch.no_grad():
        for fns in calls.values():
            for f in fns:
                f()
        got = eager_us(calls, ROUNDS, 16)
        RESULT["alone"] = {k: {"host_us": round(h, 2), "wall_us": round(wl, 2)} for k, (h, wl) in got.items()}
        for k, (h, wl) in got.items():
            RUN.log(f"alone {k}: host {h:.1f} µs, wall {wl:.1f} µs")
        graphs = {k: graph_of(calls[k], dev) for k in ("backend fn (bench's call)", "grouped_mm forward")}
        gpu = interleaved(graphs, 1, dev, ROUNDS, 20)
    RESULT["alone_gpu_us_graph"] = {k: round(statistics.median(v), 2) for k, v in gpu.items()}
    RUN.log(f"alone GPU µs (graph replay): {RESULT['alone_gpu_us_graph']}")


def profiled(model, prompt) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU] + ([] if SMOKE else [torch.profiler.ProfilerActivity.CUDA])
    out = RESULT["profile"] = {}
    for n in ("moekit", "grouped_mm", "no_experts"):
        if RUN.elapsed() > ARGS.deadline - 4:
            RUN.log(f"profile: deadline before {n}")
            break
        probes.PROFILE[0] = True
        with torch.profiler.profile(activities=acts) as prof:
            generate(model, f"t_{n}", prompt, 5)
        probes.PROFILE[0] = False
        out[n] = probes.profile_summary(prof, 5)
        RUN.log(f"profile {n}: {out[n]}")


def table(per: dict) -> None:
    layers = 1 if SMOKE else 8
    med = {n: statistics.median(v) for n, v in per.items() if v}
    ceiling = med.get("no_experts")
    for n, ms in med.items():
        gap = "" if ceiling is None else f", over the ceiling {(ms - ceiling) * 1e3 / layers:6.1f} µs a layer"
        RUN.summary.append(f"decode {n:<11} {ms:7.3f} ms a step ({1e3 / ms:6.1f} tok/s){gap}; rounds "
                           + " ".join(f"{v:.3f}" for v in per[n]))
    for new, old in (("moekit_cc", "moekit"), ("moekit_block", "moekit"), ("moekit_blocks", "moekit"),
                     ("moekit_blocks", "moekit_block")):
        if per.get(new) and per.get(old):
            RUN.summary.append(f"{new} vs {old}: x{med[old] / med[new]:.3f}, >=3% faster in "
                               f"{wins(per[new], per[old])}/{len(per[new])} rounds")
    for n, s in RESULT.get("host_us_in_client", {}).items():
        RUN.summary.append(f"host in client {n:<14} median {s.get('median')} p10 {s.get('p10')} p90 {s.get('p90')}")
    for n, s in RESULT.get("moekit_stages_us", {}).items():
        RUN.summary.append(f"  moekit stage {n:<26} median {s.get('median')} µs")
    RUN.summary.append(f"routes (last pass): {RESULT.get('routes_last_pass', {}).get('moekit')}")
    for n, v in RESULT.get("alone", {}).items():
        RUN.summary.append(f"alone {n:<28} {v}")
    RUN.summary.append(f"alone GPU µs (graph): {RESULT.get('alone_gpu_us_graph')}")
    for n, v in RESULT.get("profile", {}).items():
        c = v["per_experts_call"]
        RUN.summary.append(f"profile {n:<11} per call: host {c.get('host_us', 0):.1f} µs, "
                           f"launches {c.get('launches')}, syncs {c.get('syncs')}, allocs {c.get('allocs')}, "
                           f"aten ops {c.get('aten_ops')}, GPU {v['experts_gpu_us']}; "
                           f"step GPU {v['gpu_us_per_step']:.0f} µs, {v['kernels_per_step']:.0f} kernels, "
                           f"{v['launches_per_step']:.0f} launches, host in syncs {v['sync_wait_us_per_step']:.0f} µs")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--deadline", type=float, default=70.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--impls", type=lambda v: tuple(v.split(",")), default=DECODE_IMPLS,
                   help=f"decode's implementations, among {','.join(DECODE_IMPLS)}")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=("host", "alone", "profile"),
                   help="the phases after decode, among host,alone,profile")
    p.parse_args(namespace=ARGS)
    threading.Thread(target=RUN.watchdog, daemon=True).start()  # a hung kernel: the table so far, then exit 3
    RESULT["run"].update(run_info())
    names = probes.install()
    model, prompt, dev = build()
    BLOCKS.bind(model)
    RUN.log(f"model built ({RESULT['run']}); registered {names}")
    for n in ARGS.impls:
        generate(model, n, prompt, 4)
        RUN.log(f"warm {n}")
    call = capture(model, prompt)
    correctness(model, prompt, call)
    dump()
    per = decode_rounds(model, prompt)
    dump()
    phases = {"host": lambda: host_split(model, prompt), "alone": lambda: alone(call, dev),
              "profile": lambda: profiled(model, prompt)}
    for phase in [phases[n] for n in ARGS.phases]:
        if RUN.elapsed() > ARGS.deadline - 5:
            RUN.log("deadline: later phases skipped")
            break
        try:
            phase()
        except Exception as exc:  # noqa: BLE001 (a phase's failure is reported; the table still prints)
            RUN.log(f"FAIL phase: {type(exc).__name__}: {str(exc)[-600:]}")
            RUN.failed.append("phase")
        dump()
    table(per)
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
