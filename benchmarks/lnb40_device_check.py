"""lnb40: gpt-oss's eager decode on the fast paths (expert biases, the router Linear's bias, the clamped interleaved
SwiGLU kept by the layer's decode fast path and the experts ops' kept calls), on the GPU: correct, then host / wall µs
a layer call, this branch against the path main runs (the same run: a switch, below).

    PYTHONPATH=$PWD timeout 60 python3 benchmarks/lnb40_device_check.py --out $OUT/lnb40 --deadline 50   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/lnb40_device_check.py --smoke      # CPU: tiny shapes, Triton interpreted
    PYTHONPATH=$PWD python3 benchmarks/lnb40_device_check.py --cpu-host   # CPU: host µs, kernels stubbed

The layer: gpt-oss-20b's MoE block (E = 32, K = N = 2880, top-4, router Linear with a bias, b13 / b2) built from a
transformers GptOssConfig with random weights and biases (``moe_from_hf``, router "fused"), bf16 experts and the same
quantized to mxfp4 (``MoE.quantize_``; ``--schemes``: others, e.g. fp8_block); eager, no_grad, M = 1 and 4. "main":
a twin layer (the same values, its own tensors) served as main serves it: no layer decode entry (``_Full``) and no kept
experts call for its biases (``kept_biases.keepable`` refuses its tensors). "fast": this branch.
  correct   fast bit-equal to main after the warm-up calls, and the fast layer's kept entries exist (layer entry for
            bf16, a kept op entry for mxfp4)
  time      ``bench_run.host_and_wall_us``: host µs a call (queued behind ~1 ms of GPU work) and wall µs, ROUNDS
            interleaved rounds; table last: medians, fast / main, rounds >= 3% faster.
Then the real client's command for the lead (transformers' decode, 4 gpt-oss-20b layers). ``--cpu-host``: the time
phase alone on the CPU at the smoke's widths, every Triton kernel a stand-in that launches nothing
(``layer_host_cpu.stub_kernels``, with WO_KERNELS added: the Python and torch host work around the launches), 500
calls a round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading

CPU_HOST = "--cpu-host" in sys.argv
SMOKE = "--smoke" in sys.argv or CPU_HOST
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, host_and_wall_us, run_info, run_phases  # noqa: E402
from moekit import layer_fast  # noqa: E402

ROUNDS, CALLS = (5, 500) if CPU_HOST else (2, 2) if SMOKE else (5, 100)
E, K, N, TOP_K = (4, 64, 32, 2) if SMOKE else (32, 2880, 2880, 4)
MS = (1, 4)
SCHEMES = ["bf16", "mxfp4"]  # --schemes replaces them (session 41: fp8_block's biased calls kept, gof41)
# --cpu-host: these kernel modules stubbed too (the weight-only GEMMs, the one-pass alignment, the tensor-core gate)
WO_KERNELS = tuple(f"moekit.experts._kernels.{name}" for name in (
    "gemm_wo", "gemm_wo_gemv", "gemm_wo_mma", "gemm_wo_reg", "wo_split", "align_one_pass", "down_store")) + (
    "moekit.routing._kernels.gate_mma_kernel",)
CLIENT = ("moekit bench --hf --hf-model gpt-oss-20b --hf-quant mxfp4 --hf-impls moekit_blocks,no_experts "
          "--repeats 3")
RUN = RunLog("lnb40: gpt-oss-20b MoE layer, eager decode, µs a call (medians of interleaved rounds)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
ARGS = argparse.Namespace()
NEEDS_S = {"time": 10}
LAYERS: dict = {}  # (scheme, "main" | "fast") -> MoE


class _Full(layer_fast.DecodeFast):
    """The decode fast path as main has it for gpt-oss: nothing kept (expert biases), the full forward every call."""

    def keep(self, layer, x2d) -> None:
        return None


def _block(dev):
    """gpt-oss-20b's MoE block (transformers, random weights and biases, bf16) on ``dev``."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(hidden_size=K, intermediate_size=N, num_local_experts=E,
                                    num_experts_per_tok=TOP_K, num_hidden_layers=1)
    with torch.device(dev):
        block = GptOssMLP(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            scale = 0.5 if name.endswith("bias") else p.shape[-2 if "gate_up" in name or "down" in name else -1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32) * scale)
    return block


def build(dev) -> None:
    import moekit.experts.kept_biases as kb
    from moekit.experts import triton_fast, triton_quant_fast
    from moekit.hf import moe_from_hf

    block = _block(dev)
    main_biases: set = set()
    for scheme in SCHEMES:
        for kind in ("main", "fast"):
            layer = moe_from_hf(block, backend="triton").eval()  # gpt-oss's transposed storage: copied
            layer.router = "fused"
            for name in ("b13", "b2"):  # its own biases (moe_from_hf shares the block's): main's are refused below
                setattr(layer, name, torch.nn.Parameter(getattr(layer, name).detach().clone(), requires_grad=False))
            if scheme != "bf16":
                layer.quantize_(scheme)
            if kind == "main":
                layer._decode = _Full()
                main_biases.add(id(layer.b13))
            LAYERS[scheme, kind] = layer
    real = kb.keepable

    def keepable(b13, b2):  # main: the twin's biased calls are never kept
        return id(b13) not in main_biases and real(b13, b2)

    triton_fast.keepable = triton_quant_fast.keepable = keepable
    RUN.log(f"built {len(LAYERS)} layers: E={E} K={K} N={N} top-{TOP_K}")


def _x(m: int, dev) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dev, torch.bfloat16)  # [M, K]


def _kept(layer, m: int, scheme: str, quant_fast) -> bool:
    """Whether the fast paths hold this layer's call: its decode entry, and bf16: the experts' kept call found
    (``KeptCall.entry``), quantized: a kept op entry holding this layer's b13."""
    entry = layer._decode._entries.get(m)
    if entry is None:
        return False
    if scheme == "bf16":
        return entry.kept is not None and entry.kept.entry is not None
    return any(e.biases is not None and e.biases.b13() is layer.b13 for e in list(quant_fast._MEMO.values()))


def correct_phase(dev) -> None:
    from moekit.experts import triton_quant_fast

    build(dev)
    res = RESULT["correct"] = {}
    with torch.no_grad():
        for scheme in SCHEMES:
            for m in MS:
                x = _x(m, dev)
                outs = {}
                for kind in ("main", "fast"):
                    for _ in range(4):  # keep, record, serve
                        outs[kind] = LAYERS[scheme, kind](x)
                fast = LAYERS[scheme, "fast"]
                kept = _kept(fast, m, scheme, triton_quant_fast)
                same = torch.equal(outs["fast"], outs["main"])
                res[f"{scheme} M={m}"] = {"bit_equal": same, "kept": kept}
                RUN.check(f"{scheme} M={m} fast bit-equal to main", same)
                RUN.check(f"{scheme} M={m} fast path kept", kept)


def time_phase(dev) -> None:
    fns = {}
    with torch.no_grad():
        for scheme in SCHEMES:
            for m in MS:
                x = _x(m, dev)
                for kind in ("main", "fast"):
                    layer = LAYERS[scheme, kind]
                    fns[f"{scheme} M={m} {kind}"] = lambda layer=layer, x=x: layer(x)
        for fn in fns.values():
            fn()
        got = RESULT["time_us"] = host_and_wall_us(fns, dev, CALLS, ROUNDS)
    RUN.summary.append(f"{'cell':<14} {'host main':>10} {'host fast':>10} {'fast/main':>9} {'wins':>5} "
                       f"{'wall main':>10} {'wall fast':>10} {'fast/main':>9} {'wins':>5}")
    for scheme in SCHEMES:
        for m in MS:
            main, fast = got[f"{scheme} M={m} main"], got[f"{scheme} M={m} fast"]
            row = [f"{scheme} M={m}"]
            for i in (0, 1):
                wins = sum(f <= 0.97 * b for f, b in zip(fast[i], main[i]))
                a, b = statistics.median(main[i]), statistics.median(fast[i])
                row.append(f"{a:10.1f} {b:10.1f} {b / a:9.3f} {wins:>3}/{len(main[i])}")
            RUN.summary.append(f"{row[0]:<14} " + " ".join(row[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=50.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu-host", action="store_true")
    p.add_argument("--schemes", type=lambda v: tuple(x for x in v.split(",") if x), default=SCHEMES,
                   help="comma-separated, of bf16 and the quantized schemes (default bf16,mxfp4; gof41: fp8_block)")
    p.parse_args(namespace=ARGS)
    SCHEMES[:] = ARGS.schemes
    dev = torch.device("cpu" if SMOKE else "cuda")
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, N, K, TOP_K]}
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    phases = {"correct": lambda: correct_phase(dev), "time": lambda: time_phase(dev), "build": lambda: build(dev)}
    if CPU_HOST:
        import layer_host_cpu

        layer_host_cpu.KERNEL_MODULES = layer_host_cpu.KERNEL_MODULES + WO_KERNELS
        layer_host_cpu.stub_kernels()
    path = os.path.join(ARGS.out, "lnb40.json") if ARGS.out else ""
    names = ("build", "time") if CPU_HOST else ("correct", "time")
    status = run_phases(RUN, phases, names, ARGS.deadline if not CPU_HOST else 600.0, NEEDS_S, path, RESULT)
    print(f"\nthe real client, after: {CLIENT}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
