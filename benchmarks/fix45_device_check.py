"""fix45: the CUDA half of two CPU-tested fixes. No kernel changed.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/fix45_device_check.py --out $OUT/fix45 --deadline 60   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/fix45_device_check.py --smoke     # CPU: tiny shapes, the cache's "GPU" the CPU

Phases (each skipped past the deadline; <out>/fix45.json rewritten after each):
  pickle    ``torch.save(model)`` / ``torch.load(weights_only=False)`` of two ``OffloadedMoE`` layers on one CUDA
            ``ExpertCache`` (E = 16, K = 1024, N = 512, top-2, bf16, 6 slots; float and int4_w4a16; misses on the GPU
            and on the CPU), after a warm forward: the loaded cache is shared by both layers, has a copy stream, holds
            nothing in its slots, and its host blocks are pinned again (PASS lines); each layer's output on three
            batches against the plain layers it was offloaded from (rel-L2 < 2e-2, bf16) and against the saved model
            (< 2e-2; bit equality reported: the loaded cache starts empty, so the rounds may add in another order).
  time      decode steps (M = 1, a fresh token a step: misses fetched) through the saved and the loaded model, wall µs
            a step, interleaved rounds: a loaded cache whose host blocks were not pinned again would copy slower.
  losses    the aux losses (balance, z, sequence-wise) under ``torch.compile(fullgraph=True)`` (inductor) on CUDA: a
            batch with padded tokens and a token with no live expert against eager (< 1e-5), an all-masked batch 0 with
            a zero, finite gradient (last: inductor's cold compile takes most of its seconds).
The table is printed last: medians, loaded / saved per round.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases  # noqa: E402

from moekit import MoE, MoEConfig  # noqa: E402
from moekit.losses import load_balancing_loss, sequence_balance_loss, z_loss  # noqa: E402
from moekit.offload import ExpertCache, OffloadedMoE, link_layers  # noqa: E402

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 7
E, K, N, SLOTS = (8, 64, 32, 3) if SMOKE else (16, 1024, 512, 6)
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
RUN = RunLog("fix45: an offloaded model through torch.save on CUDA, the losses compiled (wall µs a decode step, "
             "medians of interleaved rounds)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 10, "losses": 25}


def model(scheme: str | None, place: str, dev) -> tuple[torch.nn.Sequential, list[MoE]]:
    plain = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        moe = MoE(CONFIG, dtype=torch.bfloat16, device=dev, backend="grouped_mm" if SMOKE else "auto").eval()
        plain.append(moe.quantize_(scheme) if scheme else moe)
    cache = ExpertCache(SLOTS, device=dev, policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, compute_misses_on=place, prefetch="router") for m in plain]
    link_layers(layers)
    return torch.nn.Sequential(*layers), plain


def saved_and_loaded(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def batches(dev, sizes=(1, 7, 33)) -> list[torch.Tensor]:
    return [torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dev, torch.bfloat16) for m in sizes]


def pickle_phase(dev) -> None:
    res = RESULT["pickle"] = {}
    for scheme in (None, "int4_w4a16"):
        for place in ("gpu", "cpu"):
            name = f"{scheme or 'bf16'} misses on {place}"
            saved, plain = model(scheme, place, dev)
            with torch.no_grad():
                saved(batches(dev)[1])
            start = time.perf_counter()
            loaded = saved_and_loaded(saved)
            took = time.perf_counter() - start
            cache = loaded[0].cache
            pinned = all(b.is_pinned() for blocks in cache._host_blocks for b in blocks)
            RUN.check(f"{name}: one loaded cache, empty, its copy stream", loaded[1].cache is cache
                      and cache.cached(0) == {} and (cache._copy_stream is not None) == (dev.type == "cuda"))
            RUN.check(f"{name}: host blocks pinned again", pinned == (dev.type == "cuda"), f"pinned={pinned}")
            cell = res[name] = {"save_load_s": round(took, 3), "vs_plain": [], "vs_saved": [], "bit_equal": []}
            with torch.no_grad():
                for x in batches(dev):
                    for got_layer, saved_layer, ref_layer in zip(loaded, saved, plain):
                        got, again, want = got_layer(x), saved_layer(x), ref_layer(x)
                        cell["vs_plain"].append(rel_l2(got, want))
                        cell["vs_saved"].append(rel_l2(got, again))
                        cell["bit_equal"].append(torch.equal(got, again))
            RUN.check(f"{name}: outputs vs the plain layers", max(cell["vs_plain"]) < 2e-2,
                      f"max rel_l2={max(cell['vs_plain']):.2e}")
            RUN.check(f"{name}: outputs vs the saved model", max(cell["vs_saved"]) < 2e-2,
                      f"max rel_l2={max(cell['vs_saved']):.2e}, bit equal {sum(cell['bit_equal'])}/"
                      f"{len(cell['bit_equal'])}, save + load {took:.2f} s")


def losses_phase(dev) -> None:
    res = RESULT["losses"] = {}
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 6, generator=g, dtype=torch.float32) * 2).to(dev)
    logits[3] = float("-inf")
    logits[6, :3] = float("-inf")
    ids = torch.topk(logits, 2, dim=-1).indices
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1, 0], device=dev)

    def all_losses(lg, m):
        return torch.stack([load_balancing_loss(lg, ids, 6, m), z_loss(lg, m),
                            sequence_balance_loss(lg, ids, 6, 5, token_mask=m)])

    compiled = torch.compile(all_losses, fullgraph=True, backend="aot_eager" if SMOKE else "inductor")
    got, want = compiled(logits, mask), all_losses(logits, mask)
    res["padded"] = {"compiled": got.tolist(), "eager": want.tolist()}
    RUN.check("losses compiled == eager, padded tokens and a token with no live expert",
              torch.isfinite(got).all().item() and rel_l2(got, want) < 1e-5, f"{got.tolist()}")
    dead = torch.full_like(logits, float("-inf")).requires_grad_(True)
    value = compiled(dead, None)
    (grad,) = torch.autograd.grad(value.sum(), dead)
    res["all_masked"] = {"value": value.tolist(), "grad_abs_max": grad.abs().max().item()}
    RUN.check("losses compiled, all masked: 0 with a zero gradient", value.abs().max().item() == 0
              and torch.isfinite(grad).all().item() and grad.abs().max().item() == 0, f"{value.tolist()}")


def time_phase(dev) -> None:
    saved, _ = model(None, "gpu", dev)
    loaded = saved_and_loaded(saved)
    steps = [torch.randn(1, K, generator=torch.Generator().manual_seed(100 + i)).to(dev, torch.bfloat16)
             for i in range(4 if SMOKE else 32)]
    fns = {"saved": saved, "loaded": loaded}
    wall = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(steps[0])
        for r in range(ROUNDS):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for x in steps:
                    fns[name](x)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - start) / len(steps) * 1e6)
    RESULT["time_us"] = wall
    med = statistics.median
    RUN.summary.append(f"| decode step, 2 layers, {SLOTS} slots of {E} | {med(wall['loaded']):.1f} / "
                       f"{med(wall['saved']):.1f} | "
                       + " ".join(f"{a / b:.2f}" for a, b in zip(wall["loaded"], wall["saved"])) + " |")


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"pickle": lambda: pickle_phase(dev), "time": lambda: time_phase(dev), "losses": lambda: losses_phase(dev)}
    args = phase_args(__doc__, phases, "fix45.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, K, N, SLOTS], "phases": args.phases}
    RUN.summary.append("| cell | wall µs loaded / saved | loaded / saved per round |\n|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
