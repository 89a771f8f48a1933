"""load54's device check: a freed checkpoint loaded under a device_map of a GPU, "cpu" and "disk" (session 54, branch
load54). No kernel changed; this checks the placement and the bits, and times the load and one forward.

A Qwen3-MoE built offline (random weights, bf16: 3 layers, hidden 1024, 32 experts of width 512, top-4) is swapped
and freed on the GPU with each scheme (``--schemes``) and saved; then, in this process:

  one     from_pretrained(path, device_map="cuda"): the one-place load (session 53's path), the reference logits.
  mixed   device_map {embedding, layer 0, norm, head: 0; layer 1: "cpu"; layer 2: "disk"} (accelerate offloads
          layer 1 to host memory and layer 2 to disk; its hooks read them to the GPU at each forward). PASS: logits
          bit-equal to one's; no float experts made (transformers' init saw them on meta); layer 1's quantized tensors
          rest on the CPU and layer 2's on meta (none on the GPU between forwards). INFO: the GPU memory allocated
          and reserved after the load (transformers' allocator warm-up is planned for the float experts), the peak of
          one forward, the load's and a forward's walls against one's.
  auto    device_map="auto" with max_memory {0: a third of the float model's bytes, "cpu": a third}: PASS bit-equal
          to one's; INFO the places it chose.

PASS / FAIL / INFO lines first, a table last, JSON under --out. ``--smoke`` runs it on the CPU (no GPU: device 0
becomes "cpu", which accelerate does not offload, so layer 1 stays in memory; ``TRITON_INTERPRET=1``; 2 layers fewer
experts).

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/load54_device_check.py --out $OUT/load54 --deadline 80
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

import moekit.hf
from moekit.hf import use_moekit_blocks
from moekit.hf.set_check import is_interface_experts

RESULTS: list[dict] = []
ROWS: list[dict] = []


def report(kind: str | bool, name: str, detail: str) -> None:
    """A line PASS / FAIL (``kind`` True / False), or INFO, printed and kept for the JSON."""
    kind = kind if isinstance(kind, str) else "PASS" if kind else "FAIL"
    print(f"{kind} {name}: {detail}", flush=True)
    RESULTS.append({"kind": kind, "name": name, "detail": detail})


def config(smoke: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=512, hidden_size=256 if smoke else 1024, intermediate_size=512,
                          moe_intermediate_size=128 if smoke else 512, num_hidden_layers=3, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=32 if smoke else 128, num_experts=8 if smoke else 32,
                          num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def load(path: Path, gpu, **where):
    """The model, its wall, the float experts' devices at transformers' init, the GPU memory after the load."""
    import transformers

    seen = []
    initialize = transformers.PreTrainedModel._initialize_missing_keys

    def recording(self, *args, **kwargs):
        seen.extend(m.down_proj.device.type for m in self.modules() if is_interface_experts(m))
        return initialize(self, *args, **kwargs)

    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    transformers.PreTrainedModel._initialize_missing_keys = recording
    try:
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **where).eval()
        wall = time.perf_counter() - start
    finally:
        transformers.PreTrainedModel._initialize_missing_keys = initialize
    memory = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if gpu else (0, 0)
    return model, wall, set(seen), memory


def forward(model, ids, gpu) -> tuple[torch.Tensor, float, int]:
    """Logits, the median wall of 3 forwards, the GPU peak of one."""
    walls = []
    for _ in range(3):
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.no_grad():
            out = model(ids).logits
        if gpu:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return out, sorted(walls)[1], torch.cuda.max_memory_allocated() if gpu else 0


def run_scheme(scheme: str, root: Path, smoke: bool) -> None:
    from transformers import AutoModelForCausalLM

    gpu = not smoke
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(smoke), dtype=torch.bfloat16).to(device)
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    use_moekit_blocks(model, quant=scheme, keep_float=False, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # save_pretrained's word on the experts file
        model.save_pretrained(root / scheme)
    del model
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)  # [B, L]
    one, one_wall, _, one_memory = load(root / scheme, gpu, device_map=device)
    reference, one_forward, one_peak = forward(one, ids, gpu)
    del one
    first = 0 if gpu else "cpu"
    mixed_map = {"model.embed_tokens": first, "model.layers.0": first, "model.layers.1": "cpu",
                 "model.layers.2": "disk", "model.norm": first, "model.rotary_emb": first, "lm_head": first}
    mixed, wall, seen, memory = load(root / scheme, gpu, device_map=mixed_map,
                                     offload_folder=str(root / f"offload-{scheme}"))
    out, mixed_forward, peak = forward(mixed, ids, gpu)
    report(torch.equal(out, reference), f"{scheme} mixed bit-equal",
           f"max |diff| {(out.float() - reference.float()).abs().max().item():.3g}")
    report(seen == {"meta"}, f"{scheme} mixed no float experts", f"transformers' init saw them on {sorted(seen)}")
    rest = {n: t.device.type for n, t in mixed.named_buffers() if "_q" in n or "_scale" in n or "_zero" in n}
    layer1 = {d for n, d in rest.items() if n.startswith("model.layers.1.")}
    layer2 = {d for n, d in rest.items() if n.startswith("model.layers.2.")}
    report(layer1 == {"cpu"} and layer2 == {"meta"}, f"{scheme} mixed rest",
           f"layer 1's quantized tensors on {sorted(layer1)}, layer 2's on {sorted(layer2)}")
    report("INFO", f"{scheme} mixed memory", f"GPU allocated {mib(memory[0])} MiB (one place: {mib(one_memory[0])}), "
           f"reserved {mib(memory[1])} MiB (one place: {mib(one_memory[1])}); forward peak {mib(peak)} MiB (one "
           f"place: {mib(one_peak)}); float model {mib(floats)} MiB")
    ROWS.append({"scheme": scheme, "load_one_s": round(one_wall, 3), "load_mixed_s": round(wall, 3),
                 "forward_one_ms": round(one_forward * 1e3, 2), "forward_mixed_ms": round(mixed_forward * 1e3, 2),
                 "gpu_alloc_one_mib": mib(one_memory[0]), "gpu_alloc_mixed_mib": mib(memory[0]),
                 "gpu_reserved_mixed_mib": mib(memory[1]), "forward_peak_mixed_mib": mib(peak)})
    del mixed
    memory_map = {0: floats // 3, "cpu": floats // 3} if gpu else {"cpu": floats // 2}
    auto, _, seen, _ = load(root / scheme, gpu, device_map="auto", max_memory=memory_map,
                            offload_folder=str(root / f"offload-auto-{scheme}"))
    out, _, _ = forward(auto, ids, gpu)
    report(torch.equal(out, reference) and seen == {"meta"}, f"{scheme} auto bit-equal",
           f"max |diff| {(out.float() - reference.float()).abs().max().item():.3g}, float experts on {sorted(seen)}")
    report("INFO", f"{scheme} auto places", json.dumps(sorted({str(v) for v in auto.hf_device_map.values()})))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for load54.json")
    parser.add_argument("--deadline", type=float, default=80.0, help="seconds; schemes not begun by then are skipped")
    parser.add_argument("--schemes", default="int4_w4a16,fp8_block,int8_w8a16,mxfp4")
    parser.add_argument("--smoke", action="store_true", help="on the CPU (no GPU), smaller")
    args = parser.parse_args()
    if not 0 < args.deadline < 90:
        parser.error(f"--deadline must be in (0, 90) seconds, got {args.deadline}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --smoke to run on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report("INFO", "device", torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)")
    with tempfile.TemporaryDirectory() as root:
        for scheme in args.schemes.split(","):
            if time.perf_counter() - start > args.deadline * 0.6:  # a scheme takes up to ~a third of it
                report("INFO", f"{scheme}", "skipped: past the deadline")
                continue
            try:
                run_scheme(scheme, Path(root), args.smoke)
            except Exception as err:  # noqa: BLE001  (the next scheme still runs; said as a FAIL)
                report("FAIL", f"{scheme}", f"{type(err).__name__}: {str(err)[:300]}")
    (args.out / "load54.json").write_text(json.dumps({"results": RESULTS, "rows": ROWS}, indent=1) + "\n")
    print(f"\n{'scheme':<12}{'load one s':>11}{'load mixed s':>13}{'fwd one ms':>11}{'fwd mixed ms':>13}"
          f"{'GPU one MiB':>12}{'GPU mixed MiB':>14}{'reserved MiB':>13}")
    for r in ROWS:
        print(f"{r['scheme']:<12}{r['load_one_s']:>11}{r['load_mixed_s']:>13}{r['forward_one_ms']:>11}"
              f"{r['forward_mixed_ms']:>13}{r['gpu_alloc_one_mib']:>12}{r['gpu_alloc_mixed_mib']:>14}"
              f"{r['gpu_reserved_mixed_mib']:>13}")
    print(f"wall {time.perf_counter() - start:.1f} s; {sum(r['kind'] == 'FAIL' for r in RESULTS)} FAIL")


if __name__ == "__main__":
    main()
