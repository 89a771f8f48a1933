"""Expert parallelism of DeepSeek-V4's layers on 2 gloo ranks (one spawned group for every check): a hash layer
(``EPMoE.from_moe(hash_moe)`` -> ``EPHashMoE``, the table replicated; the shared expert fused and separate) against
a float64 per-token loop and, after backward and ``sync_grads``, against the single-process ``HashMoE``'s gradients
over all the tokens (the gate's, the experts', the shared expert's; the table has none); the exact and the padded
dispatch, the micro-batch overlap; the EPLB load counts; a rank calling without ``token_ids`` or with an id outside
the table; and a V4 top-k layer (sqrtsoftplus scores, the correction bias, routed scaling, the clamped SwiGLU)
against the single-process ``MoE``, forward and gradients.

Shapes: K hidden 16, N expert width 8, E experts 8 (4 a rank), k = top_k 2, V table rows 30; 5 + 7 tokens.
"""

from __future__ import annotations

import torch

from _hash_loop import hash_layer_loop
from _parallel_harness import run_ranks
from moekit import HashMoE, MoE, MoEConfig
from moekit.activations import ActivationSpec

V, SIZES = 30, (5, 7)  # table rows; tokens on rank 0, rank 1
HASH = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, scoring="sqrtsoftplus",
                 routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=8)
V4_TOP_K = HASH.replace(hash_table_size=None, use_correction_bias=True,
                        activation=ActivationSpec(name="silu", limit=1.0))  # V4's top-k layers: its swiglu_limit


def _grads(layer) -> dict:
    return {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


def _compare(rank: int, world_size: int, moe, ep, x_all, ids_all, max_tokens) -> dict:
    """(rel L2 of ep's output to the single layer's / to the float64 loop, of each gradient after sync_grads x W to
    the single layer's; the table's gradient; this rank's EPLB loads vs the bincount of its routed experts)."""
    from moekit.parallel.weights import shard_experts

    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    r_all = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(7), dtype=x_all.dtype)
    hashed = ids_all is not None
    call = (lambda layer, x, ids: layer(x, token_ids=ids)) if hashed else (lambda layer, x, ids: layer(x))
    out_all = call(moe, x_all, ids_all)
    (out_all * r_all).sum().backward()
    mine = slice(start, stop)
    out = call(ep, x_all[mine], None if ids_all is None else ids_all[mine])
    (out * r_all[mine]).sum().backward()
    ep.sync_grads()  # averaged over the W ranks: W x it is the gradient of the sum of the ranks' losses
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm())

    res = {"out": rel(out, out_all[mine]),
           "loop": rel(out, hash_layer_loop(moe, x_all, ids_all)[mine]) if hashed else 0.0}
    want = _grads(moe)
    for name, grad in _grads(ep).items():
        ref = shard_experts(want[name], ep.placement, rank) if name in ("w13", "w2") else want[name]
        res[f"grad {name}"] = rel(grad * world_size, ref)
    res["grads"] = sorted(_grads(ep))
    if hashed:
        routed = moe.tid2eid[ids_all[mine]].reshape(-1)
        res["load"] = torch.equal(ep.expert_load, torch.bincount(routed, minlength=8).double())
        res["table grad"] = ep.tid2eid.requires_grad
    return res


def _hash_moe(dtype, fuse_shared: bool = True) -> HashMoE:
    torch.manual_seed(0)  # the same weights and table on every rank
    moe = HashMoE(HASH, dtype=dtype, backend="grouped_mm", fuse_shared=fuse_shared)
    return moe.load_table_(torch.randint(0, 8, (V, 2), generator=torch.Generator().manual_seed(1)))


def _error_of(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def _scenarios(rank: int, world_size: int) -> dict:
    from moekit.parallel import EPMoE

    res = {}
    x64 = torch.randn(sum(SIZES), 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = torch.randint(0, V, (sum(SIZES),), generator=torch.Generator().manual_seed(4))
    for name, cap, fuse_shared in (("exact", None, True), ("padded", 8, False)):
        moe = _hash_moe(torch.float64, fuse_shared)
        ep = EPMoE.from_moe(moe, max_tokens_per_rank=cap)
        res[f"hash {name}"] = dict(_compare(rank, world_size, moe, ep, x64, ids, cap), cls=type(ep).__name__)
    with torch.no_grad():  # the micro-batch overlap: its chunks dispatch the table's choices too
        moe = _hash_moe(torch.float64)
        start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
        got = EPMoE.from_moe(moe, overlap=3)(x64[start:stop], token_ids=ids[start:stop])
        res["overlap"] = float((got - moe(x64, token_ids=ids)[start:stop]).abs().max())
    ep = EPMoE.from_moe(_hash_moe(torch.float64))
    mine = x64[:3]
    res["no ids"] = _error_of(lambda: ep(mine, token_ids=torch.tensor([1, 2, 3])) if rank == 0 else ep(mine))
    res["bad id"] = _error_of(lambda: ep(mine, token_ids=torch.tensor([1, V if rank == 0 else 2, 3])))
    with torch.no_grad():  # the group is still in step
        res["after errors"] = float((ep(mine, token_ids=ids[:3]) - _hash_moe(torch.float64)(mine, token_ids=ids[:3]))
                                    .abs().max())
    other = _hash_moe(torch.float64)
    if rank == 1:
        other.tid2eid[0] = (other.tid2eid[0] + 1) % 8
    res["table differs"] = _error_of(lambda: EPMoE.from_moe(other))
    torch.manual_seed(0)
    v4 = MoE(V4_TOP_K, backend="grouped_mm")
    with torch.no_grad():
        v4.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    x32 = (x64 * 3).float()  # large enough for the clamps at 1.0 to bite
    res["v4 top-k"] = _compare(rank, world_size, v4, EPMoE.from_moe(v4), x32, None, None)
    return res


def test_hash_and_v4_top_k_layers_over_two_ranks_equal_the_single_process():
    for rank, res in enumerate(run_ranks(_scenarios, 2, timeout_s=240)):
        for name in ("hash exact", "hash padded"):
            got = res[name]
            assert got["cls"] == "EPHashMoE" and got["load"] and not got["table grad"], (rank, name, got)
            shared = ["shared_w13", "shared_w2"] if name == "hash padded" else []  # fused: rows of w13 / w2
            assert got["grads"] == ["gate.weight", *shared, "w13", "w2"], got["grads"]
            errs = {k: v for k, v in got.items() if k == "out" or k == "loop" or k.startswith("grad ")}
            assert all(v < 1e-12 for v in errs.values()), (rank, name, errs)
        assert res["overlap"] < 1e-12, (rank, res["overlap"])
        v4 = res["v4 top-k"]
        assert "grad e_score_correction_bias" not in v4 and "grad gate.weight" in v4, v4
        assert all(v < 1e-5 for k, v in v4.items() if k == "out" or k.startswith("grad ")), (rank, v4)
        no_ids = "TypeError: token_ids is required"  # rank 1's own error; rank 0 is told it, naming rank 1
        assert res["no ids"].startswith(no_ids if rank == 1 else f"PeerRankError: rank 1 failed: {no_ids}"), res
        bad = "ValueError: token_ids must be in [0, hash_table_size=30)"  # rank 0's
        assert res["bad id"].startswith(bad if rank == 0 else f"PeerRankError: rank 0 failed: {bad}"), res
        assert res["after errors"] < 1e-12, res["after errors"]
        assert "replicated weights" in res["table differs"] and "tid2eid" in res["table differs"], res["table differs"]
