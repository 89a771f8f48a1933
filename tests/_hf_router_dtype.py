"""Each swapped family's MoE block in bfloat16 as ``from_pretrained`` loads it, its router's logits, and (run as a
script) how often moekit's choice of experts differs from transformers' eager bf16 one and from the float64 block's.

``PYTHONPATH=.:tests python3 tests/_hf_router_dtype.py [TOKENS]`` prints, per family: the dtype of transformers'
logits and routing weights, the tokens (of TOKENS, default 4096) whose chosen set differs between transformers' bf16
router and moekit's, between each and the float64 block's, the rows of those whose k-th and (k+1)-th logits tie in
bf16, and the output's rel. L2 error against the float64 block (transformers, moekit).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from dataclasses import dataclass

import torch

# Families whose router casts the hidden states and the gate weight to float32 for its GEMM while the model keeps
# that weight in its own dtype (no ``_keep_in_fp32_modules_strict`` entry): from_hf_config reads router_dtype float32
FP32_GEMM = ("kolibri1", "kolibri1_1", "lara_mini", "longcat_flash", "openai_privacy_filter")


def _kept_fp32(fam) -> set[str]:
    """The names the family's model classes keep in float32 under bf16 (``_keep_in_fp32_modules_strict``)."""
    module = importlib.import_module(fam.cls.__module__)
    return {name for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__
            for name in (getattr(c, "_keep_in_fp32_modules_strict", None) or ())}


def bf16_block(fam, tokens: int = 64, seed: int = 3, block=None):
    """(block in bf16 with its kept weights float32, x [tokens, K] bf16); ``block``: a float one of ``fam`` to cast."""
    from test_hf_swap_walk import _family_block

    block = _family_block(fam)[0] if block is None else block
    block = block.eval().to(torch.bfloat16)
    keep = _kept_fp32(fam)
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if any(k in "mlp." + name for k in keep):  # the block sits at model.layers.i.mlp
            t.data = t.data.float()
    g = torch.Generator().manual_seed(seed)
    hidden = block.experts.config.hidden_size
    return block, torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)


def _router(block) -> torch.nn.Module:
    return next(getattr(block, n) for n in ("gate", "router") if isinstance(getattr(block, n, None), torch.nn.Module))


def router_logits(block, x: torch.Tensor) -> torch.Tensor:
    """The logits [M, E] the block's own router computes for x [M, K] in the block's forward, as float32."""
    seen = {}

    def keep(module, args, out):
        seen["logits"] = out[0] if isinstance(out, tuple) else out

    handle = _router(block).register_forward_hook(keep)
    try:
        with torch.no_grad():
            block(x[None])
    finally:
        handle.remove()
    return seen["logits"].float()


@dataclass
class Choice:
    """One block's routing at one precision: the experts its experts call got, and its output."""

    ids: torch.Tensor  # [M, k] int64, sorted per row
    weights_dtype: torch.dtype
    logits_dtype: torch.dtype
    out: torch.Tensor  # [M, K]


def eager_choice(block, x: torch.Tensor) -> Choice:
    seen = {}

    def ids(module, args, kwargs):
        values = list(args) + [kwargs[n] for n in ("top_k_index", "top_k_weights") if n in kwargs]
        seen["ids"], seen["weights"] = values[1], values[2]

    def logits(module, args, out):  # the router's own ids where it returns them (LongCat remaps its identity slots)
        seen["logits"] = out[0] if isinstance(out, tuple) else out
        outs = out if isinstance(out, tuple) else ()
        seen["router_ids"] = next((t for t in outs if not t.is_floating_point()), None)

    handles = [block.experts.register_forward_pre_hook(ids, with_kwargs=True),
               _router(block).register_forward_hook(logits)]
    try:
        with torch.no_grad():
            out = block(x[None])
    finally:
        for h in handles:
            h.remove()
    out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    ids = seen["ids"] if seen["router_ids"] is None else seen["router_ids"]
    return Choice(ids.sort(1).values, seen["weights"].dtype, seen["logits"].dtype, out)


def moekit_choice(block, x: torch.Tensor, k: int) -> Choice:
    import moekit.hf as moekit_hf

    moe = moekit_hf.moe_from_hf(block)
    with torch.no_grad():
        routed = moe.route_tokens(x)
        out = moe(x[None]).reshape(x.shape)
    ids = routed.router_ids[:, :k].long().sort(1).values
    return Choice(ids, routed.routing.topk_weights.dtype, routed.router_logits.dtype, out)


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a != b).any(1)


def measure(fam, tokens: int) -> str:
    from test_hf_swap_walk import _family_block

    block = _family_block(fam)[0]
    exact_block = block.double().eval()
    bf_block, x = bf16_block(fam, tokens, block=_family_block(fam)[0])
    exact = eager_choice(exact_block, x.double())
    eager = eager_choice(bf_block, x)
    ours = moekit_choice(bf_block, x, eager.ids.shape[1])
    k = eager.ids.shape[1]
    top = router_logits(bf_block, x).sort(1, descending=True).values
    tied = top[:, k - 1] == top[:, k]  # [M] the k-th and (k+1)-th logits equal
    flips = _differ(eager.ids, ours.ids)

    def err(out):
        return float((out.double() - exact.out).norm() / exact.out.norm())

    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return (f"| {fam.family} | {name(eager.logits_dtype)} | {name(eager.weights_dtype)} | {int(flips.sum())} "
            f"({int((flips & tied).sum())} tied) | {int(_differ(eager.ids, exact.ids).sum())} | "
            f"{int(_differ(ours.ids, exact.ids).sum())} | {err(eager.out):.1e} | {err(ours.out):.1e} |")


if __name__ == "__main__":
    from test_hf_swap_walk import _BUILT, _FAMILIES, _SWAPPED

    warnings.simplefilter("ignore")
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    print(f"| family | tf logits | tf weights | choice differs, tf vs moekit (bf16 ties) | tf vs fp64 | moekit vs fp64 "
          f"| tf err | moekit err |  ({tokens} tokens)\n|---|---|---|---|---|---|---|---|")
    for key in _BUILT:
        if _FAMILIES[key].family in _SWAPPED and _FAMILIES[key].family != "axk1":
            print(measure(_FAMILIES[key], tokens), flush=True)
