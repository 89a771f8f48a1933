"""Session 34 (branch `fam34`): the router options moekit learnt for the refused families, on the GPU. Each case is a
family's real MoE layer shape with its option on (bf16, random weights, the CUDA defaults: backend auto = triton,
router auto, which falls back to ``moekit.route`` for a changed option), against the same layer with the option off.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/fam34_device_check.py --out $OUT/fam34 --deadline 66   # H200
    PYTHONPATH=$PWD python3 benchmarks/fam34_device_check.py --smoke     # CPU: tiny shapes, triton backend and
                                                                         # the twin's fused router interpreted

Per case (skipped past the deadline; the JSON <out>/fam34.json rewritten after each):
  checks   the option's layer routes with ``route`` (no fused router) and the option-off layer with the fused one;
           its output at M = 64 against a float64 loop written here over the routing ``route`` gives on
           the layer's own logits in float64 (the option's semantics spelt out again: identity slots add w x, input
           weighting runs expert(w x), the averaged shared expert counts half): rel-L2 PASS < 2e-2.
  timing   eager forward µs a call to completion (no grad), option on and off interleaved, --rounds rounds, at M = 1
           and 64: what falling back to ``route`` costs where the fused router would take the option-off layer.
The table is printed last: median µs on / off and x (off median / on median; rounds >= 3% faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import versus  # noqa: E402
from bench_run import RunLog, case_args, rel_l2, run_cases  # noqa: E402

RUN = RunLog("fam34: session 34's router options on the GPU (eager forward µs a call, median of rounds)", stall_s=60.0)
RESULT: dict = {"run": {}, "cases": {}, "failed": RUN.failed}
SIGMOID_BIAS = dict(scoring="sigmoid", use_correction_bias=True)
# name -> (MoEConfig fields with the option on, the option's fields off): each family's layer as its reader reads it
CASES = {  # the order they run in: the least tested paths first (identity ids -1, one experts call a slot)
    "longcat_identity": (dict(hidden_size=6144, moe_intermediate_size=2048, num_experts=512, top_k=12,
                              renormalize=False, routed_scaling_factor=6.0, use_correction_bias=True,
                              num_identity_experts=256), dict(num_identity_experts=0)),
    "llama4_input_weighted": (dict(hidden_size=5120, moe_intermediate_size=8192, num_experts=16, top_k=1,
                                   scoring="sigmoid", renormalize=False, shared_expert_intermediate_size=8192,
                                   expert_weight_on="input"), dict(expert_weight_on="output")),
    "kolibri_bias_on_logits": (dict(hidden_size=2560, moe_intermediate_size=512, num_experts=384, top_k=6,
                                    **SIGMOID_BIAS, renormalize=False, shared_expert_intermediate_size=512,
                                    correction_bias_on="logits"), dict(correction_bias_on="scores")),
    "laguna_softcap": (dict(hidden_size=2048, moe_intermediate_size=512, num_experts=256, top_k=8, **SIGMOID_BIAS,
                            shared_expert_intermediate_size=512, router_logit_softcap=30.0),
                       dict(router_logit_softcap=0.0)),
    "axk2_groups_zero_fill": (dict(hidden_size=2048, moe_intermediate_size=512, num_experts=128, top_k=8,
                                   **SIGMOID_BIAS, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                                   shared_expert_intermediate_size=512, group_score="top2_sum",
                                   dropped_group_fill="zero"), dict(group_score="auto", dropped_group_fill="-inf")),
    "mistral4_groups_top2": (dict(hidden_size=4096, moe_intermediate_size=2048, num_experts=128, top_k=4, n_group=8,
                                  topk_group=4, shared_expert_intermediate_size=2048, group_score="top2_sum",
                                  dropped_group_fill="zero"), dict(group_score="auto", dropped_group_fill="-inf")),
    "cohere2_average": (dict(hidden_size=8192, moe_intermediate_size=22528, num_experts=8, top_k=2,
                             shared_expert_intermediate_size=22528, shared_expert_combine="average"),
                        dict(shared_expert_combine="sum")),
}
TINY = dict(hidden_size=32, moe_intermediate_size=16)
ARGS = argparse.Namespace()


def build(name: str, dev):
    """(the option's layer, the option-off layer over the same experts and shared MLP: its gate too, but for the
    identity experts' wider one), bf16 on ``dev``, the correction bias random (std 0.05)."""
    from moekit import MoE, MoEConfig

    on, off = CASES[name]
    if SMOKE:
        on = dict(on, **TINY, num_experts=min(on["num_experts"], 16))
        on.update(shared_expert_intermediate_size=16 if on.get("shared_expert_intermediate_size") else 0)
        on.update(num_identity_experts=min(on.get("num_identity_experts", 0), 8))
    cfg = MoEConfig(**on)
    torch.manual_seed(0)
    kw = dict(backend="triton") if SMOKE else {}  # the CUDA default, interpreted
    layer = MoE(cfg, dtype=torch.bfloat16, device=dev, **kw)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.normal_(std=0.05)
    # the same experts (and fused slots or separate shared MLP: the layer's choice, input weighting keeps it apart)
    twin = MoE(cfg.replace(**off), dtype=torch.bfloat16, device=dev, num_local_experts=0, fuse_shared=layer.fuse_shared,
               router="fused" if SMOKE else "auto", **kw)
    twin.w13, twin.w2 = layer.w13, layer.w2
    if layer.shared_w13 is not None:
        twin.shared_w13, twin.shared_w2 = layer.shared_w13, layer.shared_w2
    if twin.gate.weight.shape == layer.gate.weight.shape:
        twin.gate.weight = layer.gate.weight
    if twin.e_score_correction_bias is not None:
        twin.e_score_correction_bias.copy_(layer.e_score_correction_bias[: cfg.num_experts])
    return layer, twin


def _mlp(x, w13, w2):
    """x [R, K] -> [R, K] through one gated SiLU MLP in float64 (w13 [2N, K], w2 [K, N])."""
    gate, up = (x @ w13.double().t()).chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up) @ w2.double().t()


def reference(layer, x) -> torch.Tensor:
    """The layer's output in float64 from ``route`` on its own logits (float64): the option's semantics again."""
    from moekit import route

    cfg, e = layer.config, layer.config.num_experts
    with torch.no_grad():
        logits = layer.gate(x).double()
        bias = layer.e_score_correction_bias
        r = route(logits, cfg, None if bias is None else bias.double())
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    ids, w = r.topk_ids.long(), r.topk_weights.double()  # [M, k]; the routed weights carry the averaged half
    out += (torch.where(ids >= e, w, 0.0).sum(1, keepdim=True)) * x64  # identity slots: w x
    for ex in ids[ids < e].unique().tolist():
        rows, slot = (ids == ex).nonzero(as_tuple=True)
        wx = w[rows, slot, None]
        if cfg.expert_weight_on == "input":
            out.index_add_(0, rows, _mlp(wx * x64[rows], layer.w13[ex], layer.w2[ex]))
        else:
            out.index_add_(0, rows, wx * _mlp(x64[rows], layer.w13[ex], layer.w2[ex]))
    if cfg.has_shared_expert:
        shared = _mlp(x64, layer.shared_w13, layer.shared_w2) if layer.shared_w13 is not None else sum(
            _mlp(x64, layer.w13[s], layer.w2[s]) for s in range(e, layer.w13.shape[0]))  # the fused slots
        out += cfg.shared_weight * shared
    return out


def check(name: str, layer, twin, dev) -> dict:
    from moekit.routing import fused

    m = 8 if SMOKE else 64
    x = torch.randn(m, layer.config.hidden_size, device=dev, dtype=torch.bfloat16)
    # the option's layer: route, or since rfast34 the fused router where it computes the option (on CUDA)
    wants = fused.computes(layer.config) and dev.type == "cuda"
    RUN.check(f"{name} routes as fused.computes says ({'fused' if wants else 'route'}), the option-off twin fused",
              (layer._fused_router is not None) == wants and twin._fused_router is not None)  # smoke: "fused"
    with torch.no_grad():
        err = rel_l2(layer(x), reference(layer, x))
    RUN.check(f"{name} M={m} vs float64", err < 2e-2, f"rel_l2={err:.2e}")
    return {"rel_l2_vs_fp64": err}


def timed(layers: dict, m: int, dev) -> dict:
    """name -> µs a forward to completion, each of --rounds interleaved rounds (the order turned each round)."""
    hidden = next(iter(layers.values())).config.hidden_size
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    per, names, calls = {n: [] for n in layers}, list(layers), 2 if SMOKE else 20
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for layer in layers.values():
            layer(x)
            layer(x)
        for r in range(ARGS.rounds):
            for n in names[r % 2:] + names[: r % 2]:
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    layers[n](x)
                sync()
                per[n].append((time.perf_counter() - t0) * 1e6 / calls)
    return per


def run_case(name: str, dev) -> None:
    layer, twin = build(name, dev)
    res = RESULT["cases"][name] = check(name, layer, twin, dev)
    for m in (1, 64) if not SMOKE else (1,):
        per = timed({"on": layer, "off": twin}, m, dev)
        res[f"M{m}_us"] = per
        line = (f"{name:24s} M={m:3d}  on {statistics.median(per['on']):8.1f}  off {statistics.median(per['off']):8.1f}"
                f"  off/on {versus(per['on'], per['off'])}")
        RUN.summary.append(line)
        RUN.log(line)
    del layer, twin
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    case_args(__doc__, 66.0, CASES, ARGS)
    dev = torch.device("cpu" if SMOKE else "cuda")
    run_cases(RUN, RESULT, ARGS, "fam34", lambda name: run_case(name, dev))


if __name__ == "__main__":
    main()
