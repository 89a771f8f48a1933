"""``moe_from_hf``: a ``MoE`` computing the same function as a transformers MoE block (router + experts
[+ shared expert]), for the families whose router ``MoEConfig.from_hf_config`` reads.

    block.gate / block.router ─▶ MoE.gate (+ bias, + correction bias)
    block.experts             ─▶ MoE.w13 / w2 (+ b13 / b2), the activation its ExpertsPlan recognised
    block.shared_expert(s)    ─▶ MoE.shared_w13 / shared_w2 (+ shared_gate), or S fused slots

Shapes: E experts, K hidden, N intermediate, S shared slots, SN shared width.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from moekit.activations import ActivationSpec, glu_rows, shared_glu_activation
from moekit.config import MoEConfig, hf_layer_fields
from moekit.config_hf_clamps import LayerClamps, has_layer_clamps, with_layer_clamps
from moekit.hf.variants import build_plan, clamps_before_act, identify_activation, module_limit
from moekit.layer import MoE
from moekit.layer_hash import HashMoE
from moekit.quant import install_quantized_experts_
from moekit.quant.hf import quantized_experts_weights
from moekit.routing.hash_route import check_table
from moekit.routing.shared import fused_shared

_ROUTER_NAMES = ("gate", "router")
_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
OUTPUT_NORM_NAMES = ("post_mlp_layernorm",)  # a norm the block applies to its output (A.X-K1)


@dataclass(frozen=True)
class BlockSite:
    """Where a MoE block sits in a model: ``getattr(parent, name) is block``, ``path`` its dotted name."""

    path: str
    parent: nn.Module
    name: str
    block: nn.Module


def moe_blocks(model: nn.Module) -> list[BlockSite]:
    """Every MoE block of ``model`` in module order: a module with ``.experts`` of transformers' experts
    interface (a ``down_proj``) and a ``.gate``/``.router`` module (``offload_experts``, ``use_moekit_blocks``)."""
    return [BlockSite(f"{path}.{name}" if path else name, parent, name, child)
            for path, parent in model.named_modules() for name, child in parent.named_children() if _is_block(child)]


def adapter_wrapped_blocks(model: nn.Module) -> list[BlockSite]:
    """Every MoE block of ``model`` whose experts module an adapter library wrapped: peft's ``ParamWrapper`` (LoRA
    on the experts' Parameters, ``LoraConfig(target_parameters=[...])``), whose ``get_base_layer()`` is the experts
    module. moekit's layer would read the base weights and leave the adapter out; the block's own forward applies
    it (``use_moekit_blocks`` leaves such a block, ``ADAPTER_REASON``)."""
    def wrapped(module: nn.Module) -> bool:
        experts = getattr(module, "experts", None)
        base = getattr(experts, "get_base_layer", None)
        return callable(base) and _is_block(module, base())

    return [BlockSite(f"{path}.{name}" if path else name, parent, name, child)
            for path, parent in model.named_modules() for name, child in parent.named_children() if wrapped(child)]


# why use_moekit_blocks leaves an adapter_wrapped_blocks block
ADAPTER_REASON = ("its experts are wrapped by peft (LoRA on their Parameters, LoraConfig(target_parameters=...)): "
                  "moekit's layer would leave the adapter out; the block's own forward applies it, and with "
                  "experts_implementation='moekit' its experts still run through moekit")


def _is_block(module: nn.Module, experts: nn.Module | None = None) -> bool:
    experts = getattr(module, "experts", None) if experts is None else experts
    router = next((getattr(module, n) for n in _ROUTER_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)
    # down_proj_q: a swapped block whose float experts were freed (moekit.hf.swap_free)
    held = hasattr(experts, "down_proj") or hasattr(experts, "down_proj_q")
    return isinstance(experts, nn.Module) and held and router is not None


def moe_from_hf(block: nn.Module, *, fuse_shared: bool = False, backend: str = "auto",
                shared_expert: bool = True, transposed: str = "copy", output_norm: str = "refuse") -> MoE:
    """A ``MoE`` computing the same function as ``block`` (its first output where it returns a tuple).

    With ``fuse_shared=False`` (default) the routed experts' weights and the router are *shared* with the
    block (the same ``Parameter`` objects) where the layouts agree; transposed storage (gpt-oss) is
    copied into moekit's ``[E, 2N, K]``, or with ``transposed="view"`` read in place as strided views
    (no copy; Parameters with ``requires_grad=False``: gradients would not reach the block's). The shared
    expert's weights are copied into a separate MLP, or, with ``fuse_shared=True``, into extra routed
    slots. Experts moekit cannot fuse (the plan's reason) or ungated ones are refused: the layer has no
    place for the module's own code. fp8 experts (``FineGrainedFP8Config``'s ``FP8Experts``) keep their
    quantization (``moe.quant_scheme`` "fp8_block", the block's tensors as they are; ``fuse_shared``
    must be False). The shared expert is the block's own (``shared_expert(s)``/``shared_mlp``): where a
    family keeps it on the decoder layer (Granite-MoE-Shared) the ``MoE`` has none, as the block.
    ``shared_expert=False``: the routed experts only (no shared expert, no copy of its weights;
    ``use_moekit_blocks`` runs the block's own; an averaged one's half moves into the routed weights:
    ``routed_only``). Weights the ``MoE`` shares are never allocated for it first (no init pass over a copy of
    the experts). A block that norms its output (A.X-K1's ``post_mlp_layernorm``) is refused unless
    ``output_norm="caller"``: the ``MoE`` ends at the combine and the caller applies the block's norm (as
    ``use_moekit_blocks``' swapped block does). The ``MoE`` takes the block's training mode (Phi-MoE's router
    samples in training, which it refuses) and its experts' width (ERNIE-4.5-VL's vision block). A block in
    training mode that jitters its input (Mixtral's, MiniMax's ``router_jitter_noise > 0``) gives a ``UserWarning``
    naming ``router_jitter_noise``: the ``MoE`` has no input jitter and trains without it (``use_moekit_blocks``
    runs such a block's own forward there). A block whose router reads the input ids (DeepSeek-V4's hash layers) becomes
    a ``moekit.HashMoE`` holding the router's ``tid2eid`` (checked), called ``moe(x, token_ids=input_ids)``.
    """
    moe = block_moe(block, fuse_shared=fuse_shared, backend=backend, shared_expert=shared_expert,
                    transposed=transposed, output_norm=output_norm)
    jitter = getattr(block, "jitter_noise", 0)
    if block.training and jitter:
        warnings.warn(f"moe_from_hf: {type(block).__name__} jitters its input in training (router_jitter_noise="
                      f"{jitter}); the MoE returned has no input jitter and trains without it (its function at "
                      "inference is the block's); use_moekit_blocks runs the block's own forward in training",
                      UserWarning, stacklevel=2)
    return moe


def block_moe(block: nn.Module, *, fuse_shared: bool = False, backend: str = "auto",
              shared_expert: bool = True, transposed: str = "copy", output_norm: str = "refuse") -> MoE:
    """``moe_from_hf``'s ``MoE`` (its doc says how) without its warning: ``use_moekit_blocks`` runs the block's own
    forward where it applies."""
    if transposed not in ("copy", "view"):
        raise ValueError(f"transposed must be 'copy' or 'view', got {transposed!r}")
    if output_norm not in ("refuse", "caller"):
        raise ValueError(f"output_norm must be 'refuse' or 'caller', got {output_norm!r}")
    experts = getattr(block, "experts", None)
    router = next((getattr(block, n) for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    if hasattr(experts, "down_proj_q") and not hasattr(experts, "down_proj"):
        raise TypeError(f"{type(block).__name__}'s float experts were freed by use_moekit_blocks(..., "
                        "keep_float=False): its swapped MoE holds them quantized; restore_blocks(model) first")
    if experts is None or router is None or not hasattr(experts, "down_proj"):
        raise TypeError(f"block must be a transformers MoE block with .gate or .router and .experts (the experts "
                        f"interface), got {type(block).__name__}")
    shared_mlp = block_shared_mlp(block)
    _refuse_meta(block, (router, experts, shared_mlp if shared_expert else None))
    plan = build_plan(experts)
    if not plan.fused or not plan.gated:
        why = plan.reason or "its experts are ungated (up_proj only)"
        raise ValueError(f"{type(experts).__name__} cannot become a moekit MoE layer: {why}; run the model with "
                         "set_experts_implementation('moekit') instead")
    config = _layer_config(block, router, shared_expert, output_norm).replace(activation=plan.activation,
                                                                              expert_bias=plan.has_bias)
    if shared_mlp is not None and not config.has_shared_expert:
        raise ValueError(f"{type(block).__name__} holds a shared expert its config does not describe")
    if shared_mlp is None or not shared_expert:  # Granite-MoE-Shared keeps it on the decoder layer
        config, shared_mlp = routed_only(config), None
    else:  # HY-V4, GLM-5-Next: a plain act_fn(gate) * up shared MLP beside clamped experts
        config = config.replace(shared_activation=_shared_activation(shared_mlp, plan.activation,
                                                                     experts.down_proj.device))
        if fuse_shared and not config.shared_fusable:
            raise TypeError(f"fuse_shared=True: {type(block).__name__}'s shared expert computes "
                            f"{config.shared_activation}(gate) * up and its experts {plan.activation!r}; fused slots "
                            "would run the experts' activation: use fuse_shared=False (a separate shared MLP)")
    quantized = quantized_experts_weights(experts)  # fp8 experts: kept fp8, never materialised in bf16
    dtype = experts.down_proj.dtype if quantized is None else quantized[0].dtype
    views = plan.transposed and transposed == "view" and not (fuse_shared and shared_mlp is not None)
    shares = quantized is not None or views or not (plan.transposed or (fuse_shared and shared_mlp is not None))
    layer_cls = MoE if config.hash_table_size is None else HashMoE  # HashMoE: DeepSeek-V4's hash layers
    device = experts.down_proj.device
    # its init draws (overwritten by the block's weights) from a fork of torch's generators: a seeded script's later
    # draws (a LoRA's init, dropout) stay as unswapped (session 54: peft's LoRA weights after a swap came out different)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        moe = layer_cls(config, backend=backend, fuse_shared=fuse_shared, dtype=dtype, device=device,
                        num_local_experts=0 if shares else None)  # no rows to allocate where the block's are taken
    _copy_router(moe, block, router)
    _copy_experts(moe, experts, plan.transposed and not views, shared_mlp, quantized)
    if views:  # [E, 2N, K] / [E, K, N] strided over the block's [E, K, 2N] / [E, N, K]
        moe.w13 = nn.Parameter(experts.gate_up_proj.detach().transpose(1, 2), requires_grad=False)
        moe.w2 = nn.Parameter(experts.down_proj.detach().transpose(1, 2), requires_grad=False)
    if moe.shared_gate is not None:
        moe.shared_gate.weight = block.shared_expert_gate.weight
    return moe.train(block.training)  # Phi-MoE's router samples in training, which the MoE refuses


def _refuse_meta(block: nn.Module, read_modules: tuple) -> None:
    """ValueError where a tensor the MoE would read (the block's own, or of its children in ``read_modules``) is on
    the meta device: the probes and the copies would fail deep inside on it (Tensor.item() on meta tensors)."""
    read = {n for n, m in block.named_children() if any(m is r for r in read_modules if r is not None)}
    meta = next((n for n, t in itertools.chain(block.named_parameters(), block.named_buffers())
                 if t.is_meta and ("." not in n or n.split(".")[0] in read)), None)
    if meta is not None:
        raise ValueError(f"{type(block).__name__}'s {meta} is on the meta device (device_map offloaded the block to "
                         "'cpu' or 'disk', where accelerate loads it for each forward only, or it was never filled): "
                         "moekit's layer reads a block's weights once; keep the block on a device in device_map, or "
                         "run its experts through experts_implementation='moekit', which reads them at each call")


def _layer_config(block: nn.Module, router: nn.Module, shared_expert: bool, output_norm: str) -> MoEConfig:
    """The block's config for moe_from_hf, its experts' own width (ERNIE-4.5-VL's vision block), Inkling's learned
    router scale multiplied in; a block whose output norm or router-weighted shared experts the MoE would leave out
    is refused, naming why."""
    norm = block_output_norm(block)
    if norm is not None and output_norm == "refuse":
        raise ValueError(f"{type(block).__name__} applies {type(norm).__name__} to its output, after the experts and "
                         "the shared expert: moekit's layer ends at the combine (use_moekit_blocks keeps the block's "
                         "norm; moe_from_hf(output_norm='caller') leaves it to you)")
    config = block_config(block)
    if routes_by_ids(router):  # DeepSeek-V4's hash layers: a HashMoE, the router's table copied (_copy_router)
        config = config.replace(hash_table_size=_routing_table(router).shape[0], use_correction_bias=False)
    width = getattr(block.experts, "intermediate_dim", None)  # ERNIE-4.5-VL's vision experts: their own width
    if isinstance(width, int) and width != config.moe_intermediate_size:
        config = config.replace(moe_intermediate_size=width)
    if config.shared_expert_combine == "router" and not shared_expert:
        raise ValueError(f"{type(block).__name__}'s router weights its shared experts: the MoE runs them "
                         "(shared_expert=True)")
    scale = getattr(router, "global_scale", None)  # Inkling's learned [1] scale of every router weight
    if not isinstance(scale, torch.Tensor):
        return config
    if not float(scale.detach()) > 0:
        raise ValueError(f"{type(router).__name__}.global_scale is {float(scale.detach())}: moekit's "
                         "routed_scaling_factor, which it multiplies, is > 0")
    return config.replace(routed_scaling_factor=config.routed_scaling_factor * float(scale.detach()))


def routes_by_ids(router: nn.Module) -> bool:
    """The router's forward takes the input ids (DeepSeek-V4's hash router: tid2eid[input_ids])."""
    return _takes_ids(type(router))


@functools.cache
def _takes_ids(cls: type) -> bool:
    return "input_ids" in inspect.signature(cls.forward).parameters


def block_shared_mlp(block: nn.Module) -> nn.Module | None:
    """The block's shared expert (``shared_expert(s)``/``shared_mlp``), or None: none, or one of width 0 (DeepSeek's
    families build ``n_shared_experts = 0`` as an MLP of width 0, which adds zeros; it was refused as "a shared expert
    its config does not describe")."""
    shared = next((getattr(block, n) for n in _SHARED_NAMES if getattr(block, n, None) is not None), None)
    params = list(shared.parameters()) if isinstance(shared, nn.Module) else []
    return None if params and all(p.numel() == 0 for p in params) else shared


def block_output_norm(block: nn.Module) -> nn.Module | None:
    """The norm a block applies to its output after the MoE (``OUTPUT_NORM_NAMES``), or None."""
    return next((m for m in (getattr(block, n, None) for n in OUTPUT_NORM_NAMES) if isinstance(m, nn.Module)), None)


def block_config(block: nn.Module) -> MoEConfig:
    """The ``MoEConfig`` of a block's transformers config: its experts' (the experts interface keeps it), else the
    block's or a child's (Llama-4's experts and block keep none; its shared MLP does)."""
    for module in (block.experts, block, *block.children()):
        cfg = getattr(module, "config", None)
        if hasattr(cfg, "to_dict"):
            d = hf_layer_fields(cfg.to_dict())
            if has_layer_clamps(d):  # Step-3.7, Bailing-Hybrid: this block's own clamps, as its modules hold them
                clamps = LayerClamps(module_limit(block.experts), module_limit(block_shared_mlp(block)))
                d = with_layer_clamps(d, clamps)
            return MoEConfig.from_hf_config(d)
    raise TypeError(f"{type(block).__name__} holds no transformers config (on its experts, itself or a child)")


def routed_only(config: MoEConfig) -> MoEConfig:
    """The layer of the routed experts alone, the shared expert run outside it (or none): an averaged shared
    expert's half (Cohere2-MoE) moves into the routed scaling, exactly (a power of 2); whoever runs the shared
    expert weights it ``config.shared_weight`` (``use_moekit_blocks``' swapped block)."""
    return config.replace(shared_expert_intermediate_size=0, shared_expert_gate=False, shared_expert_combine="sum",
                          shared_activation=None, routed_scaling_factor=config.routed_weight_scale)


def _copy_router(moe: MoE, block: nn.Module, router: nn.Module) -> None:
    # Hunyuan's gate holds its Linear as .wg, AFMoE's router as .gate, LongCat-Flash's as .classifier
    linear = next((m for m in (getattr(router, n, None) for n in ("wg", "gate", "classifier"))
                   if isinstance(m, nn.Linear)), router)
    moe.gate.weight = linear.weight
    if moe.gate.bias is not None:
        moe.gate.bias = linear.bias
    if moe.e_score_correction_bias is not None:
        # DeepSeek/GLM, ERNIE, MiniMax-M2, HY-V3 (the block's), AFMoE and LFM2-MoE (the block's expert_bias)
        holders = (router, getattr(router, "moe_statics", None), block)
        bias = next(getattr(h, n) for h in holders for n in ("e_score_correction_bias", "expert_bias")
                    if isinstance(getattr(h, n, None), torch.Tensor))
        moe.e_score_correction_bias = bias.detach().reshape(-1).float()
    if isinstance(moe, HashMoE):  # the router's table itself, checked (no copy: 6 MiB a layer at V4's vocab)
        moe.tid2eid = check_table(_routing_table(router), moe.config, name=f"{type(router).__name__}.tid2eid")


def _routing_table(router: nn.Module) -> torch.Tensor:
    """A router of input ids' table [V, k] of expert ids (DeepSeek-V4's ``DeepseekV4HashRouter.tid2eid``)."""
    table = getattr(router, "tid2eid", None)
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"{type(router).__name__} routes by input ids but holds no tid2eid table [vocab, k] (the one "
                         "moekit.HashMoE reads: DeepSeek-V4's hash router)")
    return table


def _copy_experts(moe: MoE, experts: nn.Module, transposed: bool, shared_mlp: nn.Module | None,
                  quantized: tuple | None) -> None:
    """Routed weights shared (or copied when transposed, or when the shared expert is fused in); fp8
    experts (``FP8Experts``) stay fp8: their tensors become the MoE's fp8_block weights as they are."""
    if quantized is not None:
        if moe.fuse_shared:
            raise ValueError("fp8 experts keep their quantization, which leaves no room for a fused shared "
                             "expert: use fuse_shared=False")
        install_quantized_experts_(moe, *quantized)
        if shared_mlp is not None:
            shared_w13, shared_w2 = _shared_weights(shared_mlp, moe.config.shared_mlp_activation)
            with torch.no_grad():
                moe.shared_w13.copy_(shared_w13)
                moe.shared_w2.copy_(shared_w2)
        return
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, 2N, K], [E, K, N]
    activation = moe.config.shared_mlp_activation  # the experts' where fused (MoE fuses only then)
    shared_w13, shared_w2 = _shared_weights(shared_mlp, activation) if shared_mlp is not None else (None, None)
    if moe.fuse_shared:
        slot_w13, slot_w2 = fused_shared(shared_w13, shared_w2, activation, moe.config.num_shared_slots)
        with torch.no_grad():
            moe.w13.copy_(torch.cat([w13, slot_w13]))
            moe.w2.copy_(torch.cat([w2, slot_w2]))
            if moe.b13 is not None:
                moe.b13[: w13.shape[0]].copy_(experts.gate_up_proj_bias)
                moe.b2[: w13.shape[0]].copy_(experts.down_proj_bias)
        return
    if transposed:
        with torch.no_grad():
            moe.w13.copy_(w13)
            moe.w2.copy_(w2)
    else:
        moe.w13, moe.w2 = experts.gate_up_proj, experts.down_proj
    if moe.b13 is not None:
        moe.b13, moe.b2 = experts.gate_up_proj_bias, experts.down_proj_bias
    if shared_w13 is not None:
        with torch.no_grad():
            moe.shared_w13.copy_(shared_w13)
            moe.shared_w2.copy_(shared_w2)


def _shared_activation(mlp: nn.Module, activation, device: torch.device) -> str | ActivationSpec | None:
    """The shared MLP's ``MoEConfig.shared_activation``: None where its ``act_fn`` is not recognised or it gates as the
    experts' ``activation`` does (GLM-5-Next's clamps at its ``swiglu_limit`` as its experts do), else what it computes
    (HY-V4's plain silu beside its experts' clamped SwiGLU; Step-3.7's and Bailing-Hybrid's ``limit``, their layer's
    own, clamping after the activation)."""
    own = identify_activation(getattr(mlp, "act_fn", None), device)
    if own is None:
        return None
    limit = getattr(mlp, "swiglu_limit", None)  # clamps gate (max) and up (both sides) before act(gate) * up
    if limit is None and module_limit(mlp) is not None:
        if not _clamped_first(mlp, own):  # Step-3.7 / Bailing-Hybrid: min(act(gate), L) * up.clamp(-L, L)
            return shared_glu_activation(activation, own, module_limit(mlp), limit_after_act=True)
        limit = module_limit(mlp)  # DeepSeek-V4's shared MLP: clamping before the activation as the experts do
    return shared_glu_activation(activation, own, None if limit is None else float(limit))


def _clamped_first(mlp: nn.Module, own: str | None) -> bool:
    """The MLP has a ``limit`` (``.limit``) it applies before its activation, as moekit's clamped SwiGLU does."""
    limit = module_limit(mlp)
    return limit is not None and own is not None and clamps_before_act(mlp, limit, own)


def _shared_weights(mlp: nn.Module, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers gated MLP -> (w13 [2SN, K], w2 [K, SN]), w13's rows in the order the layer's shared MLP reads
    with its ``activation`` (``MoEConfig.shared_mlp_activation``: gate rows then up rows, or interleaved)."""
    gate, up, down = _shared_gate_up_down(mlp)
    return glu_rows(gate, up, activation), down


def _shared_gate_up_down(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers gated MLP -> (gate [SN, K], up [SN, K], down [K, SN]); a fused ``gate_up_proj``
    (MiniMax-M3-VL: gate rows then up rows, its activation the experts'); S experts in bmm layout (Inkling)."""
    if isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear) and getattr(mlp.gate_up_proj, "bias", None) is None:
        return (*mlp.gate_up_proj.weight.detach().chunk(2), mlp.down_proj.weight.detach())
    if all(isinstance(getattr(mlp, n, None), nn.Parameter) and getattr(mlp, n).dim() == 3
           for n in ("gate_proj", "up_proj", "down_proj")):  # Inkling's S experts: [S, N, K] twice, [S, K, N]
        gate, up, down = mlp.gate_proj.detach(), mlp.up_proj.detach(), mlp.down_proj.detach()
        return gate.flatten(0, 1), up.flatten(0, 1), down.permute(1, 0, 2).flatten(1)
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise TypeError(f"the shared expert must be a gated MLP with gate_proj/up_proj/down_proj, "
                        f"got {type(mlp).__name__}")
    if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        raise TypeError(f"the shared expert {type(mlp).__name__} has biases (ERNIE's use_bias): moekit's shared MLP "
                        "has none")
    return mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
