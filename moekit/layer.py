"""``MoE``: the whole layer as an ``nn.Module``.

  [Gate] -> [Route] -> [Capacity, opt-in] -> [Group] -> [Experts: w13, act-and-mul, w2, weight] -> [Combine] (+ shared)

Where each stage lives (``MoE.forward`` reads top to bottom in this order):

| stage    | where                                                            | in -> out                             |
| -------- | ---------------------------------------------------------------- | ------------------------------------- |
| Gate     | ``MoE.gate``'s weights; at <= 256 tokens with the fused router   | x2d [M, K] -> logits [M, E]           |
|          |   one Triton launch with Route (``moekit.routing.gate_route``)   |                                       |
| Route    | ``moekit.routing.route``, or ``FusedRouter`` (CUDA, ``router=``) | logits -> ids [M, k] int32, weights   |
| Capacity | ``moekit.routing.apply_capacity`` (opt-in)                       | drops over capacity as id -1, counted |
| Group    | the backend's layout, from ``moekit.layouts`` (below)            | x2d, ids -> rows grouped by expert    |
| Experts  | the ``moekit.experts`` backend, called by ``run_routed``         | rows -> w2 @ act_and_mul(w13 @ row)   |
| Combine  | the layout's weighted inverse, in the same backend               | rows, weights -> out [M, K]           |
| Shared   | S extra routed slots (fused), or ``routing.shared.shared_mlp``   | x2d -> [M, K], added                  |
| Identity | Z > 0 (LongCat-Flash): ``moekit.routing.weighting`` after Route  | weight x token [M, K], added          |

Group and Combine per backend: ``grouped_mm`` (the CPU default) groups with ``permute_contiguous``
(align 1) or ``masked_layout_measured_cap_syncs``, picked per call by ``choose_layout`` under a memory
budget, and combines with ``combine_contiguous`` / ``combine_masked``; ``triton`` (the CUDA default)
groups with ``align_block`` and combines in the down GEMM's epilogue and its k-sum kernel.
``MoEStats.layout`` says which layout a forward used. With ``eager_graph_rows`` set, small eager CUDA
calls without autograd replay the whole pipeline from a CUDA graph per kind of call (``moekit.eager_graphs``);
without, a repeated one of up to 256 tokens goes straight to its launches (``moekit.layer_fast``).

Shapes: M tokens (leading dims flattened), K hidden, N expert intermediate, E routed experts,
k = top_k, S shared slots (the shared MLP split into routed-width experts), SN = shared width, Z identity experts.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit._checks import input_error
from moekit.balance import correction_bias_kept
from moekit.config import MoEConfig, check_layer_args
from moekit.eager_graphs import EagerGraphs
from moekit.experts import ExpertsCallCache, ExpertsFn, backend_fn, bind_options, call_backend, resolve_backend
from moekit.experts.auto_train import running_backend
from moekit.experts.grouped_mm import plan_grouped_mm
from moekit.func_ops import transforming
from moekit.layer_fast import DecodeFast
from moekit.layer_repr import layer_line
from moekit.losses import configured_aux_loss
from moekit.routing import DropPolicy, Routing, append_shared_slots, apply_capacity, gate_route as one_launch, route
from moekit.routing.fused import FusedRouter, RouterChoice, fused_router
from moekit.routing.gate import (MAX_TOKENS as GATE_ROWS, gate_inputs, gate_logits, linear_into, router_dtype_of,
                                 torch_gate)
from moekit.routing.gate_route import gate_route, wants_fresh
from moekit.routing.weighting import identity_weights, input_weighted, without_identity
from moekit.routing.routed import MoEOutput, MoEStats, RoutedTokens, stats_of, stats_on_host
from moekit.routing.shared import shared_mlp, shared_rows_detached
from moekit.routing.workspace import RouteWorkspace, fresh_buffers
from moekit.quant import move_quantized_, quant_scheme_of, quantize_experts_, refuse_quantized_into_float
from moekit.triton_bind import triton_runs_on


class MoE(nn.Module):
    """A Mixture-of-Experts layer built from a ``MoEConfig``.

    Weights follow transformers v5 and vLLM: ``w13 [E(+S), 2N, K]`` (gate rows, then up rows) and ``w2 [E(+S), K, N]``.
    With ``fuse_shared=True`` (default, when the shared width is a multiple of N and ``config.shared_fusable``) the
    shared MLP lives in the last S rows of ``w13``/``w2`` and runs as extra routed slots in the same grouped GEMM;
    else a separate MLP (``shared_w13 [2SN, K]``, ``shared_w2 [K, SN]``). Both compute the same function.

    ``capacity_factor=None`` is dropless (default). A number enables training-style dropping with
    ``drop_policy`` ("position" or "weight"); the dropped count is in the stats.

    ``backend_options``: keyword arguments the chosen backend takes beyond the experts contract, bound
    once (e.g. ``{"memory_budget_bytes": 2**28}`` for ``grouped_mm``'s layout choice and chunking);
    a name the backend does not take is refused here.

    ``router``: ``"auto"`` routes with the fused Triton kernel on CUDA where it applies (``moekit.routing.fused``) and
    with ``route`` elsewhere; ``"torch"`` always ``route``; ``"fused"`` always the kernel (on the CPU only under
    ``TRITON_INTERPRET=1``). Both compute the same routing. With the fused router a gate GEMM of up to 256 tokens runs
    in the router's launch (``moekit.routing.gate_route`` on every path that can: row-loop gate to 8 tokens, tensor
    cores above; else the gate kernel); above, ``torch.mm`` into a kept buffer, else ``F.linear`` (autograd,
    ``torch.compile``). It reads ``MoE.gate``'s weights: its hooks never run.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        backend: str = "auto",
        backend_options: dict | None = None,
        fuse_shared: bool = True,
        capacity_factor: float | None = None,
        drop_policy: DropPolicy = "position",
        router: RouterChoice = "auto",
        stats_block_size: int = 64,
        num_local_experts: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        eager_graph_rows: int | None = None,
    ) -> None:
        """``num_local_experts``: routed expert rows held, all E by default (EP: a rank's own). ``eager_graph_rows``:
        eager CUDA calls without autograd of at most this many tokens replay a CUDA graph captured per kind of call
        (``moekit.eager_graphs``; off by default: each token count seen costs a capture and its memory)."""
        super().__init__()
        check_layer_args(config, fuse_shared, capacity_factor, drop_policy, stats_block_size, num_local_experts, dtype,
                         eager_graph_rows, type(self))
        self.eager_graphs = None if eager_graph_rows is None else EagerGraphs(eager_graph_rows)
        self._experts_call = ExpertsCallCache()  # forward's experts call: check_experts_args once per weight set
        self._route_ws = RouteWorkspace()  # forward's routing buffers; not with a subclass's route_tokens/run_routed
        self._decode = DecodeFast()  # forward's repeated decode calls, straight to their launches
        self._plain_run = type(self).run_routed is MoE.run_routed  # no subclass places the experts: decided once
        self._plain_routing = type(self).route_tokens is MoE.route_tokens and self._plain_run
        self.config = config
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.stats_block_size = stats_block_size
        fusable = config.num_shared_slots and config.expert_weight_on == "output" and config.shared_fusable
        self.fuse_shared = bool(fuse_shared and fusable)  # not Llama-4's (slots run on w x), HY-V4's (own activation)
        k_dim, n_dim, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        factory = {"dtype": dtype, "device": device}
        slots = config.num_shared_slots if self.fuse_shared else 0
        rows = (e if num_local_experts is None else num_local_experts) + slots
        width = config.router_width  # E, + Z identity experts (LongCat-Flash) or S shared slots (Inkling), rows last
        self.gate = nn.Linear(k_dim, width, bias=config.router_bias, **factory)  # weight [E(+Z|S), K] (+ bias)
        self.w13 = nn.Parameter(torch.empty(rows, 2 * n_dim, k_dim, **factory))  # [E(+S), 2N, K]; L(+S) on an EP rank
        self.w2 = nn.Parameter(torch.empty(rows, k_dim, n_dim, **factory))  # [E(+S), K, N]; L(+S) on an EP rank
        # config.expert_bias (gpt-oss): b13 [E(+S), 2N] in w13's row order, b2 [E(+S), K]; zero on shared slots
        self.b13 = nn.Parameter(torch.zeros(rows, 2 * n_dim, **factory)) if config.expert_bias else None
        self.b2 = nn.Parameter(torch.zeros(rows, k_dim, **factory)) if config.expert_bias else None
        fp32 = {"dtype": torch.float32, "device": device}  # the correction bias [E(+Z)], in float32 whatever dtype
        bias = torch.zeros(config.choice_width, **fp32) if config.use_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        shared = config.shared_expert_intermediate_size if config.has_shared_expert and not self.fuse_shared else 0
        self.shared_w13 = nn.Parameter(torch.empty(2 * shared, k_dim, **factory)) if shared else None
        self.shared_w2 = nn.Parameter(torch.empty(k_dim, shared, **factory)) if shared else None
        self.shared_gate = nn.Linear(k_dim, 1, bias=False, **factory) if config.shared_expert_gate else None
        self.router = router  # resolves the router for the weights' device, like the backend
        if backend_options is not None and not isinstance(backend_options, dict):
            raise TypeError(f"backend_options must be a dict of keyword arguments, got "
                            f"{type(backend_options).__name__}")
        self.backend_options = dict(backend_options or {})
        self.backend = backend  # resolves the backend function for the weights' device
        self.reset_parameters()

    @property
    def backend(self) -> str:
        """The experts backend asked for ("auto" or a name); ``resolved_backend()`` says which one runs."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        # Resolved here and on every move (``_apply``), never in forward (fullgraph=True cannot trace its imports).
        self._backend = name
        self._experts_fn: ExpertsFn = bind_options(backend_fn(name, self.w13.device), self.backend_options)

    @property
    def router(self) -> str:
        """The router asked for ("auto", "torch" or "fused"); ``_fused_router`` is the one resolved."""
        return self._router

    def resolved_router(self) -> str:  # what "auto" resolved to on the weights' device
        return "torch" if self._fused_router is None else "fused"

    @router.setter
    def router(self, choice: RouterChoice) -> None:
        # Resolved here and on every device move, never inside forward (as the backend).
        self._router = choice
        self._fused_router: FusedRouter | None = fused_router(self.config, self.w13.device, choice)
        self._gate_fn = gate_logits if self._fused_router is not None and triton_runs_on(self.w13.device) else None
        self._gate_route = gate_route if self._gate_fn is not None else None  # gate and router in one launch
        self._gate_mm = linear_into if self._fused_router is not None else None  # above the kernel's rows

    def _apply(self, fn, recurse=True):
        with correction_bias_kept(self):  # float32 whatever the weights' dtype: moved, never cast
            module = super()._apply(fn, recurse)
        move_quantized_(self, fn)  # quantized w13/w2 are not Parameters: moved here, never cast
        self._weights_changed()
        return module

    def _weights_changed(self) -> None:
        """Resolve again and forget what was kept for the old weights (a move, a cast, ``quantize_``)."""
        if self.eager_graphs is not None:
            self.eager_graphs.clear()  # they read the old tensors' memory
        self.backend = self._backend
        self.router = self._router
        self._experts_call.clear()  # a move or cast may keep the Parameter objects but change their data
        self._route_ws.clear()  # buffers on the old device or in the old dtype, or sized for fused shared slots
        self._decode.clear()  # it holds those buffers

    def _load_from_state_dict(self, state_dict, prefix, *args):
        refuse_quantized_into_float(self, state_dict, prefix, *args)  # a quantized checkpoint's scheme, named
        super()._load_from_state_dict(state_dict, prefix, *args)

    def quantize_(self, scheme: str, **options) -> MoE:
        """Quantize the routed experts' w13/w2 in place (a ``moekit.quant`` scheme and ``quantize``'s options) into
        non-trainable QuantizedWeights. The router and the shared expert stay in the model dtype (a fused one is
        un-fused first: ``fuse_shared`` becomes False, same function). Returns the module: ``MoE(cfg).quantize_(s)``."""
        quantize_experts_(self, scheme, **options)
        self._weights_changed()  # the graphs keep the unquantized weights alive; un-fused: other routing buffers
        return self

    @property
    def quant_scheme(self) -> str | None:
        """The experts' quantization scheme, None when they are unquantized."""
        return quant_scheme_of(self.w13)

    def reset_parameters(self) -> None:
        """Random init: N(0, 1/fan_in) for every matrix, so outputs stay O(1) at any width."""
        gate = None if self.shared_gate is None else self.shared_gate.weight  # [1, K]
        for p in (self.gate.weight, self.w13, self.w2, self.shared_w13, self.shared_w2, gate):
            if p is not None:
                nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def route_tokens(self, x2d: torch.Tensor, workspace: RouteWorkspace | None = None) -> RoutedTokens:
        """Gate x2d [M, K], route, drop over capacity (opt-in), append the fused shared slots. Up to ``gate_route.ROWS``
        (256) rows gate and router are one launch (``gate_route``) into ``workspace``'s kept buffers (forward without
        stats), else into fresh ones where two launches' bits would differ (``wants_fresh``), else two."""
        c = self.config
        if not isinstance(x2d, torch.Tensor) or not x2d.is_floating_point() or x2d.shape[1:] != (c.hidden_size,):
            raise input_error("x2d", x2d, c.hidden_size, rows=True)  # forward's checks, for a direct call
        in_kernel = self.fuse_shared and self.capacity_factor is None and self._fused_router is not None  # S appended
        gx, weight, gbias, dtype = self._gate_inputs(x2d)  # [M, K], [E, K], [E] | None; the router dtype
        slots = c.top_k + c.num_shared_slots * in_kernel  # the kernel appends S unless capacity drops in between
        ws = None if workspace is None else workspace.get(x2d, c.num_experts, slots, dtype)
        one = self._gate_route is not None and x2d.shape[0] <= one_launch.ROWS  # rows the one launch may take
        if ws is None and one and wants_fresh(self._fused_router, in_kernel, gx, weight, gbias):
            ws = fresh_buffers(x2d, c.num_experts, slots, dtype)  # a capture's or a stats call's own
        gate_logits = self.shared_gate(x2d) if self.fuse_shared and self.shared_gate is not None else None  # [M, 1]
        bias = self._buffers["e_score_correction_bias"]  # [E] fp32 or None; a buffer, never reassigned as anything else
        routing = None
        if ws is not None and one:
            routing = self._gate_route(self._fused_router, gx, weight, gbias, bias, gate_logits, in_kernel, ws)
        if routing is not None:  # the gate and the router in one launch
            logits = ws.logits  # [M, E]
        else:
            logits = self._gate(gx, weight, gbias, None if ws is None else ws.logits)  # [M, E(+Z|S)]
            if self._fused_router is not None:
                routing = self._fused_router(logits, bias, gate_logits, in_kernel,
                                             None if ws is None else (ws.ids, ws.weights))
            else:
                if self.training and c.sparsemixer_jitter_eps is not None:
                    raise NotImplementedError("sparsemixer_jitter_eps: Phi-MoE's router samples its experts in "
                                              "training (Gumbel noise, a random 1/3 weight); moekit routes only as "
                                              "at inference: call .eval()")
                routing = route(logits, self.config, bias)
        ids = routing.topk_ids  # [M, k(+S)]: the fused kernel may append the shared slots
        identity = identity_weights(routing, c) if c.num_identity_experts else None  # [M, 1]; LongCat-Flash
        if identity is not None:
            routing = without_identity(routing, c)  # ids E..E+Z-1 -> -1: they run no expert
        dropped = None  # dropless: RoutedTokens.dropped makes its zero only when asked (stats)
        if self.capacity_factor is not None:
            capped = apply_capacity(routing, self.config.num_experts, self.capacity_factor, self.drop_policy)
            routing, dropped = capped.routing, capped.dropped
        if self.fuse_shared and not in_kernel:
            routing = append_shared_slots(routing, self.config, gate_logits)
        return RoutedTokens(routing=routing, dropped_count=dropped, router_logits=logits, router_ids=ids,
                            top_k=self.config.top_k, identity_weights=identity)

    def _gate_inputs(self, x2d: torch.Tensor):
        """(x2d, gate weight, gate bias, router dtype): as stored, else cast (``moekit.routing.gate.gate_inputs``)."""
        g, c = self._modules["gate"], self.config
        return gate_inputs(x2d, _param(g, "weight"), _param(g, "bias"), c.router_dtype, self._gate_fn is not None)

    def _router_logits(self, x2d: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x2d [M, K] -> logits [M, E(+Z|S)] in the router dtype (``_gate_inputs``), into ``out`` where it is given."""
        return self._gate(*self._gate_inputs(x2d)[:3], out)

    def _gate(self, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None):
        """The gate GEMM (``_gate_inputs``' tensors) -> logits in the router dtype: the kernel for a few rows, else
        on the casts ``torch.mm`` into ``out`` (a workspace's, used in that dtype) or ``F.linear`` (``torch_gate``)."""
        dtype = router_dtype_of(weight, router_dtype := self.config.router_dtype)
        out = out if out is None or out.dtype == dtype else None
        kernel = self._gate_fn is not None and x2d.shape[0] <= GATE_ROWS  # rows the kernel takes at all
        logits = self._gate_fn(x2d, weight, bias, out, dtype) if kernel else None  # None: not for the kernel
        return torch_gate(x2d, weight, bias, router_dtype, out, self._gate_mm) if logits is None else logits

    def forward(self, x: torch.Tensor, return_stats: bool = False,
                return_aux_loss: bool = False) -> torch.Tensor | MoEOutput:
        """x [..., K] -> [..., K]; with ``return_stats`` an ``MoEOutput`` with the stats (syncs with the host); with
        ``return_aux_loss`` one with ``stats=None``, ``router_logits`` and ``aux_loss`` (None when the config's three
        loss coefficients are 0) and no host read: ``torch.compile(fullgraph=True)`` traces it (training)."""
        if return_aux_loss and return_stats:
            raise ValueError("pass return_stats=True or return_aux_loss=True, not both: return_stats's MoEOutput "
                             "already has aux_loss (with the stats, a host read); return_aux_loss's has no host read")
        extra = return_stats or return_aux_loss  # an MoEOutput: the eager caches below return the output alone
        out = self._decode(self, x) if not extra and self.eager_graphs is None else None  # a repeated decode
        if out is not None:  # a plain 2-D x: straight to its launches (moekit.layer_fast: implies the checks below)
            return out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape[-1:] != (self.config.hidden_size,):
            raise input_error("x", x, self.config.hidden_size)
        flat = x.dim() == 2  # the common case: no reshape either way (each one ~1-2 µs of host time)
        x2d = x if flat else x.reshape(-1, x.shape[-1])  # [M, K]
        out = self._graphed(x2d) if self.eager_graphs is not None and not extra else None
        if out is None:
            own = not extra and self._fused_router is not None and self._plain_routing
            out = self._decode(self, x2d) if own and not flat else None  # a flattened x's repeated decode call, or None
        if out is None:
            routed = self.route_tokens(x2d, self._route_ws) if own else self.route_tokens(x2d)  # Gate, Route, Capacity
            out = self._experts_and_shared(x2d, routed)  # [M, K]
            if own:
                self._decode.keep(self, x2d)
        out = out if flat else out.reshape(x.shape)
        if not extra:
            return out
        seq_len = x.shape[-2] if x.dim() >= 3 else x2d.shape[0]
        return MoEOutput(out=out, stats=stats_on_host(self, routed) if return_stats else None,
                         router_logits=routed.router_logits, aux_loss=self._aux_loss(routed, seq_len))

    def traced_forward(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d [M, K] -> [M, K]: ``forward(x2d)`` as torch.compile traces it, without the eager caches ``forward``
        consults first (the decode fast path, the route workspace, the eager graphs: each stands aside while
        compiling, yet dynamo guards what it reads), so a compiled caller's guards hold none of them
        (``use_moekit_blocks``' compiled blocks). Eager callers use ``forward``."""
        return self._experts_and_shared(x2d, self.route_tokens(x2d))

    def _experts_and_shared(self, x2d: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        """[Group -> Experts -> Combine] with the moekit.experts backend, then [Shared] when not fused."""
        routing = routed.routing
        if self.config.expert_weight_on == "input":  # Llama-4: expert(w x), one experts call per slot
            out = input_weighted(self.run_routed, x2d, routing)  # [M, K]
        elif self._plain_run:  # run_routed with the argument check once per weight set
            b13, b2 = _param(self, "b13"), _param(self, "b2")
            if b13 is not None and self.fuse_shared and torch.is_grad_enabled():
                b13, b2 = (shared_rows_detached(b, self.config.num_shared_slots) for b in (b13, b2))
            out = self._experts_call(self._experts_fn, x2d, _param(self, "w13"), _param(self, "w2"), routing.topk_ids,
                                     routing.topk_weights, activation=self.config.activation, b13=b13, b2=b2)  # [M, K]
        else:
            out = self.run_routed(x2d, routing)  # [M, K]; a subclass places the experts
        if self.shared_w13 is not None:
            out = out + shared_mlp(x2d, self.shared_w13, self.shared_w2, self.shared_gate, self.config,
                                   routing.shared_weights)  # [M, K]
        if routed.identity_weights is not None:  # LongCat-Flash's zero-computation experts: weight x token
            out = out + (x2d * routed.identity_weights).to(out.dtype)
        return out

    def _graphed(self, x2d: torch.Tensor) -> torch.Tensor | None:
        """The forward replayed from a CUDA graph (``eager_graph_rows``), or None where it must run eagerly:
        autograd, capacity dropping (its count is read back), a subclass that places experts elsewhere."""
        tensors = tuple(self._graph_tensors())
        if (self.capacity_factor is not None or type(self).run_routed is not MoE.run_routed
                or (torch.is_grad_enabled() and (x2d.requires_grad or any(t.requires_grad for t in tensors)))
                or transforming()):
            return None  # a replay has no autograd (any tensor that needs a gradient: w2, a bias, the shared
            # expert), and a torch.func transform's tensors (a tangent, a batch) have no storage to replay from
        key = (self._experts_fn, self._fused_router, *(t.data_ptr() for t in tensors))
        return self.eager_graphs.run(lambda x: self._experts_and_shared(x, self.route_tokens(x)), x2d, key, tensors)

    def _graph_tensors(self):
        """Every tensor the forward reads besides x: a new one (not an in-place update) needs a new graph."""
        for t in (self.gate.weight, self.gate.bias, self.b13, self.b2, self.e_score_correction_bias,
                  self.shared_w13, self.shared_w2, None if self.shared_gate is None else self.shared_gate.weight):
            if t is not None:
                yield t
        for w in (self.w13, self.w2):
            yield from (w.tensors().values() if hasattr(w, "tensors") else (w,))

    def _aux_loss(self, routed: RoutedTokens, seq_len: int) -> torch.Tensor | None:
        """The configured sum of coefficient x loss (``MoEOutput.aux_loss``); the sequence-wise loss takes
        x [..., T, K]'s second-to-last dim as the sequence (a 2-D x is one sequence of M tokens)."""
        return configured_aux_loss(self.config, routed.router_logits, routed.selected_ids, seq_len)

    def run_routed(self, x2d: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts and combine stage: x2d [M, K] and its routing -> [M, K]. Subclasses that place
        experts elsewhere (expert parallelism) override this one step."""
        return call_backend(self._experts_fn, x2d, self.w13, self.w2, routing.topk_ids, routing.topk_weights,
                            activation=self.config.activation, b13=self.b13, b2=self.b2)

    def _stats(self, routed: RoutedTokens) -> MoEStats:
        return stats_of(routed, self.config.num_experts, self.stats_block_size, self._layout_used(routed.routing),
                        self.config.num_identity_experts)

    def _layout_used(self, routing: Routing) -> str:
        """The layout ``run_routed`` grouped this routing with (the backend's own rule, from shapes alone)."""
        return self._layout_for(routing, self.w13, self.w2)

    def _layout_for(self, routing: Routing, w13, w2) -> str:
        """The layout this layer's backend groups ``routing`` with over experts ``w13`` [E, 2N, K], ``w2`` [E, K, N]
        (tensors or QuantizedWeights; a subclass's may not be ``self.w13``: an offloaded layer's cache slots)."""
        backend = running_backend(self._experts_fn, self.resolved_backend(), w13, w2, routing.topk_weights,
                                  self.config.activation, self.b13, self.b2, routing.num_tokens)  # auto: may train
        if backend != "triton" and quant_scheme_of(w13) == "fp8_block":
            return "per_expert_loop"  # reference and grouped_mm run fp8_block through moekit.quant's recipe loop
        if backend != "grouped_mm":
            return {"triton": "block_aligned", "reference": "per_expert_loop"}.get(backend, backend)
        keep = ("memory_budget_bytes", "layout") if routing.num_tokens else ("layout",)  # M = 0: no experts call
        options = {k: v for k, v in self.backend_options.items() if k in keep}
        plan = plan_grouped_mm(*routing.topk_ids.shape, w13.shape[0], w13.shape[2], w2.shape[2], w13.dtype,
                               allow_sync=w13.device.type == "cpu", device_type=w13.device.type, **options)
        chunked = plan.chunk_tokens < routing.num_tokens
        return f"{plan.layout} in chunks of {plan.chunk_tokens}" if chunked else plan.layout

    def resolved_backend(self) -> str:  # the backend that runs on the weights' device: "auto" resolved
        return resolve_backend(self.backend, self.w13.device)

    def extra_repr(self) -> str:  # what a user checks: shapes, routing, the experts' dtype and scheme, what "auto" runs
        return layer_line(self)


def _param(module: nn.Module, name: str):
    """``module.<name>`` from ``_parameters`` without ``nn.Module.__getattr__`` (~0.5 µs), else through getattr."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)
