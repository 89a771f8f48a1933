"""Session 54 (ft54): a fine-tuner's step on the GPU, a Qwen3-MoE-like model built from a config (random weights).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/ft54_device_check.py --out $OUT/ft54 --deadline 70   # H100 / H200
    PYTHONPATH=$PWD python3 benchmarks/ft54_device_check.py --smoke --out /tmp/ft54ck   # CPU, TRITON_INTERPRET=1
    PYTHONPATH=$PWD python3 benchmarks/ft54_device_check.py --cpu --out /tmp/ft54cpu --deadline 600   # CPU, real widths

Correctness (PASS / FAIL): ``use_moekit_blocks`` with ``gradient_checkpointing_enable(use_reentrant=False)``, with
``output_router_logits=True`` (the blocks run their own forward; the recomputation takes the forward's choice: session
54's fix) and without (moekit's layer recomputed; on CUDA its Triton backward), in fp32 and bf16, against the same
swapped model without checkpointing (rel L2 of every gradient, bf16: < 1e-2) and against transformers' eager experts
(fp32: < 1e-4; bf16 said as INFO: a routing tie moves a token to another expert, and the worst gradient, a rarely
chosen expert's, shows it).
Speed: one training step (forward + backward, ``ROUNDS`` interleaved rounds, median ms) of a float32 model (no
autocast, and under ``torch.autocast("cuda", bf16)``, what ``Trainer(bf16=True)`` runs) for the experts
implementations eager / grouped_mm / moekit and the swapped blocks, and of the same model cast to bf16 (``--cpu``: no
eager rows); the experts see a float32 x under
autocast (the residual stream), so grouped_mm and moekit run them in float32 where eager's per-expert F.linear runs
bf16: the table says what that costs. The table is printed last; JSON <out>/ft54.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402

import moekit.hf  # noqa: E402

ROUNDS = 2 if SMOKE else 5
T0 = time.perf_counter()


def config(smoke: bool) -> transformers.Qwen3MoeConfig:
    """Qwen3-30B-A3B's shape family at 2 layers (hidden 1024, 64 experts of 256, top-8); tiny in smoke mode."""
    if smoke:
        return transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                                       moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8)


def build(impl: str, device: str, dtype: torch.dtype, state: dict | None) -> torch.nn.Module:
    """The model with ``impl`` experts ("blocks": eager, then every block swapped), ``state`` loaded, training mode."""
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a CPU init of the GPU run's 110M weights: seconds each)
        model = transformers.AutoModelForCausalLM.from_config(
            config(SMOKE), experts_implementation="eager" if impl == "blocks" else impl)
    if state is not None:
        model.load_state_dict(state)
    model = model.to(dtype=dtype).train()
    if impl == "blocks":
        moekit.hf.use_moekit_blocks(model)
    return model


def grads(model, ids, **kwargs) -> dict:
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()  # with output_router_logits: the aux loss times router_aux_loss_coef included
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def worst(ref: dict, got: dict) -> float:
    if set(ref) != set(got):
        return float("inf")
    return max(((ref[k] - got[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)


def check_checkpointing(device: str, state: dict, ids: torch.Tensor, dtype: torch.dtype, logits: bool) -> dict:
    """The swapped model with non-reentrant checkpointing against itself without, and eager's; ``logits``: with
    router logits (the blocks then run their own forward), else moekit's layer (on CUDA its Triton backward)."""
    plain = grads(build("blocks", device, dtype, state), ids, output_router_logits=logits)
    model = build("blocks", device, dtype, state)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        checkpointed = grads(model, ids, output_router_logits=logits)
        err = worst(plain, checkpointed)
    except Exception as exc:  # noqa: BLE001  (CheckpointError before the fix: reported as a FAIL)
        print(f"  checkpointing raised {type(exc).__name__}: {str(exc)[:200]}")
        err = float("inf")
    eager = grads(build("eager", device, dtype, state), ids, output_router_logits=logits)
    tight, loose = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, None)
    res = {"vs_unchecked": err, "vs_eager": worst(eager, plain)}
    what = f"{str(dtype)[6:]}, router logits {'on' if logits else 'off'}"
    print(f"{'PASS' if err < tight else 'FAIL'} blocks + checkpointing vs unchecked ({what}): rel {err:.2e}")
    # bf16: a routing tie (k-th and (k+1)-th bf16 logits equal) moves a token to another expert (docs/hf.md, the
    # router's dtype), so the worst gradient (a rarely chosen expert's row) differs by more than bf16 rounding: said
    verdict = ("PASS" if res["vs_eager"] < loose else "FAIL") if dtype == torch.float32 else "INFO"
    print(f"{verdict} blocks vs eager gradients ({what}): rel {res['vs_eager']:.2e}")
    return res


def step_ms(models: dict, ids: torch.Tensor, autocast: dict, deadline: float) -> dict:
    """Median ms of one forward + backward per model, ROUNDS interleaved rounds (stops at the deadline)."""
    times = {name: [] for name in models}
    for _ in range(ROUNDS + 1):  # the first round warms up
        for name, model in models.items():
            if time.perf_counter() - T0 > deadline:
                break
            sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
            sync()
            start = time.perf_counter()
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast[name]):
                model(input_ids=ids, labels=ids).loss.backward()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
            model.zero_grad(set_to_none=True)
    return {name: statistics.median(t[1:]) if len(t) > 1 else float("nan") for name, t in times.items()}


def timed_models(device: str, state: dict, with_eager: bool) -> dict:
    """The models timed, by row name: "<mode>:<impl>", mode fp32 (float32, no autocast), autocast (float32 under bf16
    autocast) or bf16 (the model cast); eager's rows left out on the CPU (its loop's backward: 20-40 s a step)."""
    eager = ("eager",) if with_eager else ()
    rows = [("fp32", torch.float32, ("grouped_mm", "moekit", "blocks")),
            ("autocast", torch.float32, (*eager, "grouped_mm", "moekit", "blocks")),
            ("bf16", torch.bfloat16, (*eager, "grouped_mm", "moekit", "blocks"))]
    return {f"{mode}:{impl}": build(impl, device, dtype, state) for mode, dtype, impls in rows for impl in impls}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline", type=float, default=70.0)
    parser.add_argument("--out", default="ft54-out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="the GPU run's widths on the CPU, batch 2 x 256")
    args = parser.parse_args()
    device = "cpu" if SMOKE or args.cpu else "cuda"
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in transformers.AutoModelForCausalLM.from_config(config(SMOKE)).state_dict().items()}
    vocab = config(SMOKE).vocab_size
    ids = torch.randint(0, vocab, (2, 16) if SMOKE else (2, 256) if args.cpu else (4, 1024), device=device)
    result = {"device": "cpu" if device == "cpu" else torch.cuda.get_device_name(), "smoke": SMOKE}
    for dtype in (torch.float32, torch.bfloat16):
        for logits in (True, False):
            key = f"checkpointing_{str(dtype)[6:]}_{'logits' if logits else 'layer'}"
            result[key] = check_checkpointing(device, state, ids[:, :64], dtype, logits)
    models = timed_models(device, state, with_eager=not args.cpu)
    autocast = {name: name.startswith("autocast") for name in models}
    result["step_ms"] = step_ms(models, ids, autocast, args.deadline)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ft54.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{result['device']}: one training step, batch {tuple(ids.shape)}, median of {ROUNDS} rounds")
    print(f"{'model':24s} {'ms':>9s}")
    for name, ms in result["step_ms"].items():
        print(f"{name:24s} {ms:9.2f}")


if __name__ == "__main__":
    main()
