"""``blk36_device_check``'s "before": main's swapped-block forward, ``BlockSwap`` checks (024707d's, unchanged at
7714f76) and ``FusedRouter.__call__`` (7714f76's: fgrad36's transform guard), copied statement for statement,
installed beside the shipped ones so one process interleaves the two (the same Python traced, so the same dynamo
guards as main's compiled step).

    main_forward     ``moekit.hf.swap._MoekitBlock.forward`` as main has it (every flag read each call)
    MainBlockSwap    main's ``track`` / ``is_bound`` / ``own_forward_needed`` (the (module, name, tensor) walk)
    MainFusedRouter  main's ``__call__``: compiled, the flag op (a fill) and ``torch._assert_async``

``install(model, "before" | "after")`` switches every swapped block of a ``use_moekit_blocks`` model between the
shipped swap and a before swap of its own (its own ``MoE`` over the same Parameters: nothing copied), by class and
``_moekit_swap``; dynamo keeps one compiled entry for each.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from moekit.func_ops import transforming
from moekit.hf.swap import SWAP_ATTR
from moekit.hf.swap_state import BlockSwap, build_moe, copied_bytes, flat_output_and_logits, router_recorded
from moekit.routing.fused import FusedRouter, Routing, _assert_finite, _launch_eager

BEFORE_KEY = "_blk36_before"  # on a swapped block: (its before class, its before swap)
AFTER_KEY = "_blk36_after"  # on a swapped block: (the shipped class, the shipped swap)
_ROUTERS: dict = {}  # config -> its MainFusedRouter, one for every layer as main's ``_router_of`` keeps one
_CLASSES: dict = {}  # the shipped swapped class -> its before class (main's forward)


class MainFusedRouter(FusedRouter):
    def __call__(self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None,
                 shared_gate_logits: torch.Tensor | None = None, append_shared: bool = False, out=None) -> Routing:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (logits, correction_bias, shared_gate_logits)) or transforming():
            return self._twin(logits, correction_bias, shared_gate_logits, append_shared)
        plan = self._plans[1 if append_shared else 0]
        if plan is None:
            return self._twin(logits, correction_bias, shared_gate_logits, append_shared)
        logits = self._check(logits, correction_bias)
        gate = self._check_gate(logits, shared_gate_logits) if append_shared else None
        if torch.compiler.is_compiling():
            ids, weights, ok = torch.ops.moekit.route_fused(
                logits, correction_bias, gate, *self._op_args, plan.num_slots - self.config.top_k,
                self._elements_per_program, *self._math_args)
        else:
            ids, weights, ok = _launch_eager(plan, logits, correction_bias, gate, self.assert_in_kernel, out)
        if plan.check_finite and ok is not None and logits.shape[0]:
            _assert_finite(ok, logits)
        masked = None if plan.check_finite else (~torch.isfinite(logits).any(dim=1)).sum()
        return Routing(topk_ids=ids, topk_weights=weights, masked_tokens=masked)


@dataclasses.dataclass(eq=False)
class MainBlockSwap(BlockSwap):
    def track(self, block: nn.Module) -> None:
        everything = tuple(itertools.chain(block.parameters(), block.buffers()))
        self.sources = everything if copied_bytes(self.moe, block) > 0 else ()
        self.versions = tuple(t._version for t in self.sources)
        own = {id(p) for p in block.parameters()}
        self.detached = tuple(block.parameters()) if any(id(p) not in own for p in self.moe.parameters()) else ()
        router = next(getattr(block, n) for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module))
        self.bound = tuple((m, name, t) for owner in (router, block.experts) for m in owner.modules()
                           for name, t in m._parameters.items() if t is not None)

    def is_bound(self) -> bool:
        return all(m._parameters.get(name) is t for m, name, t in self.bound)

    def own_forward_needed(self, block: nn.Module) -> bool:
        if not self.is_bound() or (block.training and self.moe.config.sparsemixer_jitter_eps is not None):
            return True
        if self.detached and torch.is_grad_enabled() and any(p.requires_grad for p in self.detached):
            return True
        if self.sources and not torch.compiler.is_compiling():
            if tuple(t._version for t in self.sources) != self.versions:
                self.moe = build_moe(block, self.options)
                self.track(block)
        return False


def main_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    swap = self.__dict__[SWAP_ATTR]
    if args or kwargs or not swap.active or router_recorded(self) or swap.own_forward_needed(self):
        return swap.block_cls.forward(self, hidden_states, *args, **kwargs)
    hidden = swap.moe.config.hidden_size
    x2d = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, hidden)
    if swap.flat_with_logits:
        return flat_output_and_logits(swap.moe, x2d)
    out = swap.moe.forward(x2d)
    out = out if x2d is hidden_states else out.view_as(hidden_states)
    if swap.shared is not None:
        shared = swap.shared(hidden_states)
        if swap.shared_gate is not None:
            shared = torch.sigmoid(swap.shared_gate(hidden_states)) * shared
        out = out + (shared if swap.shared_weight == 1.0 else swap.shared_weight * shared)
    if swap.output_norm is not None:
        out = swap.output_norm(out)
    return out if swap.tuple_len == 0 else (out,) + (None,) * (swap.tuple_len - 1)


def _before_of(block: nn.Module, swap: BlockSwap, router: str, backend: str | None):
    """(main's class for the block, a MainBlockSwap over a MoE of its own) for one shipped swap."""
    moe = build_moe(block, swap.options)
    if backend is not None:
        moe.backend = backend
    moe.router = router
    if moe._fused_router is not None:
        moe._fused_router = _ROUTERS.setdefault(moe.config, MainFusedRouter(moe.config))
    before = MainBlockSwap(moe, swap.block_cls, swap.options, swap.shared, swap.shared_gate, swap.tuple_len,
                           shared_weight=swap.shared_weight, output_norm=swap.output_norm,
                           flat_with_logits=swap.flat_with_logits)
    before.track(block)
    shipped = type(block)
    if shipped not in _CLASSES:  # one class for every block of a kind, as main's ``_swapped_class``
        _CLASSES[shipped] = type(f"{swap.block_cls.__name__}OnMain", (shipped,), {"forward": main_forward})
    return _CLASSES[shipped], before


def prepare(model: nn.Module, router: str = "auto", backend: str | None = None) -> int:
    """Give every swapped block its before (class, swap) beside the shipped one; ``router`` / ``backend`` set on
    both MoEs (the smoke forces the fused router and the triton backend under the interpreter). Returns the count."""
    count = 0
    for block in model.modules():
        swap = block.__dict__.get(SWAP_ATTR)
        if swap is None or BEFORE_KEY in block.__dict__:
            continue
        if backend is not None:
            swap.moe.backend = backend
        swap.moe.router = router
        block.__dict__[AFTER_KEY] = (type(block), swap)
        block.__dict__[BEFORE_KEY] = _before_of(block, swap, router, backend)
        count += 1
    return count


def install(model: nn.Module, which: str) -> None:
    """Every prepared block runs main's forward ("before") or the shipped one ("after")."""
    key = {"before": BEFORE_KEY, "after": AFTER_KEY}[which]
    for block in model.modules():
        if key in block.__dict__:
            cls, swap = block.__dict__[key]
            block.__class__ = cls
            block.__dict__[SWAP_ATTR] = swap
