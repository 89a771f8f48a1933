"""usr52's device check: a user's transformers loads through moekit on CUDA (session 52, branch usr52).

Correctness only (nothing here is a kernel change; no variant to time): tiny models built offline, bf16.

  freed     use_moekit_blocks(quant, keep_float=False), save_pretrained, then in this process
            from_pretrained(path, experts_implementation="moekit", device_map=<device>): the file beside the
            checkpoint is loaded by from_pretrained itself. PASS: logits bit-equal to the saved model's, 4 greedy tokens
            equal.
  fp8       transformers' FineGrainedFP8Config at load (experts only, the other linears named not to convert):
            FP8Experts through moekit's fp8 path, against the float model (PASS: rel L2 < 5e-2) and transformers'
            eager FP8Experts loop (INFO where it cannot run offline); the saved fp8 checkpoint reloaded (PASS:
            bit-equal); use_moekit_blocks on it (PASS: both swapped, rel L2 < 1e-2 to the experts implementation);
            every linear converted and dequantize=True (INFO: what transformers does).
  offload   device_map with layer 1 on "cpu" ("disk" in the CPU smoke; accelerate hooks every block; layer 1's
            weights on meta between forwards): the experts implementation (PASS: rel L2 < 1e-2 of the float model),
            then use_moekit_blocks(quant="int8_w8a16"): layer 0 swapped and running (logits moved, rel < 5e-2),
            layer 1 left naming the meta device.

PASS / FAIL / INFO lines first, a table last, JSON under --out. accelerate missing: device_map and FineGrainedFP8Config
are transformers' refusals, said as INFO (freed then loads on the CPU and moves the model). ``--device cpu`` smokes it
where CUDA is absent (fp8 is then transformers' "No GPU" refusal).

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/usr52_device_check.py --out $OUT/usr52 --deadline 75
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

import moekit.hf
from moekit.bench.hf_models import build_model, hf_config
from moekit.bench.hf_quant import FP8_TINY
from moekit.hf import use_moekit_blocks

IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))  # [B, L]
RESULTS: list[dict] = []


def report(kind: str, name: str, detail: str) -> None:
    print(f"{kind} {name}: {detail}", flush=True)
    RESULTS.append({"kind": kind, "name": name, "detail": detail})


def check(name: str, ok: bool, detail: str) -> None:
    report("PASS" if ok else "FAIL", name, detail)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS.to(model.device)).logits.float()


def tokens(model) -> list:
    with torch.no_grad():
        out = model.generate(IDS.to(model.device), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out[:, IDS.shape[1]:].tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def freed(tmp: Path, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM

    for name, quant in (("qwen3", "int4_w4a16"), ("deepseek-v3", "fp8_block")):
        model = build_model(hf_config(name, 2, tiny=True), torch.bfloat16, device, seed=3)
        use_moekit_blocks(model, quant=quant, keep_float=False, progress=False)
        saved, greedy = logits(model), tokens(model)
        path = tmp / f"freed-{name}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model.save_pretrained(path)
        where = {"device_map": device.type} if has_accelerate() else {}  # else loaded on the CPU, then moved
        loaded = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit", dtype=torch.bfloat16,
                                                      **where).to(device).eval()
        diff = (logits(loaded) - saved).abs().max().item()
        same = tokens(loaded) == greedy
        how = f"device_map={device.type!r}" if where else f"then .to({device.type!r})"
        check(f"freed {name} {quant}", diff == 0.0 and same, f"from_pretrained(experts_implementation='moekit', "
              f"{how}): max |diff| {diff:.3g}, greedy tokens {'equal' if same else 'differ'}")


def fp8(tmp: Path, device: torch.device) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = hf_config("qwen3", 2, tiny=True)
    for key, value in FP8_TINY["qwen3"].items():
        setattr(cfg, key, value)
    model = build_model(cfg, torch.bfloat16, device, seed=3)
    floats = logits(model)
    path = tmp / "fp8-float"
    model.save_pretrained(path)
    keep = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]  # every non-experts linear

    def load(where, impl, **config):
        return AutoModelForCausalLM.from_pretrained(
            where, experts_implementation=impl, dtype=torch.bfloat16, device_map=device.type,
            quantization_config=transformers.FineGrainedFP8Config(weight_block_size=(128, 128), **config)).eval()

    try:
        ours = load(path, "moekit", modules_to_not_convert=keep)
    except Exception as err:  # transformers' refusals (no GPU): said, not failed
        report("INFO", "fp8 experts at load", f"{type(err).__name__}: {str(err)[:300]}")
        return
    kind = type(ours.model.layers[0].mlp.experts).__name__
    got = logits(ours)
    check("fp8 experts at load, moekit", kind == "FP8Experts" and rel(got, floats) < 5e-2,
          f"{kind}; rel L2 to the float model {rel(got, floats):.3g}")
    try:
        theirs = logits(load(path, "eager", modules_to_not_convert=keep))
        report("INFO", "fp8 experts at load, eager", f"rel L2 moekit to transformers' loop {rel(got, theirs):.3g}")
    except Exception as err:
        report("INFO", "fp8 experts at load, eager", f"{type(err).__name__}: {str(err)[:300]}")
    saved = tmp / "fp8-saved"
    ours.save_pretrained(saved)
    again = AutoModelForCausalLM.from_pretrained(saved, experts_implementation="moekit", dtype=torch.bfloat16,
                                                 device_map=device.type).eval()
    diff = (logits(again) - got).abs().max().item()
    check("fp8 checkpoint reloaded, moekit", diff == 0.0, f"max |diff| to the model it was saved from {diff:.3g}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        swap = use_moekit_blocks(ours, progress=False)  # FP8Experts kept fp8 in moekit's layer
    blocks = logits(ours)
    check("fp8 experts at load, blocks", len(swap.swapped) == 2 and rel(blocks, got) < 1e-2,
          f"{len(swap.swapped)} swapped; rel L2 to the experts implementation {rel(blocks, got):.3g}")
    for label, where, config in (("every linear fp8", path, {}), ("dequantize=True", saved, {"dequantize": True})):
        try:
            other = load(where, "moekit", **config)
            report("INFO", f"fp8 {label}", f"{type(other.model.layers[0].mlp.experts).__name__}; rel L2 to the float "
                   f"model {rel(logits(other), floats):.3g}")
        except Exception as err:
            report("INFO", f"fp8 {label}", f"{type(err).__name__}: {str(err)[:300]}")


def offload(tmp: Path, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM

    model = build_model(hf_config("qwen3", 2, tiny=True), torch.bfloat16, device, seed=3)
    floats = logits(model)
    path = tmp / "offload-float"
    model.save_pretrained(path)
    where = {n: device.type for n in ("model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb",
                                      "lm_head")}
    where["model.layers.1"] = "cpu" if device.type == "cuda" else "disk"  # offloaded: its weights on meta
    loaded = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit", dtype=torch.bfloat16,
                                                  device_map=where, offload_folder=str(tmp / "offload")).eval()
    got = logits(loaded)
    check("offload experts implementation", rel(got, floats) < 1e-2,
          f"rel L2 to the float model {rel(got, floats):.3g}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        swap = use_moekit_blocks(loaded, quant="int8_w8a16", progress=False)
    swapped = [b.path for b in swap.swapped]
    reason = swap.left[0].reason if swap.left else ""
    after = logits(loaded)
    check("offload blocks", swapped == ["model.layers.0.mlp"] and "meta device" in reason
          and 0 < rel(after, got) < 5e-2,
          f"swapped {swapped}, left {[b.path for b in swap.left]}; rel L2 int8 to the float {rel(after, got):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=75.0, help="seconds: parts not begun by then are skipped")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    start, device = time.perf_counter(), torch.device(args.device)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, moekit.hf.HF_BACKEND "
          f"{moekit.hf.HF_BACKEND}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"accelerate {'yes' if has_accelerate() else 'missing'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for part in (freed, fp8, offload):
            if time.perf_counter() - start > args.deadline:
                report("INFO", part.__name__, "not begun: past the deadline")
                continue
            if not has_accelerate() and part is not freed:
                report("INFO", part.__name__, "accelerate is not installed: transformers refuses device_map= and "
                                              "FineGrainedFP8Config without it")
                continue
            try:
                part(Path(tmp), device)
            except Exception as err:
                traceback.print_exc()
                report("FAIL", part.__name__, f"{type(err).__name__}: {str(err)[:300]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "usr52.json").write_text(json.dumps(RESULTS, indent=1))
    print(f"\n| result | check | detail |\n| --- | --- | --- |")
    for r in RESULTS:
        print(f"| {r['kind']} | {r['name']} | {r['detail'][:120]} |")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
