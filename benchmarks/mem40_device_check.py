"""mem40: ``use_moekit_blocks(model, quant=scheme, keep_float=False)`` frees the float experts, on the device's memory.
One Qwen3-30B-A3B-width layer (E = 128, K = 2048, N = 768, bf16, transformers' model with random weights; the
experts 1.21 GB of its weights) per scheme: the memory the allocator holds for the float model, with the quantized
blocks kept beside the float experts (keep_float=True: today's default) and with them freed.

    PYTHONPATH=$PWD timeout 60 python3 benchmarks/mem40_device_check.py --out $OUT/mem40 --deadline 45   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/mem40_device_check.py --smoke         # CPU: tiny widths, Triton interpreted
    flock /work/wt/cpubench.lock env PYTHONPATH=$PWD python3 benchmarks/mem40_device_check.py --cpu-real
                                                                             # CPU, real widths: the process's RSS

Each scheme (int4_w4a16, mxfp4, int8_w8a16, fp8_block; each skipped past the deadline): build the model, swap it
with keep_float=True, logits of 2 x 8 random ids, then use_moekit_blocks(keep_float=False) (the same quantized MoE,
nothing requantized), the logits again. PASS: the logits bit-equal; the report's float experts' bytes E * 3NK * 2;
the memory held (CUDA: memory_allocated; --cpu-real: the process's RSS) drops from kept to freed by the float
experts' bytes (the quantized copies and the forward's workspaces are there in both), within 1%; the smoke's
parameter + buffer bytes drop from the float model by the float experts' bytes less the quantized ones' exactly.
Then the freed model goes to the CPU and back (``model.to``: the quantized buffers moved, the MoE rebuilt over
them, nothing requantized): PASS of bit-equal logits again and of the memory held within 1% of the freed figure.
No timing: a freed block runs the very MoE a kept one runs (tests/test_hf_swap_free.py: bit-equal outputs).
The table is printed last: MiB float / kept / freed per scheme.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, run_info, run_phases  # noqa: E402

SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16", "fp8_block")
RUN = RunLog("mem40: a Qwen3-30B-A3B-width layer's memory (MiB): float model / quantized kept beside it / floats freed",
             stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
MIB = 2.0**20


def held_bytes(model, dev: torch.device, rss: bool) -> int:
    """What the device holds now: CUDA memory_allocated; the CPU process's RSS (``rss``) or the model's bytes."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    if rss:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    from moekit.bench.hf_wo import model_bytes

    return model_bytes(model)


def scheme_phase(scheme: str, dev: torch.device, tiny: bool, rss: bool) -> None:
    from moekit.bench.hf_models import build_model, hf_config
    from moekit.hf import use_moekit_blocks

    config = hf_config("qwen3", 1, tiny=tiny)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    model = build_model(config, torch.float32 if tiny else torch.bfloat16, dev)
    held = {"float": held_bytes(model, dev, rss)}
    use_moekit_blocks(model, quant=scheme)
    with torch.no_grad():
        kept = model(ids).logits.cpu()  # [B, L, V]: off the device, not counted in what it holds
    held["kept"] = held_bytes(model, dev, rss)
    report = use_moekit_blocks(model, quant=scheme, keep_float=False)
    held["freed"] = held_bytes(model, dev, rss)
    with torch.no_grad():
        freed = model(ids).logits.cpu()
    exact = dev.type != "cuda" and not rss  # the model's bytes: what it names, nothing else
    got = held["float"] - held["freed"] if exact else held["kept"] - held["freed"]
    want = report.freed_bytes - report.quant_bytes if exact else report.freed_bytes
    experts = config.num_experts * 3 * config.moe_intermediate_size * config.hidden_size * model.dtype.itemsize
    RUN.check(f"{scheme} logits bit-equal kept / freed", torch.equal(kept, freed))
    RUN.check(f"{scheme} float experts' bytes", report.freed_bytes == experts, f"{report.freed_bytes} vs {experts}")
    RUN.check(f"{scheme} {'float' if exact else 'kept'} -> freed drops by the float experts"
              + " less the quantized ones" * exact, got == want if exact else abs(got - want) <= 0.01 * experts,
              f"{got / MIB:.1f} MiB vs {want / MIB:.1f}")
    model.to("cpu").to(dev)
    with torch.no_grad():
        moved = model(ids).logits.cpu()
    held["moved"] = held_bytes(model, dev, rss)
    RUN.check(f"{scheme} logits bit-equal after .to('cpu').to({dev.type!r})", torch.equal(moved, freed))
    RUN.check(f"{scheme} held after the round trip", abs(held["moved"] - held["freed"]) <= 0.01 * experts,
              f"{held['moved'] / MIB:.1f} MiB vs {held['freed'] / MIB:.1f}")
    cols = (held["float"], held["kept"], held["freed"], held["moved"], report.freed_bytes, report.quant_bytes)
    RUN.summary.append(f"| {scheme} | " + " | ".join(f"{b / MIB:.1f}" for b in cols) + " |")
    RESULT[scheme] = {**held, "experts_float_bytes": report.freed_bytes,
                      "experts_quant_bytes": report.quant_bytes}
    del model, kept, freed, moved
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=45.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu-real", action="store_true", help="real widths on the CPU, RSS measured")
    p.add_argument("--schemes", type=lambda v: tuple(x for x in v.split(",") if x), default=SCHEMES)
    args = p.parse_args()
    RUN.stall_s = 900 if args.cpu_real else RUN.stall_s  # a real-width layer built and quantized on 2 CPU cores
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE or args.cpu_real else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "cpu_real": args.cpu_real, "schemes": args.schemes}
    held = "RSS" if args.cpu_real else "memory_allocated" if dev.type == "cuda" else "parameter + buffer bytes"
    RUN.summary.append(f"| scheme | float model ({held}) | kept (keep_float=True) | freed (keep_float=False) | "
                       "freed, to the CPU and back | float experts | quantized experts |\n"
                       "|---|---|---|---|---|---|---|")
    phases = {s: (lambda s=s: scheme_phase(s, dev, SMOKE, args.cpu_real)) for s in args.schemes}
    return run_phases(RUN, phases, args.schemes, args.deadline, {}, args.out and os.path.join(args.out, "mem40.json"),
                      RESULT)


if __name__ == "__main__":
    sys.exit(main())
