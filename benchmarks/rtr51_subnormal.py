"""rtr51's subnormal-score checks (``rtr51_device_check.py`` runs them after the float32 router's): DeepSeek-V4's
routers at logits whose sqrt(softplus) scores are subnormal in float32 (-80 .. -110) and at ordinary ones, on the
device's kernels. PASS / FAIL lines:
  hash-renorm    the fused hash router (V4's hash layer: E 256, top-6, / (sum + 1e-20)): ids equal to ``hash_route``'s,
                 weights within 2e-6 of its (bits equal reported) and within 1e-5 of the float64 formula at every row
  hash-plain     unrenormalised: each weight within 2e-6 of ``hash_route``'s or 1e-19 (transformers' rounding, both)
  topk-renorm    the fused top-k router (V4's top-k layer, no bias): ids equal to ``route``'s on the ordinary rows,
                 weights within 1e-5 of the float64 formula on its own ids at every row; the subnormal rows whose ids
                 differ from ``route``'s are counted, not failed (both choose by the float32 scores, transformers'
                 rounding: near-ties of subnormals, ties of zeros below -103.9; the interpreter's numpy exp differs)
"""

from __future__ import annotations

import math

import torch

from moekit import MoEConfig, route
from moekit.routing.fused import FusedRouter
from moekit.routing.hash_fused import FusedHashRouter
from moekit.routing.hash_route import hash_route

E, K, V = 256, 6, 1024
LEVELS = (-80.0, -87.0, -88.0, -90.0, -95.0, -100.0, -103.0, -104.0, -105.0, -107.0, -110.0)


def _sqrt_softplus64(v: float) -> float:
    return math.sqrt(v + math.log1p(math.exp(-v)) if v > 0 else math.log1p(math.exp(v)))


def _formula(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """[M, k] float64: sqrt(softplus) of the logits at ids, / (their sum + 1e-20) when renormalised."""
    rows = [[_sqrt_softplus64(row[e]) for e in chosen] for row, chosen in zip(logits.double().tolist(), ids.tolist())]
    s = torch.tensor(rows, dtype=torch.float64)
    return s / (s.sum(-1, keepdim=True) + 1e-20) if renormalize else s


def problem(device, smoke: bool):
    """(logits [M, E] float32, token ids [M], table [V, k]): a row a level (experts within 0.5 of it), then ordinary
    rows (N(0, 16))."""
    g = torch.Generator().manual_seed(51)
    e = 16 if smoke else E
    low = torch.tensor(LEVELS)[:, None] + torch.rand(len(LEVELS), e, generator=g) * 0.5
    logits = torch.cat([low, torch.randn(8, e, generator=g) * 4])
    tokens = torch.randint(0, V, (logits.shape[0],), generator=g)
    table = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(V)])
    return logits.to(device), tokens.to(device), table.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-300)).max())


def checks(device, smoke: bool = False) -> list[dict]:
    logits, tokens, table = problem(device, smoke)
    e = logits.shape[1]
    hashed = MoEConfig(hidden_size=64, moe_intermediate_size=64, num_experts=e, top_k=K, scoring="sqrtsoftplus",
                       hash_table_size=V, renorm_eps=1e-20)
    rows = []
    for renorm in (True, False):
        cfg = hashed.replace(renormalize=renorm)
        got = FusedHashRouter(cfg)(logits, tokens, table)
        twin = hash_route(logits, tokens, table, cfg)
        want = _formula(logits.cpu(), twin.topk_ids.cpu().long(), renorm)
        ok_ids = torch.equal(got.topk_ids, twin.topk_ids)
        if renorm:
            rel_twin, rel64 = _rel(got.topk_weights, twin.topk_weights), _rel(got.topk_weights.cpu(), want)
            ok = ok_ids and rel_twin <= 2e-6 and rel64 <= 1e-5
            note = f"rel to hash_route {rel_twin:.1e}, to float64 {rel64:.1e}"
        else:
            diff = (got.topk_weights - twin.topk_weights).abs()
            ok = ok_ids and bool((diff <= torch.clamp(twin.topk_weights.abs() * 2e-6, min=1e-19)).all())
            note = f"abs to hash_route {float(diff.max()):.1e}"
        bits = torch.equal(got.topk_weights, twin.topk_weights)
        rows.append({"check": "hash-renorm" if renorm else "hash-plain", "ok": ok, "bits_equal": bits, "note": note})
    topk = hashed.replace(hash_table_size=None)
    got = FusedRouter(topk)(logits)
    ref = route(logits, topk)
    want = _formula(logits.cpu(), got.topk_ids.cpu().long(), True)
    rel64 = _rel(got.topk_weights.cpu(), want)
    ordinary = len(LEVELS)  # rows from here on: N(0, 16)
    ids_ok = torch.equal(got.topk_ids[ordinary:], ref.topk_ids[ordinary:])
    moved = int((got.topk_ids[:ordinary] != ref.topk_ids[:ordinary]).any(dim=1).sum())
    rows.append({"check": "topk-renorm", "ok": ids_ok and rel64 <= 1e-5,
                 "bits_equal": torch.equal(got.topk_weights, ref.topk_weights),
                 "note": f"to float64 {rel64:.1e}, subnormal rows choosing otherwise than route: {moved}"})
    return rows
