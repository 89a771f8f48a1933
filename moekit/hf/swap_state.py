"""A swapped block's state (``BlockSwap``) and the reads its forward makes each call: whether transformers is
recording router logits, whether a copied weight moved on. ``moekit.hf.swap`` puts them on the blocks."""

from __future__ import annotations

import dataclasses
import itertools
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from moekit.hf.blocks import block_config, block_moe
from moekit.hf.swap_free import FreedExperts, build_freed_moe
from moekit.quant.schemes import quantize, scheme_defaults, scheme_options

if TYPE_CHECKING:
    from moekit.hf.swap_offload import OffloadedExperts

_compiling = torch.compiler.is_compiling
_graph_task = torch._C._current_graph_task_id  # the backward running on this thread, -1 outside one
SWAP_ATTR = "_moekit_swap"  # on a swapped block: its BlockSwap (a plain attribute: no submodule registered)

try:  # transformers >= 5.x records router logits by hooks on the router, active while this holds a dict
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:
    try:
        from transformers.utils.generic import _active_collector as _COLLECTOR
    except ImportError:
        _COLLECTOR = None


def set_block_class(block: nn.Module, cls: type) -> None:
    """``block.__class__ = cls``; where accelerate hooked the block (``device_map`` over several devices, or
    offloaded: its forward set on the instance, calling ``_old_forward``, the class's forward bound when it hooked),
    that call is pointed at ``cls``' forward too. Session 52: the hook kept calling the block's own forward, so a swap
    (or a restore) changed nothing while ``use_moekit_blocks`` reported the block swapped."""
    block.__class__ = cls
    if "_old_forward" in block.__dict__:
        block._old_forward = types.MethodType(cls.forward, block)


@dataclass(frozen=True)
class SwapOptions:
    backend: str  # the MoE's experts backend ("auto" or a name)
    fuse_shared: bool  # the shared expert copied into routed slots (else the block's own runs)
    quant: str | None = None  # the moekit.quant scheme the MoE's routed experts are quantized with; None: float
    # the scheme's options (``MoE.quantize_(quant, **options)``) as sorted (name, value) pairs, lists as tuples, so
    # two swaps asked for the same options compare equal (a block swapped with group_size=64 is kept for 64, rebuilt
    # for 128); options left at their defaults are left out: (): the scheme's defaults
    quant_options: tuple[tuple[str, object], ...] = ()


def checked_quant_options(quant: str | None, quant_options: dict | None) -> tuple[tuple[str, object], ...]:
    """``quant_options`` as ``SwapOptions`` keeps them: sorted (name, value) pairs, lists as tuples, values left at
    the scheme's defaults left out ({"group_size": 128} is int4_w4a16's None). Each is checked by the scheme's own
    quantizer on a one-weight tensor, so a bad one fails here naming ``quant_options`` instead of leaving every
    block float with the quantizer's reason in ``report.left``."""
    if quant_options is not None and not isinstance(quant_options, dict):
        raise TypeError(f"quant_options must be a dict of the scheme's quantizer options or None, got "
                        f"{type(quant_options).__name__}")
    if not quant_options:
        return ()
    if quant is None:
        raise ValueError(f"quant_options={quant_options!r} with quant=None: they are a quantizer's options; pass "
                         "quant=<scheme> with them")
    taken = scheme_options(quant)
    unknown = sorted(set(quant_options) - set(taken))
    if unknown:
        raise ValueError(f"quant_options has {unknown}, not options of quant={quant!r}; it takes {taken or 'none'}")
    try:
        quantize(torch.zeros(1, 1, 1), quant, **quant_options)  # w [E=1, R=1, C=1]: the values' checks alone
    except (TypeError, ValueError) as err:
        raise type(err)(f"quant_options for quant={quant!r}: {err}") from err
    defaults = scheme_defaults(quant)
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in quant_options.items()}
    return tuple(sorted((k, v) for k, v in given.items() if v != defaults[k]))


@dataclass(eq=False)
class BlockSwap:
    """What a swapped block runs (``block._moekit_swap``; not a submodule: nothing registered twice)."""

    # a moekit MoE over the block's router and routed experts (the same Parameters where it can); None after a move
    # to or from the meta device until the block's next eager call builds it (``moved_moe``, ``build_moved``)
    moe: nn.Module | None
    block_cls: type  # the block's own class: its forward runs where moekit's does not (moekit.hf.swap)
    options: SwapOptions
    shared: nn.Module | None  # the block's shared expert, run as the block runs it; None: none, or fused
    shared_gate: nn.Module | None  # out += sigmoid(shared_gate(x)) * shared(x) where set (Qwen2-MoE, Qwen3-Next)
    tuple_len: int  # 0: the block returns a tensor; n: an n-tuple, given as (out, None, ...)
    sources: tuple = ()  # every block tensor, where the MoE holds copies of some (fuse_shared's slots); else ()
    versions: tuple = ()  # the sources' version counters when the copies were made
    detached: tuple = ()  # the block's Parameters, where some MoE Parameter is none of them (a copy, a view)
    # (params, name, sub, key, tensor) for each of the router's and experts' Parameters: ``params[name]`` must be the
    # MoE's (or its child ``sub``'s) Parameter ``key`` where the MoE holds it, else (key None) ``tensor``, as built
    bound: tuple = ()
    active: bool = True  # False: the block's own forward (``set_blocks_active``)
    shared_weight: float = 1.0  # the shared expert's weight in the output: 0.5 where averaged in (Cohere2-MoE)
    output_norm: nn.Module | None = None  # the block's norm of its whole output (A.X-K1), applied last; None: none
    # True: the block returns (output, router logits), each flattened to 1-D, for a caller that scatters them by token
    # type (ERNIE-4.5-VL's text and vision blocks); tuple_len is then 2
    flat_with_logits: bool = False
    # set where the block's float experts were freed (keep_float=False): the MoE's quantized weights are the experts'
    # buffers, and the block's own forward has nothing to run (moekit.hf.swap_free); None: the block keeps them
    freed: FreedExperts | None = None
    # set where accelerate offloads the block's layer (``swap_offload.OffloadedExperts``: where the quantized tensors
    # rest between calls; each call reads them and builds its MoE); None: the tensors stay on the block's device
    offload: OffloadedExperts | None = None
    # False where neither copies nor detached Parameters need a look each call: ``track`` sets it, so a compiled
    # forward reads one flag instead of the two tuples
    watch: bool = field(default=True, init=False)
    # (the router's, the experts' ``_parameters``) where the MoE holds exactly their "weight", "gate_up_proj" and
    # "down_proj" (the common layout): ``is_bound`` compares those three by names written in its code, so a compiled
    # forward guards no name (``bound``'s are data, each an equality guard); else None
    owners: tuple | None = field(default=None, init=False)
    # True: the forward is the MoE's alone (no shared expert, norm, tuple or flat logits to add): one flag, compiled
    plain: bool = field(default=False, init=False)
    # whether the block's last eager forward outside a backward ran its own forward for transformers' router recording
    # (``recording_router``): a gradient checkpoint's recomputation, inside the backward, runs the same one
    recorded: bool = field(default=False, init=False)
    # (the router's name, the router, the experts) as tracked: another module in their place since (peft's LoRA
    # wrappers: ``ParamWrapper`` for ``target_parameters``, a LoRA layer on the router) is not what the MoE reads
    modules: tuple = field(default=(), init=False)
    # the block jitters its input in training (Mixtral's and MiniMax's ``jitter_noise``, from router_jitter_noise),
    # read by ``track``: ``getattr(block, "jitter_noise", 0)`` at each call cost ~1.1 µs of the ~1.5 of the block's
    # checks where the attribute is missing (nn.Module's __getattr__ raising; rev54, timeit on the 2-core CPU host)
    jitters: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.plain = (self.shared is None and self.output_norm is None and not self.flat_with_logits
                      and self.tuple_len == 0)

    def track(self, block: nn.Module) -> None:
        """Note what the MoE's weights follow: the sources of its copies, whether gradients would miss the block's
        Parameters, the router's and experts' Parameters and modules as they are now, whether the block jitters."""
        self.jitters = bool(getattr(block, "jitter_noise", 0))
        if self.moe is None:  # the block on the meta device: its own forward runs (``is_bound``) until a move builds
            self.sources = self.versions = self.detached = self.bound = ()
            self.owners, self.watch = None, False
            return
        everything = tuple(itertools.chain(block.parameters(), block.buffers()))
        # a quantized MoE over kept float experts holds copies too (QuantizedWeight attributes, not counted by
        # ``copied_bytes``): requantized when the float ones are updated in place (``load_state_dict``, an optimizer
        # step; session 54: the quantized experts stayed those of the weights at swap time, silently)
        requantized = self.options.quant is not None and self.freed is None
        self.sources = everything if requantized or copied_bytes(self.moe, block) > 0 else ()
        self.versions = tuple(t._version for t in self.sources)
        own = {id(p) for p in block.parameters()}
        self.detached = tuple(block.parameters()) if any(id(p) not in own for p in self.moe.parameters()) else ()
        router_name = next(n for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module))
        router = getattr(block, router_name)
        self.bound = tuple((m._parameters, name, *_held_by(self.moe, t)) for owner in (router, block.experts)
                           for m in owner.modules() for name, t in m._parameters.items() if t is not None)
        experts = block.experts._parameters
        common = {"weight": (router._parameters, "gate", "weight"), "gate_up_proj": (experts, "", "w13"),
                  "down_proj": (experts, "", "w2")}
        held = len(self.bound) == 3 and {name for _, name, _, _, _ in self.bound} == set(common) and all(
            params is common[name][0] and (sub, key) == common[name][1:] for params, name, sub, key, _ in self.bound)
        self.owners = (router._parameters, experts) if held else None
        self.watch = bool(self.sources or self.detached)
        self.modules = (router_name, router, block.experts)

    def recording_router(self, block: nn.Module) -> bool:
        """Whether this call runs the block's own forward for transformers' router recording (``router_recorded``).
        A forward inside a backward is a gradient checkpoint's recomputation (non-reentrant or reentrant), which runs
        outside transformers' collector: it takes the choice its original forward made, so both save the same tensors
        (session 54: ``torch.utils.checkpoint`` raised CheckpointError, 145 tensors saved against 64, for a swapped
        Qwen3-MoE trained with ``output_router_logits=True`` and ``gradient_checkpointing_enable()``)."""
        if _compiling():
            return router_recorded(block)
        if _graph_task() != -1:  # -1 outside a backward
            return self.recorded
        self.recorded = router_recorded(block)
        return self.recorded

    def is_bound(self) -> bool:
        """Whether the router's and experts' Parameters are still those the MoE computes with (not while
        ``torch.func.functional_call`` substitutes them, nor after ``load_state_dict(assign=True)``). A Parameter the
        MoE holds is compared with the MoE's own entry, read as the MoE's forward reads it (compiled: two sources
        of one tensor, one aliasing guard; a third reference kept here would add another)."""
        moe = self.moe
        if moe is None:  # on the meta device, or compiled before an eager call built it (``moved_moe``)
            return False
        if self.owners is not None:
            router, experts = self.owners
            return (router.get("weight") is moe._modules["gate"]._parameters["weight"]
                    and experts.get("gate_up_proj") is moe._parameters["w13"]
                    and experts.get("down_proj") is moe._parameters["w2"])
        for params, name, sub, key, tensor in self.bound:
            held = tensor if key is None else (moe._modules[sub] if sub else moe)._parameters[key]
            if params.get(name) is not held:
                return False
        return True

    def build_moved(self, block: nn.Module) -> None:
        """The MoE that a move to or from the meta device left to the block's next eager call (``moved_moe``), built
        over the block's tensors as they are now (None again while they are on meta). The block's forward calls it
        first: a hash block's MoE decides whether the call's ``input_ids`` are its routing (before rev54 this sat in
        ``own_forward_needed``, after that decision: DeepSeek-V4's hash block raised "token_ids is required")."""
        self.moe = moved_moe(block, self.options, self.freed, self.wrapped(block))
        self.track(block)

    def wrapped(self, block: nn.Module) -> bool:
        """Whether the block's router or experts module is another than at the swap (peft's LoRA wrappers:
        ``ParamWrapper`` for ``target_parameters``, a LoRA layer on the router): the MoE would leave the adapter out,
        and is not built over such a block (rev54: a move of a block wrapped since the swap, ``model.to`` as
        Trainer does, raised block_config's TypeError)."""
        name, router, experts = self.modules
        return block._modules.get("experts") is not experts or block._modules.get(name) is not router

    def without_moe(self) -> BlockSwap:
        """This swap without its MoE, its tracked modules kept: what a pickle of the block carries
        (``_MoekitBlock.__reduce_ex__``), so that a copy of a block on the meta device, or wrapped since the swap,
        waits for its MoE as the block does (rev54: ``copy.deepcopy`` of such a model raised; a peft model's copy is
        what TRL's reference models are)."""
        rest = dataclasses.replace(self, moe=None)
        rest.modules = self.modules
        return rest

    def own_forward_needed(self, block: nn.Module) -> bool:
        """True where this call must run the block's own forward: its Parameters substituted (``is_bound``), a
        block in training mode whose router samples (Phi-MoE's sparsemixer: moekit routes as at inference) or whose
        input is jittered (Mixtral's and MiniMax's ``router_jitter_noise``), its router or experts module replaced
        since the swap (peft wraps them for LoRA: the MoE would leave the adapter out, silently), or autograd
        recording on a block whose gradients the MoE would not reach (``detached``: a copy or a view).
        Copies whose sources were updated in place since (an optimizer step, ``load_state_dict``) are made again
        first, in eager calls."""
        if not self.is_bound():
            return True  # substituted Parameters, or the block on the meta device
        if self.moe.config.sparsemixer_jitter_eps is not None and block.training:
            return True  # Phi-MoE's router sampling in training (the config first: compiled, no guard on training)
        if self.jitters and block.training:
            return True  # Mixtral's / MiniMax's input jitter in training (router_jitter_noise): the layer has none
        if self.wrapped(block):
            return True  # the experts or the router wrapped since the swap (peft's LoRA): the block's own forward
        if not self.watch:
            return False
        if self.detached and torch.is_grad_enabled() and any(p.requires_grad for p in self.detached):
            return True
        if self.sources and not _compiling():
            if tuple(t._version for t in self.sources) != self.versions:
                self.moe = build_moe(block, self.options, self.freed)
                self.track(block)
        return False


def router_of(block: nn.Module) -> nn.Module:
    """The block's router module (``gate`` or ``router``)."""
    return next(getattr(block, n) for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module))


def _held_by(moe: nn.Module, tensor: torch.Tensor) -> tuple[str, str | None, torch.Tensor | None]:
    """(sub, key, None) where ``tensor`` is the Parameter ``key`` of the MoE ("" for sub) or of its child ``sub``;
    else ("", None, tensor): a Parameter the MoE holds a copy or a view of, compared by itself."""
    for sub, module in itertools.chain((("", moe),), moe.named_children()):
        key = next((k for k, p in module._parameters.items() if p is tensor), None)
        if key is not None:
            return sub, key, None
    return "", None, tensor


def flat_output_and_logits(moe: nn.Module, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [M, K] -> (the MoE's output [M*K], its router logits [M*E]), as ERNIE-4.5-VL's sparse blocks return them."""
    routed = moe.route_tokens(x2d)
    return moe._experts_and_shared(x2d, routed).reshape(-1), routed.router_logits.reshape(-1)


def build_moe(block: nn.Module, options: SwapOptions, freed: FreedExperts | None = None) -> nn.Module:
    """The block's MoE: its router and routed experts (transposed ones as strided views: no copy); the shared
    expert only where fused or weighted by the router (else the block's). In eval mode: the block's own mode
    decides (``own_forward_needed``). With ``options.quant`` the routed experts are quantized from the block's
    weights (``MoE.quantize_`` with ``options.quant_options``: a quantized copy; the block keeps its float
    Parameters), or, where ``freed`` says the float experts are gone, taken from the experts' buffers as they are
    (``swap_free.build_freed_moe``)."""
    shared_expert = options.fuse_shared or router_weights_shared(block)
    if freed is not None:
        return build_freed_moe(block, options.backend, freed, shared_expert)
    moe = block_moe(block, fuse_shared=options.fuse_shared, backend=options.backend, shared_expert=shared_expert,
                    transposed="view", output_norm="caller").eval()
    return moe if options.quant is None else moe.quantize_(options.quant, **dict(options.quant_options))


def moved_moe(block: nn.Module, options: SwapOptions, freed: FreedExperts | None, defer: bool) -> nn.Module | None:
    """The block's MoE after a move or cast (``model.to``), or None (built on the block's next eager call,
    ``BlockSwap.build_moved``) where a tensor of the block is on the meta device (``model.to("meta")``: no values
    to view or quantize; the old MoE is let go with the memory it read) or ``defer`` (the MoE was None: the tensors come
    from the meta device, ``to_empty``, uninitialised until ``load_state_dict`` fills them: a quantized swap would
    quantize garbage, NaN included; or the block's router or experts wrapped since the swap, ``BlockSwap.wrapped``).
    Session 54: ``model.to("meta")`` raised ``moe_from_hf``'s meta-device error."""
    return None if defer or on_meta(block) else build_moe(block, options, freed)


def on_meta(block: nn.Module) -> bool:
    """Whether a tensor of the block is on the meta device."""
    return any(t.is_meta for t in itertools.chain(block.parameters(), block.buffers()))


def router_weights_shared(block: nn.Module) -> bool:
    """Whether the block's router weights its shared experts (Inkling): the MoE runs them (a copy), not the block."""
    return block_config(block).shared_expert_combine == "router"


def copied_bytes(moe: nn.Module, block: nn.Module) -> int:
    """Bytes of the MoE's parameters and buffers that are not the block's own storage (copies)."""
    own = {t.data_ptr() for t in itertools.chain(block.parameters(), block.buffers()) if t.numel()}
    return sum(t.numel() * t.element_size() for t in itertools.chain(moe.parameters(), moe.buffers())
               if t.numel() and t.data_ptr() not in own)


def router_recorded(block: nn.Module) -> bool:
    """Whether transformers is recording router outputs now (``output_router_logits``: hooks on the router
    module, which only the block's own forward calls). Without transformers' collector: any forward hook on
    the block's router counts."""
    if _COLLECTOR is None:
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        return bool(getattr(router, "_forward_hooks", None))
    collected = _COLLECTOR.get()
    return bool(collected) and any("router" in key for key in collected)
