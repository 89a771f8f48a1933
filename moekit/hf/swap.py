"""``use_moekit_blocks``: every MoE block of a transformers model runs moekit's whole layer (router + experts,
the layer's decode fast path) instead of transformers' router and an experts call, in place.

    model ──moe_blocks──▶ each block ──moe_from_hf(shared_expert=False)──▶ MoE over the block's own Parameters
    block.__class__ ──▶ a subclass whose forward is  MoE(x) [+ the block's shared expert (x 0.5 where averaged)]
                        [-> the block's output norm (A.X-K1)] ; state_dict unchanged

The block stays where it is with its Parameters, so ``state_dict`` keys, ``save_pretrained`` / ``from_pretrained``,
optimizers and hooks see the model as before; the ``MoE`` is an attribute, not a submodule (nothing registered
twice). It reads the block's own Parameters (gpt-oss's transposed experts as strided views: no copy); only
``fuse_shared=True`` copies (the shared expert into routed slots; copies follow the block's weights through their
version counters). The block's own forward (the same function, its own code) runs instead while transformers records
router logits (``output_router_logits``: its hooks sit on the router module), when called with arguments beyond the
hidden states, while its Parameters are substituted (``torch.func.functional_call``), while its router or experts
module is wrapped since the swap (peft's LoRA), and while autograd records on a block whose gradients the ``MoE`` would
not reach (views, copies). A move or cast of the block (``model.to``) rebuilds its ``MoE`` (one to or from the meta
device at the block's next eager call). Blocks ``moe_from_hf`` refuses stay as they are, each with its reason in the
report. With ``quant`` and ``keep_float=False`` the block's float experts are freed and its quantized ones become the
experts' buffers (``moekit.hf.swap_free``): the own forward has nothing to run, so each case above that needs it raises
``FloatExpertsFreedError``, but router-logit recording, which runs the block's router and moekit's layer. Such a
block in a layer accelerate offloads reads its quantized experts at each call (``moekit.hf.swap_offload``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from moekit._checks import check_bool, check_module
from moekit.experts import backend_names
from moekit.hf.blocks import (ADAPTER_REASON, adapter_wrapped_blocks, block_config, block_output_norm,
                              block_shared_mlp, moe_blocks)
from moekit.hf.progress import Progress, block_progress, reported
from moekit.hf.swap_free import (FreedExperts, floats_present, free_float_experts, freed_error, put_buffers,
                                 restore_float_experts, take_buffers)
from moekit.hf.swap_offload import refuse_restoring_offloaded, run_offloaded
from moekit.hf.swap_state import (SWAP_ATTR, BlockSwap, SwapOptions, build_moe, checked_quant_options, copied_bytes,
                                  flat_output_and_logits, moved_moe, on_meta, router_of, router_weights_shared,
                                  set_block_class)
from moekit.quant.base import QuantizedWeight
from moekit.quant.schemes import SCHEMES

# Blocks whose forward returns (output.flatten(), router_logits.flatten()): ERNIE-4.5-VL's text and vision blocks,
# whose modality block scatters both by token type
_FLAT_WITH_LOGITS = ("Ernie4_5_VLMoeSparseMoeBlock",)
_compiling = torch.compiler.is_compiling


@dataclass(frozen=True)
class SwappedBlock:
    path: str  # the block's dotted name in the model
    block: str  # its own class name
    copied_bytes: int  # bytes of weights the MoE holds as copies (fuse_shared's slots); 0: the block's own
    tuple_len: int  # 0: the block returns a tensor; n: an n-tuple, kept as (out, None, ...)
    quant_bytes: int = 0  # bytes of the MoE's quantized experts (packed weights, scales, zero points); 0: float
    freed_bytes: int = 0  # bytes of the block's float experts freed (keep_float=False); 0: the block keeps them


@dataclass(frozen=True)
class LeftBlock:
    path: str  # the block's dotted name in the model
    block: str  # its class name
    reason: str  # why it runs its own forward (and the experts implementation set on the model)


@dataclass(frozen=True)
class BlockSwapReport:
    swapped: tuple[SwappedBlock, ...] = ()  # in module order
    left: tuple[LeftBlock, ...] = ()  # blocks left as they were, each with its reason

    @property
    def copied_bytes(self) -> int:
        return sum(b.copied_bytes for b in self.swapped)

    @property
    def quant_bytes(self) -> int:
        return sum(b.quant_bytes for b in self.swapped)

    @property
    def freed_bytes(self) -> int:
        return sum(b.freed_bytes for b in self.swapped)


def use_moekit_blocks(model: nn.Module, *, backend: str = "auto", fuse_shared: bool = False,
                      quant: str | None = None, quant_options: dict | None = None,
                      keep_float: bool = True, progress: Progress = None) -> BlockSwapReport:
    """Give every MoE block of ``model`` moekit's layer forward over its own Parameters; returns which blocks
    were swapped and which were left (with ``moe_from_hf``'s reason: they keep their forward, so the experts
    implementation set on the model, e.g. ``set_experts_implementation("moekit")``, still serves them).

    ``backend``: the ``MoE``'s experts backend; ``fuse_shared=True`` copies a shared expert into routed
    slots (a copy: see the module doc; not HY-V4's, of its own activation) instead of running the block's. ``quant`` (a
    ``moekit.quant`` scheme: "int8_w8a16", "int4_w4a16", "mxfp4", "fp8_block") quantizes each ``MoE``'s routed
    experts from the block's weights (``MoE.quantize_``; the block keeps its float Parameters, its ``state_dict``
    unchanged, and a move rebuilds and requantizes): the swapped blocks compute with the quantized experts, which
    take no gradient (the router does). ``quant_options``: the scheme's quantizer options, as ``MoE.quantize_(quant,
    **quant_options)`` takes them (``moekit.quant.scheme_options``: int4_w4a16's ``group_size`` 32 / 64 / 128 and
    ``symmetric``, fp8_block's ``block_shape``; None: the scheme's defaults), checked before any block changes.
    ``keep_float=False`` (with ``quant``) then frees each swapped block's float experts: the quantized weights
    become the experts module's buffers in their place (``moekit.hf.swap_free``), the model shrinks, and what needs
    the float experts raises ``FloatExpertsFreedError``. Idempotent: a block already swapped with the same options
    (``quant_options`` included) is kept (``keep_float=False`` frees a kept quantized block's float experts without
    requantizing); other options rebuild its ``MoE``, which a block without float experts refuses.
    ``restore_blocks`` undoes it. A model with no MoE block warns (``UserWarning``) and is left as it is. ``progress``:
    a line a block on stderr, on a terminal only (None), always (True), never (False), or ``progress(done, total)``."""
    check_module("model", model)
    check_bool("keep_float", keep_float)
    if backend != "auto" and backend not in backend_names():  # else every block was left, in report.left only
        raise ValueError(f"backend must be one of {backend_names()} or 'auto', got {backend!r}")
    if quant is not None and quant not in SCHEMES:
        raise ValueError(f"quant must be one of {SCHEMES} or None, got {quant!r}")
    if quant is not None and fuse_shared:  # quantize_ un-fuses the copy again: the block's own shared expert runs
        raise ValueError(f"quant={quant!r} with fuse_shared=True: pass fuse_shared=False with quant (quantize_ keeps "
                         "the shared expert in the model dtype, un-fused: the block's own runs, copying it is waste)")
    if not keep_float and quant is None:
        raise ValueError("keep_float=False frees the float experts, which only quantized ones can replace: pass "
                         "quant=<scheme> with it (got quant=None)")
    options = SwapOptions(backend, bool(fuse_shared), quant, checked_quant_options(quant, quant_options))
    _refuse_rebuilding_freed(model, options, keep_float)
    sites, swapped = moe_blocks(model), []
    left = [LeftBlock(site.path, type(site.block).__name__, ADAPTER_REASON) for site in adapter_wrapped_blocks(model)]
    if not sites and not left:  # a dense model, or a block handed in instead of the model: say so, not return quietly
        warnings.warn(f"use_moekit_blocks: {type(model).__name__} has no MoE block (a module with .experts and "
                      ".gate/.router): nothing swapped", UserWarning, stacklevel=2)
    for site in reported(sites, block_progress(progress, "use_moekit_blocks")):  # checked before the first block
        block = site.block
        own = getattr(block.__dict__.get(SWAP_ATTR), "block_cls", type(block))  # its own class, swapped or not
        try:
            swap = _swap_of(block, own, options)
        except (ValueError, TypeError, NotImplementedError, AttributeError, KeyError) as err:  # a config it can't read
            left.append(LeftBlock(site.path, own.__name__, str(err).split("\n")[0]))
            continue
        if not keep_float and swap.freed is None:
            _free(block, swap)
        quant_bytes = sum(w.nbytes for w in (swap.moe.w13, swap.moe.w2) if isinstance(w, QuantizedWeight))
        swapped.append(SwappedBlock(site.path, own.__name__, copied_bytes(swap.moe, block), swap.tuple_len,
                                    quant_bytes, 0 if swap.freed is None else swap.freed.freed_bytes))
    if quant is not None and left:  # asked for quantized experts: the blocks that run without them are said aloud
        first = left[0]
        warnings.warn(f"use_moekit_blocks(quant={quant!r}): {len(left)} of {len(swapped) + len(left)} MoE blocks left "
                      f"on their own forward, their experts not quantized by moekit ({first.path}: {first.reason}"
                      f"{'; ...' if len(left) > 1 else ''}); report.left lists each", UserWarning, stacklevel=2)
    return BlockSwapReport(tuple(swapped), tuple(left))


def _refuse_rebuilding_freed(model: nn.Module, options: SwapOptions, keep_float: bool) -> None:
    """FloatExpertsFreedError, before any block changes, where a block whose float experts are gone would need them:
    other options (a rebuild from the float experts), or keep_float=True (they cannot come back)."""
    for module in model.modules():
        swap = module.__dict__.get(SWAP_ATTR)
        if swap is None or swap.freed is None:
            continue
        if swap.options != options:
            raise freed_error(swap.block_cls, f"use_moekit_blocks with other options ({options} instead of "
                                              f"{swap.options}) would rebuild its MoE from them")
        if keep_float:
            raise freed_error(swap.block_cls, "keep_float=True cannot bring them back")


def _free(block: nn.Module, swap: BlockSwap) -> None:
    """Free the block's float experts (``swap_free``): no reference stays (``track`` forgets them; a load of the
    quantized buffers with ``assign=True`` rebuilds the MoE over the new tensors)."""
    swap.freed = free_float_experts(block, swap.moe)
    swap.track(block)
    block.register_load_state_dict_post_hook(_rebuild_after_load)


def _rebuild_after_load(block: nn.Module, incompatible_keys) -> None:
    swap = block.__dict__.get(SWAP_ATTR)
    if swap is not None and swap.freed is not None:
        swap.moe = build_moe(block, swap.options, swap.freed)
        swap.track(block)


def restore_blocks(model: nn.Module) -> int:
    """Undo ``use_moekit_blocks``: every swapped block gets its own class back and drops its ``MoE``; returns
    how many were restored. A block whose float experts were freed gets them back as Parameters dequantized from
    its quantized ones (their logical dtype, the family's layout; the rounding stays, and so does the memory)."""
    check_module("model", model)
    refuse_restoring_offloaded(model)
    count = 0
    for module in model.modules():
        swap = module.__dict__.pop(SWAP_ATTR, None)
        if swap is not None:
            if swap.freed is not None:
                restore_float_experts(module, swap.moe, swap.freed)
                hooks = module._load_state_dict_post_hooks
                for key in [k for k, hook in hooks.items() if hook is _rebuild_after_load]:
                    del hooks[key]
            set_block_class(module, swap.block_cls)
            count += 1
    return count


def set_blocks_active(model: nn.Module, active: bool) -> int:
    """Switch swapped blocks between moekit's forward (True) and their own (False) without rebuilding
    anything (``moekit bench --hf`` interleaves the two); returns how many blocks were switched."""
    swaps = [m.__dict__[SWAP_ATTR] for m in model.modules() if SWAP_ATTR in m.__dict__]
    freed = next((swap for swap in swaps if swap.freed is not None), None)
    if not active and freed is not None:
        raise freed_error(freed.block_cls, "set_blocks_active(model, False) would run the block's own forward on them")
    for swap in swaps:
        swap.active = bool(active)
    return len(swaps)


def _swap_of(block: nn.Module, own: type, options: SwapOptions, tuple_len: int | None = None,
             freed: FreedExperts | None = None) -> BlockSwap:
    """The block's BlockSwap: kept where its options match, else built (and the block's class swapped);
    ``tuple_len`` where it is known (an unpickled block), else the block's earlier swap's, else probed; ``freed``
    (an unpickled block's, else the earlier swap's): its float experts are gone, the MoE reads their buffers."""
    swap = block.__dict__.get(SWAP_ATTR)
    if swap is not None and swap.options == options and swap.is_bound():
        return swap
    freed = freed if swap is None else swap.freed
    moe = build_moe(block, options, freed)
    if tuple_len is None:
        tuple_len = swap.tuple_len if swap is not None else _probe_tuple_len(block, moe)
    shared, shared_gate = _shared_parts(block, options)
    weight = 1.0 if shared is None else block_config(block).shared_weight
    swap = BlockSwap(moe, own, options, shared, shared_gate, tuple_len, shared_weight=weight,
                     output_norm=block_output_norm(block), flat_with_logits=own.__name__ in _FLAT_WITH_LOGITS,
                     freed=freed)
    swap.track(block)
    block.__dict__[SWAP_ATTR] = swap
    set_block_class(block, _swapped_class(own))
    return swap


def _shared_parts(block: nn.Module, options: SwapOptions) -> tuple[nn.Module | None, nn.Module | None]:
    """(the block's shared expert, its sigmoid gate: Qwen2-MoE, Qwen3-Next) where the MoE leaves them to the
    block (fuse_shared off, not weighted by the router), else (None, None)."""
    shared = block_shared_mlp(block)
    if shared is None or options.fuse_shared or router_weights_shared(block):
        return None, None
    return shared, getattr(block, "shared_expert_gate", None)


def _probe_tuple_len(block: nn.Module, moe) -> int:
    """0 where the block's own forward returns a tensor, n for an n-tuple: read from its source's return
    statements, else one token through it (no grad)."""
    read = _returned_tuple_len(type(block).forward)
    if read is not None:
        return read
    weight = moe.gate.weight  # [E, K] in the model's dtype, on its device
    x = torch.zeros(1, 1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        try:
            out = block(x)
        except Exception as err:  # noqa: BLE001  (the block is left, with this reason)
            raise ValueError(f"its own forward failed on a one-token probe: {type(err).__name__}: {err}") from err
    return len(out) if isinstance(out, tuple) else 0


def _returned_tuple_len(forward) -> int | None:
    """The length of the tuple every return statement of ``forward`` builds (0: none builds one), or None
    where the source is not there or its returns disagree."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    lens = {len(node.value.elts) if isinstance(node.value, ast.Tuple) else 0
            for node in ast.walk(tree) if isinstance(node, ast.Return) and node.value is not None}
    return lens.pop() if len(lens) == 1 else None


class _MoekitBlock(nn.Module):
    """The behaviour a swapped block's class gets ahead of its own (``_swapped_class``)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """hidden_states [B, S, K] (or [M, K], or flat: ERNIE-4.5-VL's) -> the block's output: MoE(x) [+ its shared
        expert] [-> its output norm], or (output, router logits) flattened; its own forward where the module doc
        says."""
        swap = self.__dict__[SWAP_ATTR]
        if swap.moe is None and not _compiling():  # back from the meta device (``moved_moe``): built at this call
            swap.build_moved(self)
        if swap.offload is not None and not swap.is_bound():  # accelerate read this call's weights (swap_offload)
            return run_offloaded(self, swap, _MoekitBlock.forward, hidden_states, *args, **kwargs)
        ids = None  # [B, S] a hash block's input ids: its HashMoE routes by them
        if kwargs and kwargs.keys() == {"input_ids"}:  # DeepSeek-V4's decoder layer passes them to every block
            ids = kwargs["input_ids"] if getattr(swap.moe, "takes_token_ids", False) else None
            kwargs = kwargs if ids is not None or swap.moe is None else {}  # a top-k block reads them not
        if args or (kwargs and ids is None) or not swap.active or swap.recording_router(self) or \
                swap.own_forward_needed(self):
            if swap.freed is None or floats_present(self):
                return swap.block_cls.forward(self, hidden_states, *args, **kwargs)
            _record_router_or_refuse(self, swap, hidden_states, args, kwargs)
        if swap.plain:  # the MoE's output alone; compiled, the flags below are not read (fewer guards)
            x2d = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, hidden_states.shape[-1])
            out = _moe_out(swap.moe, x2d, ids)  # [M, K]
            return out if x2d is hidden_states else out.view_as(hidden_states)
        hidden = swap.moe.config.hidden_size  # K: a flat x (ERNIE-4.5-VL's modality scatter) is [M*K]
        x2d = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, hidden)
        if swap.flat_with_logits:  # ERNIE-4.5-VL's blocks (no shared expert, no norm of their own)
            return flat_output_and_logits(swap.moe, x2d)
        out = _moe_out(swap.moe, x2d, ids)  # [M, K]; a 2-D x meets the layer's decode fast path first (no hooks on it)
        out = out if x2d is hidden_states else out.view_as(hidden_states)  # view_as: 0.7 µs, view(shape) 2.2
        if swap.shared is not None:
            shared = swap.shared(hidden_states)
            if swap.shared_gate is not None:
                shared = torch.sigmoid(swap.shared_gate(hidden_states)) * shared
            out = out + (shared if swap.shared_weight == 1.0 else swap.shared_weight * shared)  # the MoE halved its own
        if swap.output_norm is not None:  # A.X-K1: the block's norm of routed + shared
            out = swap.output_norm(out)
        return out if swap.tuple_len == 0 else (out,) + (None,) * (swap.tuple_len - 1)

    def _apply(self, fn, recurse=True):
        swap = self.__dict__.get(SWAP_ATTR)
        if swap is None or swap.freed is None:
            module = super()._apply(fn, recurse)
        else:  # the quantized buffers move with the block, never cast: out of its way while fn runs
            held = take_buffers(self.experts, swap.freed)
            try:
                module = super()._apply(fn, recurse)
            finally:
                swap.freed = put_buffers(self.experts, swap.freed, held, fn)
        if swap is not None:  # the MoE read the old tensors (and resolved its backend for their device)
            swap.moe = moved_moe(self, swap.options, swap.freed, swap.moe is None or swap.wrapped(self))
            swap.track(self)
        return module

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, ``copy.deepcopy``) as the block of its own class, swapped again on load."""
        swap = self.__dict__[SWAP_ATTR]
        state = {k: v for k, v in self.__dict__.items() if k != SWAP_ATTR}
        return _unpickle_swapped, (swap.block_cls, state, swap.options, swap.tuple_len, swap.freed, swap.without_moe())


def _unpickle_swapped(block_cls: type, state: dict, options: SwapOptions, tuple_len: int,
                      freed: FreedExperts | None = None, resting: BlockSwap | None = None) -> nn.Module:
    """The block swapped again; ``resting`` (``BlockSwap.without_moe``; None in a pickle made before rev54) is its
    swap as it was, kept without an MoE where the block is on the meta device or wrapped since the swap."""
    block = block_cls.__new__(block_cls)
    block.__dict__.update(state)
    if resting is not None and (resting.wrapped(block) or on_meta(block)):  # built at its next eager call
        block.__dict__[SWAP_ATTR] = resting
        resting.track(block)
        set_block_class(block, _swapped_class(block_cls))
    else:
        _swap_of(block, block_cls, options, tuple_len, freed)
    return block


def _record_router_or_refuse(block: nn.Module, swap: BlockSwap, hidden_states: torch.Tensor, args, kwargs) -> None:
    """A block without float experts where its own forward would run: transformers recording router logits is
    served (the block's router runs on the tokens, its hooks record what the own forward's call would; moekit's
    layer computes the output); everything else raises ``FloatExpertsFreedError`` naming it."""
    if args or kwargs:
        raise freed_error(swap.block_cls, "a call with arguments beyond the hidden states runs the block's own "
                                          "forward on them")
    if not swap.active:
        raise freed_error(swap.block_cls, "an inactive swap (set_blocks_active) runs the block's own forward on them")
    if swap.own_forward_needed(block):
        raise freed_error(swap.block_cls, "substituted Parameters (torch.func.functional_call without the experts' "
                                          "gate_up_proj / down_proj), router sampling in training, a router or "
                                          "experts module wrapped since the swap (peft), gradients the MoE does "
                                          "not reach or the block on the meta device run its own forward on them")
    router_of(block)(hidden_states.reshape(-1, swap.moe.config.hidden_size))  # [M, K], as the own forward passes it


def _moe_out(moe: nn.Module, x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """x2d [M, K] through the block's MoE -> [M, K] (a hash block's ``HashMoE`` routed by the input ids [B, S],
    M = B*S); compiled, ``traced_forward``: the layer without its eager caches (the decode fast path, the route
    workspace), whose guards would hold what the eager prefill left (the shared-expert blocks' path called
    ``forward`` until session 52)."""
    if ids is None:
        return moe.traced_forward(x2d) if _compiling() else moe.forward(x2d)
    ids = ids.reshape(-1)  # [M]
    return moe.traced_forward(x2d, ids) if _compiling() else moe.forward(x2d, ids)


_CLASSES: dict[type, type] = {}  # a block class -> its swapped subclass, made once


def _swapped_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"{cls.__name__}OnMoekit", (_MoekitBlock, cls), {"__module__": __name__})
    return _CLASSES[cls]
