"""Session 49 (brief auto49): which backend trains fastest, per kind of call, for ``backend="auto"``'s training rules
(``moekit.experts.auto_train``), and that auto's no-grad call at M = 1 did not move.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/auto49_device_check.py --out $OUT/auto49 --deadline 75    # GPU
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/auto49_device_check.py --ck2 --out $OUT/auto49 --deadline 75  # GPU
    PYTHONPATH=$PWD python3 benchmarks/auto49_device_check.py --smoke [--ck2]    # CPU, interpreted, tiny shapes

Layers (bf16; E scaled down where the weights and their gradients would not fit beside the others):
  mixtral   Mixtral-8x7B: E 8, top-2, K 4096, N 14336, silu (plain: the fused Triton backward)
  qwen3     Qwen3-30B-A3B: E 128, top-8, K 2048, N 768, silu (plain)
  dsv3      DeepSeek-V3 routed experts: E 64 (of 256), top-8, K 7168, N 2048, silu (plain)
  gpt_oss   gpt-oss-20b: E 32, top-4, K = N = 2880, biases, interleaved SwiGLU (alpha 1.702, limit 7, up_shift 1)
            (variant: Triton's recomputing backward)
  step37    Step-3.7: E 96 (of 288), top-8, K 4096, N 1280, the clamp after the activation at 1.0 (variant)
Phase "checks" (M = 256; PASS / FAIL): per layer, triton's and grouped_mm's gradients of every input against each
other (rel-L2 <= TOL) and against the float32 reference backend's (triton's no further off than grouped_mm's); "auto"
with every kind sent to grouped_mm (explicit rules) gives grouped_mm's gradients bit for bit and, under no_grad,
triton's output bit for bit; "auto" as committed gives the gradients of the backend its rules name. Phase "infer"
(Qwen3 shape, M = 1, no_grad): a ``MoE`` layer forward and the bare experts call (``call_backend``: moekit.hf's path)
with ``backend="triton"`` (what auto was) against ``backend="auto"`` (the dispatcher): outputs bit-equal, the layer's
decode fast path kept its call, host / wall µs medians. Phase "time" (M = 256, 4096, then 1024): one eager training
step (forward + ``torch.autograd.grad`` of every input) on triton and on grouped_mm, ROUNDS interleaved rounds (the
order turned each round) of CALLS steps: wall µs (perf_counter, synchronised) and CUDA-event µs, medians. Table
last; JSON <out>/auto49.json. ``--ck2`` (the second run, after the rules were filled from the first): the checks at
CK2_CHECKED (triton against grouped_mm; auto as committed) and the time phase at CK2_CELLS (the plain rule's bounds in
E and M, and M = 16384), each line with the backend auto trains it on. (Triton forward + grouped_mm backward, the
mixed form, is what the recompute does for the variants; for a plain spec it would cost grouped_mm's whole step plus
Triton's forward: not timed.)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
CK2 = "--ck2" in sys.argv  # the second run: where the committed rules' bounds lie (below)
if CK2:
    sys.argv.remove("--ck2")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import turned  # noqa: E402
from bench_run import RunLog, host_and_wall_us, phase_args, rel_l2, run_info, run_phases  # noqa: E402
from train_step_inputs import layer_inputs, step_grads  # noqa: E402

from moekit.activations import ActivationSpec  # noqa: E402

GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
STEP37 = ActivationSpec("silu", limit=1.0, limit_after_act=True)
# name -> (E, top_k, K, N, spec, biases)
LAYERS = {
    "mixtral": (8, 2, 4096, 14336, "silu", False),
    "qwen3": (128, 8, 2048, 768, "silu", False),
    "dsv3": (64, 8, 7168, 2048, "silu", False),
    "gpt_oss": (32, 4, 2880, 2880, GPT_OSS, True),
    "step37": (96, 8, 4096, 1280, STEP37, False),
}
# --ck2: plain layers of Mixtral's, Qwen3's and DeepSeek-V3's expert shapes at 16 and 32 experts (ck1's rule bounded
# E; these showed the expert width decides, not E), Qwen3 and DeepSeek-V3 at M = 512 (between 256 and 1024), M = 16384
LAYERS.update({"mixtral_e32": (32, 2, 4096, 14336, "silu", False), "qwen3_e16": (16, 8, 2048, 768, "silu", False),
               "qwen3_e32": (32, 8, 2048, 768, "silu", False), "dsv3_e16": (16, 8, 7168, 2048, "silu", False),
               "dsv3_e32": (32, 8, 7168, 2048, "silu", False)})
CK2_CELLS = (*((name, m) for name in ("mixtral_e32", "qwen3_e16", "qwen3_e32", "dsv3_e16", "dsv3_e32")
               for m in (1024, 4096)), ("qwen3", 512), ("dsv3", 512),
             *((name, 16384) for name in ("mixtral", "gpt_oss", "step37", "qwen3", "dsv3")))
CK2_CHECKED = (("qwen3_e32", 1024), ("dsv3", 1024), ("gpt_oss", 1024))
if SMOKE:
    LAYERS = {name: (4, 2, 64, 32, spec, biases) for name, (_, _, _, _, spec, biases) in LAYERS.items()}
CHECK_M, TIME_MS, INFER_M = (8, (8,), 1) if SMOKE else (256, (256, 4096, 1024), 1)
BASE = ("mixtral", "qwen3", "dsv3", "gpt_oss", "step37")
CELLS = (tuple((name, 8) for name, _ in CK2_CELLS[:3]) if SMOKE else CK2_CELLS) if CK2 else \
    tuple((name, m) for m in TIME_MS for name in BASE)
TOL, ROUNDS, CALLS = 2e-2, 5, 3
INFER_CALLS, INFER_ROUNDS = (3, 2) if SMOKE else (200, 7)
BACKENDS = ("triton", "grouped_mm")
RUN = RunLog("auto49: µs of one eager training step (fwd + grads of every input), triton vs grouped_mm, bf16; "
             "auto's no-grad M = 1 before (triton) / after (auto)")


def problem(layer: str, m: int, dev, seed: int) -> dict:
    return layer_inputs(LAYERS[layer], m, dev, seed)


def step(fn, layer: str, p: dict, dtype=None) -> dict:
    return step_grads(fn, LAYERS[layer][4], p, dtype)


def forward(fn, layer: str, p: dict) -> torch.Tensor:
    with torch.no_grad():
        return fn(p["x"], p["w13"], p["w2"], p["ids"], p["topk_weights"], activation=LAYERS[layer][4], b13=p["b13"],
                  b2=p["b2"])


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def auto_pick(dev, layer: str, p: dict, m: int) -> str:
    """The backend "auto" as committed trains this call on."""
    from moekit.experts import backend_fn, resolve_backend
    from moekit.experts.auto_train import auto_choice_of

    choice = auto_choice_of(backend_fn("auto", dev))
    x_leaf = p["x"].detach().requires_grad_()  # a call that records gradients
    return resolve_backend("auto", dev) if choice is None else choice.pick(
        x_leaf, p["w13"], p["w2"], p["topk_weights"], LAYERS[layer][4], p["b13"], p["b2"], m)


def checks(dev) -> None:
    """ck1: each BASE layer at CHECK_M against the float32 reference, and "auto" with explicit rules; --ck2: the
    CK2_CHECKED cells (triton against grouped_mm). Both: "auto" as committed gives its pick's gradients."""
    from moekit.experts import backend_fn
    from moekit.experts.auto_train import KINDS, TrainingRule, auto_dispatcher, call_kind

    to_gmm = auto_dispatcher("triton", tuple(TrainingRule(kind, "grouped_mm") for kind in KINDS))
    cells = (CK2_CHECKED if not SMOKE else tuple((name, 8) for name, _ in CK2_CHECKED)) if CK2 else \
        tuple((name, CHECK_M) for name in BASE)
    for layer, m in cells:
        p = problem(layer, m, dev, seed=1)
        got = {b: step(backend_fn(b, dev), layer, p) for b in BACKENDS}
        apart = {n: rel_l2(got["triton"][n].float(), got["grouped_mm"][n].float()) for n in got["triton"]}
        if CK2:
            RUN.check(f"{layer} grads M={m}", all(v <= TOL for v in apart.values()), "triton vs grouped_mm: " +
                      ", ".join(f"{n} {v:.1e}" for n, v in apart.items()))
        else:
            want = step(backend_fn("reference", dev), layer, p, torch.float32)
            ref = {b: {n: rel_l2(g[n].float(), want[n].float()) for n in want} for b, g in got.items()}
            ok = all(apart[n] <= TOL and ref["triton"][n] <= 1.5 * ref["grouped_mm"][n] + 1e-3 for n in want)
            RUN.check(f"{layer} grads M={m}", ok, "triton vs grouped_mm / vs f32 (triton, grouped_mm): " + ", ".join(
                f"{n} {apart[n]:.1e} / {ref['triton'][n]:.1e}, {ref['grouped_mm'][n]:.1e}" for n in want))
            RUN.check(f"{layer} auto(rules -> grouped_mm) trains on grouped_mm", same(step(to_gmm, layer, p),
                                                                                      got["grouped_mm"]))
            RUN.check(f"{layer} auto(rules -> grouped_mm) infers on triton",
                      torch.equal(forward(to_gmm, layer, p), forward(backend_fn("triton", dev), layer, p)))
        kind, name = call_kind(LAYERS[layer][4], p["w13"], p["b13"], p["b2"]), auto_pick(dev, layer, p, m)
        RUN.check(f"{layer} M={m} auto as committed ({kind}) trains on {name}",
                  same(step(backend_fn("auto", dev), layer, p), got[name]))


def infer(dev, result: dict) -> None:
    """auto's no-grad call at M = 1 before (backend "triton") and after (backend "auto"): a MoE layer (its decode fast
    path) and the bare experts call (moekit.hf's)."""
    from moekit.config import MoEConfig
    from moekit.experts import backend_fn, call_backend
    from moekit.layer import MoE

    e, top_k, k, n, _, _ = LAYERS["qwen3"]
    cfg = MoEConfig(hidden_size=k, moe_intermediate_size=n, num_experts=e, top_k=top_k)
    torch.manual_seed(3)
    router = "fused" if SMOKE else "auto"  # the decode fast path keeps calls of the fused router (CUDA's "auto")
    before = MoE(cfg, backend="triton", router=router, dtype=torch.bfloat16, device=dev)
    after = MoE(cfg, backend="auto", router=router, dtype=torch.bfloat16, device=dev)
    after.load_state_dict(before.state_dict())
    p = problem("qwen3", INFER_M, dev, seed=4)
    x = p["x"]
    fns = {"layer triton": lambda: before(x), "layer auto": lambda: after(x)}
    for name, b in (("call triton", "triton"), ("call auto", "auto")):
        fn = backend_fn(b, dev)
        fns[name] = lambda fn=fn: call_backend(fn, x, p["w13"], p["w2"], p["ids"], p["topk_weights"])
    with torch.no_grad():
        outs = {name: [fn() for _ in range(3)][-1] for name, fn in fns.items()}
        RUN.check(f"infer M={INFER_M} layer auto == triton", torch.equal(outs["layer auto"], outs["layer triton"]))
        RUN.check(f"infer M={INFER_M} call auto == triton", torch.equal(outs["call auto"], outs["call triton"]))
        entry = after._decode._entries.get(INFER_M)
        RUN.check(f"infer M={INFER_M} auto layer's decode fast path kept its call",
                  entry is not None and entry.kept is not None, f"entry {entry is not None}")
        times = host_and_wall_us(fns, dev, INFER_CALLS, INFER_ROUNDS)
    med = {name: [statistics.median(h), statistics.median(w)] for name, (h, w) in times.items()}
    result["infer"] = {"M": INFER_M, "samples_us": times, "median_host_wall_us": med}
    for what in ("layer", "call"):
        t, a = med[f"{what} triton"], med[f"{what} auto"]
        RUN.summary.append(f"infer {what:5s} M={INFER_M}: host µs triton {t[0]:7.1f} auto {a[0]:7.1f} | wall µs "
                           f"triton {t[1]:7.1f} auto {a[1]:7.1f}")


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_cell(dev, layer: str, m: int, stop: float) -> tuple[dict, str]:
    """layer at M = m: (backend -> ([wall µs a step, each round], [event µs a step, each round]), auto's pick)."""
    from moekit.experts import backend_fn

    p = problem(layer, m, dev, seed=2)
    pick = auto_pick(dev, layer, p, m)
    runs = {b: (lambda fn=backend_fn(b, dev): step(fn, layer, p)) for b in BACKENDS}
    for run in runs.values():  # warm-up: compiles, plans, allocator
        run()
        run()
    samples = {b: ([], []) for b in runs}
    cuda = dev.type == "cuda"
    for r in range(ROUNDS):
        if r and time.time() > stop:
            break
        for b in turned(r, list(runs)):
            sync(dev)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(CALLS):
                runs[b]()
            if cuda:
                end.record()
            sync(dev)
            samples[b][0].append((time.perf_counter() - t0) * 1e6 / CALLS)
            samples[b][1].append(start.elapsed_time(end) * 1e3 / CALLS if cuda else float("nan"))
    return samples, pick


def time_steps(dev, result: dict, stop: float) -> None:
    for layer, m in CELLS:
        if time.time() > stop:
            RUN.summary.append(f"{layer} M={m}: not timed (deadline)")
            continue
        samples, pick = time_cell(dev, layer, m, stop)
        med = {b: [statistics.median(w), statistics.median(ev)] for b, (w, ev) in samples.items()}
        t, g = med["triton"], med["grouped_mm"]
        RUN.summary.append(f"{layer:11s} M={m:5d}: wall triton {t[0]:9.1f} grouped_mm {g[0]:9.1f} x{g[0] / t[0]:.2f}"
                           f" | event triton {t[1]:9.1f} grouped_mm {g[1]:9.1f} x{g[1] / t[1]:.2f} | auto {pick} "
                           f"({len(samples['triton'][0])} rounds; x = grouped_mm / triton)")
        result["cells"].append({"layer": layer, "M": m, "samples_wall_event_us": samples, "median_us": med,
                                "auto": pick})
        RUN.log(f"timed {layer} M={m}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    dev, result = torch.device("cpu" if SMOKE else "cuda"), {"cells": []}
    if SMOKE:  # "auto" as on CUDA: the interpreted triton its inference pick, so the smoke run meets the dispatcher
        import moekit.experts

        moekit.experts._AUTO_ORDER_OTHER = ("triton", "grouped_mm", "reference")
    phases = {"checks": lambda: checks(dev), "infer": lambda: infer(dev, result),
              "time": lambda: time_steps(dev, result, stop_at)}
    args = phase_args(__doc__, phases, "auto49.json")
    stop_at = time.time() + args.deadline - 4 - RUN.elapsed()
    result.update(run_info(), layers={k: list(map(str, v)) for k, v in LAYERS.items()})
    RUN.log(f"layers {list(LAYERS)}; {run_info()}")
    return run_phases(RUN, phases, args.phases, args.deadline, {"checks": 30, "infer": 20, "time": 6}, args.path,
                      result)


if __name__ == "__main__":
    sys.exit(main())
