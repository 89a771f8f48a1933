"""usr51 device check (session 51, a demanding user's sixth hour), on the GPU machine's torch and Triton (2.11 / 3.6
there; the branch was written on 2.13 / 3.9, the CPU):

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/usr51_device_check.py --out $OUT/usr51 --deadline 75

PASS / FAIL, one line a case, correctness only (nothing here is a speed question: the branch changed what
``save_pretrained`` writes and how it loads back, not a kernel):
  saved   a tiny transformers model built offline (bench --hf's tiny widths, 2 layers, bf16, random weights) on the
          GPU, its blocks swapped with ``use_moekit_blocks(quant=..., keep_float=False)`` (backend "auto": the Triton
          kernels on CUDA); its logits and a greedy 4-token generate; ``save_pretrained``; then ``from_pretrained``
          (bf16) moved to the GPU, swapped alike and run once on its random experts (the kernels' and the layer's
          kept state built on them), then ``moekit.hf.load_quantized_experts``: logits bit-equal and the same tokens.
          Qwen3-MoE int4_w4a16, gpt-oss mxfp4 (transposed experts, biases), DeepSeek-V3 fp8_block (a shared expert,
          the float32 router), Mixtral int8_w8a16 (checkpoint names renamed by transformers).
``--smoke``: the same on the CPU. JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

CASES = [("qwen3", "int4_w4a16"), ("gpt-oss-20b", "mxfp4"), ("deepseek-v3", "fp8_block"), ("mixtral", "int8_w8a16")]
NEW_TOKENS = 4


def _run(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, L, V], greedy tokens [1, P + NEW_TOKENS] of the first row)."""
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids[:1], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return logits, tokens


def check_saved(name: str, scheme: str, device: str) -> dict:
    import moekit.hf as moekit_hf
    from moekit.bench.hf_models import build_model, hf_config

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(hf_config(name, 2, tiny=True), dtype, torch.device(device), seed=5)
    report = moekit_hf.use_moekit_blocks(model, quant=scheme, keep_float=False, progress=False)
    first = next(m for m in model.modules() if "_moekit_swap" in vars(m))
    backend = str(vars(first)["_moekit_swap"].moe).splitlines()[1].strip()  # its repr: quant, backend=auto (...)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)  # [B, L]
    want_logits, want_tokens = _run(model, ids)
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.save_pretrained(path)
        loaded = type(model).from_pretrained(path, dtype=dtype).to(device).eval()
        moekit_hf.use_moekit_blocks(loaded, quant=scheme, keep_float=False, progress=False)
        _run(loaded, ids)  # on the random experts first: state kept from them must not survive the load
        again = moekit_hf.load_quantized_experts(loaded, path)
        got_logits, got_tokens = _run(loaded, ids)
    warned = any("load_quantized_experts" in str(w.message) for w in said)
    equal = torch.equal(got_logits, want_logits) and torch.equal(got_tokens, want_tokens)
    return {"pass": bool(equal and warned and len(again.swapped) == len(report.swapped) > 0),
            "logits_equal": torch.equal(got_logits, want_logits), "tokens_equal": torch.equal(got_tokens, want_tokens),
            "max_abs_diff": (got_logits.float() - want_logits.float()).abs().max().item(), "warned": warned,
            "blocks": len(report.swapped), "layer": backend}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU (no GPU needed)")
    parser.add_argument("--deadline", type=float, default=75.0, help="seconds; cases after it are not started")
    parser.add_argument("--out", type=Path, default=Path("usr51_out"))
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    device = "cpu" if args.smoke else "cuda"
    start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "cases": {}}
    for name, scheme in CASES:
        key = f"{name} {scheme}"
        if time.perf_counter() - start > args.deadline:
            results["cases"][key] = {"pass": False, "error": "not started: past the deadline"}
        else:
            try:
                results["cases"][key] = check_saved(name, scheme, device)
            except Exception as err:  # noqa: BLE001  (a case's failure is its FAIL line, the others still run)
                results["cases"][key] = {"pass": False, "error": f"{type(err).__name__}: {err}"[:400]}
        case = results["cases"][key]
        print(f"{'PASS' if case['pass'] else 'FAIL'} saved {key}: {json.dumps(case)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "usr51_device_check.json").write_text(json.dumps(results, indent=2))
    print(f"{sum(c['pass'] for c in results['cases'].values())} of {len(CASES)} PASS in "
          f"{time.perf_counter() - start:.0f} s on {results['device']}; wrote {args.out / 'usr51_device_check.json'}")
    return 0 if all(c["pass"] for c in results["cases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
