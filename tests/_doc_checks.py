"""What ``test_docs.py`` holds each docs section's examples to, keyed by the section's heading: the results the
example leaves in its namespace and what it printed, against a reference computed here (a float64 loop, the
untouched model's logits, a closed-form bound)."""

from __future__ import annotations

import math
import re

import torch

from _helpers import experts_loop, rel_l2


def api(ns: dict, printed: str) -> None:
    """README "The API in a few lines": the layer's shapes and stats, the router's dtypes, and ``run_experts``
    against a float64 per-token loop."""
    x, cfg = ns["x"], ns["cfg"]
    assert ns["y"].shape == (4, 32, 256) and torch.equal(ns["result"].out, ns["y"])
    assert int(ns["result"].stats.counts.sum()) == 4 * 32 * cfg.top_k
    ids, weights = ns["routing"].topk_ids, ns["routing"].topk_weights
    assert ids.dtype == torch.int32 and ids.shape == (8, cfg.top_k) and weights.dtype == torch.float32
    want = experts_loop(x.reshape(-1, 256), ns["moe"].w13.detach(), ns["moe"].w2.detach(), ids.repeat(16, 1),
                        weights.repeat(16, 1))
    assert rel_l2(ns["out"], want) < 1e-5


def quant(ns: dict, printed: str) -> None:
    """README "Quantized experts": the fp8 layer's output, and int4 within half a step of each group's grid."""
    y = ns["y"]
    assert y.shape == (8, 256) and y.dtype == torch.bfloat16 and y.isfinite().all()
    assert ns["moe"].quant_scheme == "fp8_block"
    weight, back = ns["weight"], ns["w"].dequantize()
    groups = weight.reshape(8, 512, 2, 128)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15  # 4 bits: 15 steps a group
    assert ((back.reshape(groups.shape) - groups).abs() <= step / 2 + 1e-6).all()
    assert printed == f"{rel_l2(back, weight):.3f}\n" and 0.09 <= float(printed) <= 0.11  # the comment's 0.100


def offload(ns: dict, printed: str) -> None:
    """README "Experts that do not fit": the offloaded model's logits are the model's; the layer is the MoE's."""
    with torch.no_grad():
        assert rel_l2(ns["model"](ns["ref_ids"]).logits, ns["ref_logits"]) < 1e-5
        x = torch.randn(5, ns["moe"].w13.shape[-1], generator=torch.Generator().manual_seed(3))
        assert rel_l2(ns["layer"](x), ns["moe"](x)) < 1e-5
    assert ns["cache"].cache_experts == 5 and ns["cache"].stats.fetched > 0


def blocks(ns: dict, printed: str) -> None:
    """README "Every transformers MoE family": every block swapped, none left (the printed list), and after
    ``restore_blocks`` the model's own classes and logits."""
    assert len(ns["report"].swapped) == ns["ref_blocks"] and ns["report"].left == () and printed == "()\n"
    model = ns["model"]
    assert all(type(layer.mlp).__module__.startswith("transformers.") for layer in model.model.layers)
    with torch.no_grad():
        assert rel_l2(model(ns["ref_ids"]).logits, ns["ref_logits"]) < 1e-5


def parallel(ns: dict, printed: str) -> None:
    """docs/parallel.md on each of the test's ranks: the layer equals the single-process MoE it was read from on
    this rank's tokens after the rebalance moved its weights, and so does the CPU script's; rank 0 prints the
    rebalance's line, the others nothing."""
    ref, ep, x = ns["ref_moe"], ns["ep"], ns["x_local"]
    with torch.no_grad():
        assert rel_l2(ns["out"], ref(ns["batch"])) < 1e-5  # the loop's last step, after the rebalance
    report = ns["report"]  # the placement in use is the report's, never worse than the one before
    assert ep.placement.slots == report.placement.slots and report.max_load_after <= report.max_load_before
    assert report.placement.num_redundant == 32  # EPLB's replicas, which the training loop after it keeps equal
    trained = _trained_single_copy(ref, ns["dist"].get_world_size())
    with torch.no_grad():  # the trained EP layer (replicas synced) is the single copy trained on every rank's batches
        assert rel_l2(ep(x), trained(x)) < 1e-5 and rel_l2(trained(x), ref(x)) > 1e-2
    with torch.no_grad():  # the CPU script: this rank's tokens through the small layer's EP twin
        assert ns["cpu_out"].shape == ns["tokens"].shape and rel_l2(ns["cpu_out"], ns["small"](ns["tokens"])) < 1e-5
    if ns["dist"].get_rank() == 0:
        assert re.fullmatch(r"balancedness \d\.\d\d -> \d\.\d\d\n", printed), printed
    else:
        assert printed == ""


def _trained_single_copy(ref, world_size: int):
    """docs/parallel.md's training loop on one process: a copy of ``ref`` stepped by SGD (lr 0.1) on the mean over the
    ranks of each rank's mean squared output (``sync_grads`` averages), every rank's ``batches`` drawn again as
    ``_doc_setups.ep_checkpoint`` draws them."""
    import copy

    batches = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(2 + rank)
        torch.randn(6, 64, generator=generator)  # x_local
        batches.append([torch.randn(5 + i % 3, 64, generator=generator) for i in range(10)])
    trained = copy.deepcopy(ref)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    for step in range(10):
        (sum((trained(rank_batches[step]) ** 2).mean() for rank_batches in batches) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return trained


def routing_and_grouping(ns: dict, printed: str) -> None:
    """README "Routing and grouping": the top-2 ids and renormalised softmax weights of a float64 sort of the logits,
    the capacity drops counted and within capacity, and the layout's inverse giving back each slot's token row."""
    logits, routing = ns["logits"].double(), ns["routing"]
    order = logits.argsort(dim=-1, descending=True, stable=True)[:, :2]  # ties to the lower id, as route's contract
    assert torch.equal(routing.topk_ids.long(), order)
    top = logits.softmax(-1).gather(1, order)
    assert torch.allclose(routing.topk_weights.double(), top / top.sum(-1, keepdim=True), atol=1e-6)
    capped = ns["capped"]
    dropped = capped.routing.topk_ids < 0
    assert int(capped.dropped) == int(dropped.sum()) and (capped.kept_counts <= capped.capacity).all()
    x, back = ns["x"], ns["back"]
    assert back.shape == (6, 2, 16) and torch.equal(back, x[:, None, :].expand(6, 2, 16))
    layout = ns["layout"]
    rows = layout.segment_ids >= 0
    assert torch.equal(layout.segment_ids[rows].long(), routing.topk_ids.reshape(-1)[layout.src_of_row[rows]].long())


def backends(ns: dict, printed: str) -> None:
    """README "Experts and backends": the CPU's backends in "auto"'s order, and each backend's output against a
    float64 per-token loop."""
    assert printed == "['grouped_mm', 'reference']\n"
    want = experts_loop(ns["x"], ns["w13"], ns["w2"], ns["ids"], ns["weights"])
    for name, out in ns["outs"].items():
        assert out.shape == (12, 64) and rel_l2(out, want) < 1e-5, name


def quantize_how_to(ns: dict, printed: str) -> None:
    """docs/quantization.md "How to": the int4 layer is the float64 loop over its dequantized experts, routed as the
    float layer routes (the gate is not quantized); the error against the float layer is the comment's; the
    state_dict loads into a layer quantized alike, the same bits."""
    moe, x = ns["moe"], ns["x"]
    assert printed == "['group_size', 'symmetric']\n" and moe.quant_scheme == "int4_w4a16"
    logits = x.double() @ moe.gate.weight.double().T  # [16, 8]: Mixtral's softmax over the top 2, renormalised
    top, ids = logits.softmax(-1).topk(2, dim=-1)
    want = experts_loop(x, moe.w13.dequantize(), moe.w2.dequantize(), ids, top / top.sum(-1, keepdim=True))
    assert rel_l2(ns["y"], want) < 1e-5 and 0.1 <= ns["err"] <= 0.2
    groups = moe.w13.dequantize().shape[-1] // 64  # group_size=64 took: one scale per 64 columns
    assert moe.w13.scale.shape[-1] == groups and torch.equal(ns["again"].w13.q, moe.w13.q)
    with torch.no_grad():
        assert torch.equal(ns["again"](x), ns["y"])


def train_how_to(ns: dict, printed: str) -> None:
    """docs/training.md "How to": the layer's aux loss is 1e-2 x Switch's E * sum f_e P_e + 1e-3 x mean logsumexp^2,
    from a float64 gate and top-2 written here; the bias moved by the sign of (mean count - count), centred."""
    moe, x = ns["moe"], ns["x"]
    logits = x.reshape(-1, 64).double() @ moe.gate.weight.detach().double().T  # [32, 8]
    ids = logits.topk(2, dim=-1).indices
    f = torch.zeros(8, dtype=torch.float64).index_add_(0, ids.reshape(-1), torch.ones(64, dtype=torch.float64)) / 32
    want = 1e-2 * 8 * (f * logits.softmax(-1).mean(0)).sum() + 1e-3 * logits.logsumexp(-1).square().mean()
    with torch.no_grad():
        got = moe(x, return_aux_loss=True).aux_loss
    assert abs(float(got) - float(want)) < 1e-6 * float(want)
    counts = ns["stats"].choice_counts.double()
    assert int(counts.sum()) == 32 * 2
    sign = torch.sign(counts.mean() - counts) * 1e-3
    assert torch.allclose(ns["delta"].double(), sign - sign.mean(), atol=1e-9)
    assert torch.equal(ns["biased"].e_score_correction_bias, ns["delta"])  # the bias started at zero


def offload_how_to(ns: dict, printed: str) -> None:
    """docs/offload.md "How to": the two offloaded layers compute their MoEs' functions (the residual stack run again
    through the plain layers); the stats add up and count a fetch for every expert first seen."""
    x, h = ns["x"], ns["x"]
    with torch.no_grad():
        for moe in ns["moes"]:
            h = h + moe(h)
        assert rel_l2(ns["h"], h) < 1e-5
    stats = ns["cache"].stats
    assert printed == "True\n" and ns["cache"].cache_experts == 6
    assert stats.hits + stats.fetched == stats.touched and stats.fetched >= 6 and stats.hits > 0


def hf_how_to(ns: dict, printed: str) -> None:
    """docs/hf.md "How to": the "moekit" logits and the swapped blocks' are transformers' "eager" ones (the model
    restored, run eagerly here); the MoE from the first block is that block's function."""
    import transformers

    model, ids = ns["model"], ns["ids"]
    assert printed == "2 ()\n"
    assert all(type(layer.mlp).__module__.startswith("transformers.") for layer in model.model.layers)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        assert rel_l2(ns["logits"], eager) < 1e-5 and rel_l2(ns["swapped"], eager) < 1e-5
        block, x = model.model.layers[0].mlp, torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(4))
        assert isinstance(model, transformers.Qwen3MoeForCausalLM)
        assert rel_l2(ns["moe"](x), block(x)) < 1e-5


def simulate_how_to(ns: dict, printed: str) -> None:
    """docs/simulate.md "How to": capacity ceil(1.25 M k / E), kept = min(load, capacity), drops and imbalance from the
    loads by their definitions; DeepSeek-V3's run routes M k slots to 256 experts with its groups."""
    r = ns["result"]
    assert r.capacity == math.ceil(1.25 * 128 * 2 / 64) and sum(r.loads) == 128 * 2 and len(r.loads) == 64
    assert r.kept == [min(load, r.capacity) for load in r.loads] and r.dropped == sum(r.loads) - sum(r.kept)
    assert abs(r.imbalance - max(r.loads) / (sum(r.loads) / 64)) < 1e-12
    assert printed.splitlines()[0] == f"{r.capacity} {r.dropped} {r.imbalance:.2f}"
    assert r.balance.method == "bias" and r.balance.imbalance_after == r.imbalance
    ds = ns["ds"]  # DeepSeek-V3's card: 671B; the 248 experts a token skips in 58 MoE layers, 3 * 7168 * 2048 each
    assert sum(ds.loads) == 256 * 8 and len(ds.loads) == 256 and ds.router["n_group"] == 8
    assert round(ds.total_params / 1e9) == 671 and ds.total_params - ds.active_params == 58 * 248 * 3 * 7168 * 2048
    line = printed.splitlines()[1]
    assert line == f"671B total, {ds.active_params / 1e9:.1f}B read per token" == "671B total, 37.6B read per token"


CHECKS = {
    "The API in a few lines": api,
    "Routing and grouping": routing_and_grouping,
    "Experts and backends": backends,
    "Quantized experts: `moekit.quant`": quant,
    "Experts that do not fit: `moekit.offload`": offload,
    'Every transformers MoE family: the `"moekit"` experts implementation': blocks,
    "Expert parallelism across GPUs and nodes (`moekit.parallel`)": parallel,
    "How to: quantize a layer's experts": quantize_how_to,
    "How to: train with the balancing losses": train_how_to,
    "How to: offload experts": offload_how_to,
    "How to: run a transformers model through moekit": hf_how_to,
    "How to: simulate routing and balancing": simulate_how_to,
}
