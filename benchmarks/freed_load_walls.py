"""What ``from_pretrained`` of a freed checkpoint costs (``use_moekit_blocks(..., quant=..., keep_float=False)`` then
``save_pretrained``) against the float checkpoint's: its wall, where the time goes (``cProfile``: moekit's quantizer,
transformers' init of the missing weights, moekit's load of the experts file) and the process's peak RSS, each load a
fresh interpreter.

    PYTHONPATH=$PWD python3 benchmarks/freed_load_walls.py --dir DIR [--layers 4] [--tree PATH] [--out FILE]
        [--device-map {none,layers,auto}]

A Qwen3-MoE built offline from a config (random weights, float32: hidden 1024, 32 experts of width 512, top-4, vocab
512; ``--layers`` decoder layers, each MoE) is saved float, then loaded, swapped and freed with each scheme and saved
beside it (``DIR``, kept for the next run; ~1.6 GB at 4 layers); each folder is loaded with ``moekit.hf`` imported
and the freed model's logits compared with the saved model's (bit-equal). ``--tree`` loads with another checkout's
moekit (``git archive BASE moekit | tar -x -C DIR``), on the same folders. CPU only, no GPU.

``--device-map`` loads over several places, as a user whose float model does not fit does (accelerate's dispatch,
an ``offload_folder`` under ``DIR``): ``layers`` maps the embedding, the first half of the decoder layers, the norm
and the head to "cpu" and the other layers to "disk"; ``auto`` is ``device_map="auto"`` with ``max_memory`` of the
CPU at half the float checkpoint's bytes (transformers plans the map for float experts), the rest on "disk". A load
that fails is a row with its ``error`` (before session 54 a freed checkpoint under such a map was refused after the
load). ``forward_s``, ``rss_forward_mb``: one forward's wall and the peak after it (an offloaded layer's weights are
read during it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4", "fp8_block")
# (the part, a function cProfile names: file suffix and name) summed by cumulative time
PARTS = (("quantize", "quant/schemes.py", "quantize"), ("init", "modeling_utils.py", "initialize_weights"),
         ("experts_file", "hf/saving.py", "load_saved_file"))

LOAD = """
import cProfile, json, pstats, sys, time
from pathlib import Path
import torch
import moekit.hf
from transformers import AutoModelForCausalLM

folder, parts, where = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])


def peak_mb():  # VmHWM: this process image's peak (getrusage's maxrss keeps the forking parent's across exec: the
    # first run, which built the checkpoints in the parent, read 3.3 GB for every load)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024


profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
try:
    model = AutoModelForCausalLM.from_pretrained(folder, **where).eval()
except (ValueError, RuntimeError, KeyError) as err:
    wall = time.perf_counter() - start
    print(json.dumps({"folder": folder.name, "wall_s": round(wall, 2), "max_rss_mb": round(peak_mb()),
                      "error": f"{type(err).__name__}: {str(err)[:160]}"}))
    sys.exit(0)
profile.disable()
wall = time.perf_counter() - start
rss = peak_mb()
spent = {name: 0.0 for name, _, _ in parts}
for (file, _, fn), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
    for name, suffix, function in parts:
        spent[name] += cumulative if file.endswith(suffix) and fn == function else 0.0
equal = forward = None
if (folder / "saved.pt").exists():
    ids, saved = torch.load(folder / "saved.pt")
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(ids).logits
        forward = round(time.perf_counter() - start, 3)
        equal = torch.equal(logits, saved)
places = sorted({str(v) for v in (getattr(model, "hf_device_map", None) or {"": "one"}).values()})
print(json.dumps({"folder": folder.name, "wall_s": round(wall, 2), "max_rss_mb": round(rss),
                  **{k: round(v, 2) for k, v in spent.items()}, "bit_equal": equal, "forward_s": forward,
                  "rss_forward_mb": round(peak_mb()), "places": places}))
"""


def config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                          num_experts=32, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False)


def prepare(root: Path, layers: int) -> None:
    """The float checkpoint and one freed checkpoint per scheme under ``root`` (kept where there already)."""
    import torch
    from transformers import AutoModelForCausalLM

    import moekit.hf

    if not (root / "float" / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(layers), dtype=torch.float32).save_pretrained(root / "float")
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))  # [B, L]
    for scheme in SCHEMES:
        if (root / scheme / "saved.pt").exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(root / "float").eval()
        moekit.hf.use_moekit_blocks(model, quant=scheme, keep_float=False, progress=False)
        with torch.no_grad():
            logits = model(ids).logits  # [B, L, V]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # save_pretrained's word on the experts file
            model.save_pretrained(root / scheme)
        torch.save((ids, logits), root / scheme / "saved.pt")


def placement(kind: str, root: Path, layers: int) -> dict:
    """``from_pretrained``'s keywords for ``--device-map kind`` (none: {})."""
    if kind == "none":
        return {}
    where = {"offload_folder": str(root / "offload")}
    if kind == "auto":  # half the float checkpoint's bytes on the CPU: accelerate plans the rest on "disk"
        size = (root / "float" / "model.safetensors").stat().st_size
        return {**where, "device_map": "auto", "max_memory": {"cpu": size // 2}}
    cpu = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(layers // 2)), "model.norm",
           "model.rotary_emb", "lm_head"]
    return {**where, "device_map": {**dict.fromkeys(cpu, "cpu"),
                                    **{f"model.layers.{i}": "disk" for i in range(layers // 2, layers)}}}


def load(folder: Path, tree: Path, where: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", LOAD, str(folder), json.dumps(PARTS), json.dumps(where)], env=env,
                          cwd=tree,
                          capture_output=True, text=True, timeout=1800)  # cwd: "-c" puts it first on sys.path
    if done.returncode != 0:
        raise SystemExit(f"freed_load_walls: the load of {folder} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoints are written (kept)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, each MoE (default 4)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose moekit loads (default: this)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    parser.add_argument("--device-map", choices=("none", "layers", "auto"), default="none",
                        help="one place (none, the default), or over cpu and disk (see the module doc)")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    prepare(args.dir, args.layers)
    where = placement(args.device_map, args.dir.resolve(), args.layers)
    rows = [load(args.dir.resolve() / name, args.tree.resolve(), where) for name in ("float", *SCHEMES)]
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
