"""Hash routing (``MoEConfig.hash_table_size``, ``moekit.routing.hash_route``, ``moekit.HashMoE``): the routing and
the whole layer against float64 per-token loops written here; the errors naming ``token_ids``, ``tid2eid`` and the
config's clashing fields; the table through ``state_dict``; ``torch.compile`` and ``torch.func.functional_call``.

Shapes: M tokens, E experts, k = top_k, V table rows, K hidden, N expert width.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit import HashMoE, MoE, MoEConfig
from moekit.routing.hash_route import hash_route

from _hash_loop import hash_layer_loop

V, E, K, N = 11, 6, 8, 4
CFG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=3, scoring="sqrtsoftplus",
                routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=2 * N)


def _table(seed: int = 0, k: int = 3) -> torch.Tensor:
    """[V, k] random experts, row 0 repeating one (a table may: the expert then runs twice)."""
    table = torch.randint(0, E, (V, k), generator=torch.Generator().manual_seed(seed))
    table[0] = 2
    return table


def _loop_route(logits, token_ids, table, cfg):
    """Per token: its table row; s = sqrt(log(1 + e^x)) of its logits (softmax / sigmoid as named); weights = s at
    the row / (their sum + 1e-20) when renormalised, times the scale."""
    ids, weights = [], []
    for row, t in zip(logits.double().tolist(), token_ids.tolist()):
        if cfg.scoring == "softmax":
            s = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        elif cfg.scoring == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            s = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        chosen = [int(e) for e in table[t]]
        total = sum(s[e] for e in chosen) + 1e-20 if cfg.renormalize else 1.0
        ids.append(chosen)
        weights.append([s[e] / total * cfg.routed_scaling_factor for e in chosen])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("changes", [{}, {"renormalize": False}, {"scoring": "sigmoid"}, {"scoring": "softmax"}])
def test_hash_route_matches_a_float64_loop(changes):
    cfg = CFG.replace(**changes)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, E, generator=g, dtype=torch.float64) * 4  # [M, E]
    token_ids = torch.randint(0, V, (9,), generator=g)
    token_ids[0] = 0  # the row repeating expert 2
    got = hash_route(logits, token_ids, _table(), cfg)
    ids, weights = _loop_route(logits, token_ids, _table(), cfg)
    assert got.topk_ids.dtype == torch.int32 and torch.equal(got.topk_ids.long(), ids)  # the table's order
    assert torch.allclose(got.topk_weights, weights, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fuse_shared", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_layer_equals_a_float64_loop(dtype, tol, fuse_shared):
    torch.manual_seed(0)
    moe = HashMoE(CFG, fuse_shared=fuse_shared, dtype=dtype).load_table_(_table())
    x = torch.randn(2, 5, K, dtype=dtype)
    token_ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    token_ids[0, 0] = 0  # the row repeating expert 2
    with torch.no_grad():
        got, want = moe(x, token_ids=token_ids), hash_layer_loop(moe, x, token_ids)
        stats = moe(x, token_ids=token_ids, return_stats=True).stats
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    want_counts = torch.bincount(_table()[token_ids.reshape(-1)].reshape(-1), minlength=E)
    assert torch.equal(stats.counts, want_counts)  # M*k assignments, expert 2 twice for token 0


def test_errors_name_the_argument():
    moe = HashMoE(CFG)
    x = torch.randn(4, K)
    with pytest.raises(TypeError, match="token_ids is required"):
        moe(x)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, hash_table_size=11\).*\[11\] at tokens \[2\]"):
        moe(x, token_ids=torch.tensor([0, 1, 11, 3]))
    with pytest.raises(ValueError, match="token_ids must have x's shape"):
        moe(x, token_ids=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="token_ids must be an integer"):
        moe(x, token_ids=torch.zeros(4))
    bad = _table()
    bad[4, 1] = E
    with pytest.raises(ValueError, match=r"tid2eid must hold experts in \[0, num_experts=6\); rows \[4\]"):
        moe.load_table_(bad)
    with pytest.raises(ValueError, match=r"tid2eid must hold experts"):
        moe.load_state_dict({**moe.state_dict(), "tid2eid": bad})
    with pytest.raises(ValueError, match=r"tid2eid must have shape \[hash_table_size=11, top_k=3\]"):
        moe.load_table_(bad[:, :2])
    with pytest.raises(TypeError, match="a layer routed by a token-id table is moekit.HashMoE"):
        MoE(CFG)
    with pytest.raises(TypeError, match="a layer routed by a token-id table is moekit.HashMoE"):
        HashMoE(CFG.replace(hash_table_size=None))
    with pytest.raises(ValueError, match=r"hash_table_size routes by a token-id table.*'use_correction_bias': True"):
        CFG.replace(use_correction_bias=True)
    with pytest.raises(ValueError, match="router must be 'auto', 'torch' or 'fused' for a HashMoE"):
        HashMoE(CFG, router="top-k")


def test_the_table_is_saved_and_loaded_and_a_fresh_one_is_valid():
    fresh = HashMoE(CFG)
    assert fresh.tid2eid.shape == (V, 3) and 0 <= int(fresh.tid2eid.min()) and int(fresh.tid2eid.max()) < E
    moe = HashMoE(CFG).load_table_(_table(3))
    fresh.load_state_dict(moe.state_dict())
    assert torch.equal(fresh.tid2eid, _table(3))


def test_compiled_and_functional_calls_equal_eager():
    torch.manual_seed(0)
    moe = HashMoE(CFG, dtype=torch.float64).load_table_(_table())
    x = torch.randn(3, 4, K, dtype=torch.float64)
    token_ids = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = moe(x, token_ids=token_ids)
        got = torch.compile(moe, fullgraph=True, backend="eager")(x, token_ids=token_ids)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
        other = torch.func.functional_call(moe, {"tid2eid": _table(7)}, (x,), {"token_ids": token_ids})
        again = HashMoE(CFG, dtype=torch.float64)
        again.load_state_dict({**moe.state_dict(), "tid2eid": _table(7)})
        assert torch.allclose(other, again(x, token_ids=token_ids), rtol=1e-12, atol=1e-14)  # routed by the new one
        assert not torch.allclose(other, want)
