"""``HashMoE``: an ``MoE`` whose experts a token-id table chooses (DeepSeek-V4's hash layers); forward takes the ids.

    [Gate] -> [Route: tid2eid[token_ids], weighted by the scores] -> [Capacity, opt-in] -> [Group] -> [Experts]
    -> [Combine] (+ shared)

Everything after the routing is ``MoE``'s. The routing is, on CUDA, its one-launch kernel (``moekit.routing.
hash_fused``: H100, V4's layer at M = 1, 407 -> 126 µs of host a call, ``benchmarks/v4r48_device_check.py``), else
``moekit.routing.hash_route`` in torch; with it, the gate of up to 8 rows is ``MoE``'s gate kernel
(``routing.gate.gate_logits``, as a top-k layer's fused router has it), else ``F.linear``. With the one-launch router a
repeated eager call of up to 256 tokens goes straight to its launches (``moekit.layer_hash_fast``, tried before
forward's checks, as ``MoE.forward`` tries its own); ``MoE.forward``'s route workspace and CUDA graphs stand aside.

Shapes: M tokens (leading dims flattened), K hidden, E routed experts, k = top_k, V table rows.
"""

from __future__ import annotations

import torch

from moekit._checks import input_error
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.layer_hash_fast import HashDecodeFast
from moekit.routing import append_shared_slots, apply_capacity
from moekit.routing.hash_fused import FusedHashRouter, computes
from moekit.routing.gate import gate_logits
from moekit.routing.hash_route import check_hash_eps, check_table, default_table, hash_route
from moekit.routing.routed import MoEOutput, RoutedTokens, stats_on_host
from moekit.triton_bind import triton_runs_on


def _check_router(router) -> None:
    if router not in ("auto", "torch", "fused"):
        raise ValueError(f"router must be 'auto', 'torch' or 'fused' for a HashMoE (its routing is a table lookup: "
                         f"hash_route in torch, or its one-launch kernel), got {router!r}")


class HashMoE(MoE):
    """``MoE`` routed by ``tid2eid`` [V, k] int64 (a buffer: saved, loaded, moved with the layer): token t runs experts
    ``tid2eid[token_ids[t]]``, weighted by its scores there (``hash_route``). ``config.hash_table_size`` = V.

    ``moe(x, token_ids=ids)``: ids of x's shape without K (a model's input ids). A fresh layer's table spreads the ids
    over the experts (``default_table``); ``load_table_`` copies a model's, checked. ``router``: "auto" (default: the
    one-launch ``FusedHashRouter`` on CUDA, ``hash_route`` elsewhere), "fused" (always) or "torch" (never);
    ``eager_graph_rows`` does not apply: refused."""

    takes_token_ids = True  # read by check_layer_args: a config with hash_table_size builds this class only

    def __init__(self, config: MoEConfig, *, router: str = "auto", **options) -> None:
        _check_router(router)
        check_hash_eps(config)
        if options.get("eager_graph_rows") is not None:
            raise ValueError("eager_graph_rows: a HashMoE runs eagerly (its forward takes the token ids)")
        super().__init__(config, router="torch", **options)
        self.register_buffer("tid2eid", default_table(config, self.w13.device))  # [V, k] int64
        self.router = router
        self._hash_decode = HashDecodeFast()  # forward's repeated decode calls (the fused router's), kept per M
        # what the fast path skips is this class's own (a subclass that routes or places the experts elsewhere: never)
        self._plain_hash = type(self).route_tokens is HashMoE.route_tokens and self._plain_run

    @property
    def router(self) -> str:
        """The hash router asked for ("auto", "torch" or "fused"; ``_hash_router`` the one resolved): what
        ``OffloadedMoE.from_moe`` and ``EPMoE.from_moe`` hand the layers they build."""
        return self._router

    @router.setter
    def router(self, choice: str) -> None:
        # Resolved here and on every move (MoE._weights_changed sets it again), never inside forward (as MoE's).
        _check_router(choice)
        MoE.router.fset(self, "torch")  # MoE's top-k router and its gate: never a hash layer's
        self._router = choice
        # the table lookup in one launch: always with "fused", on CUDA with "auto" (as MoE's fused router)
        self._hash_router = FusedHashRouter(self.config) if choice == "fused" or (
            choice == "auto" and computes(self.config)) else None
        self._hash_cuda_only = choice == "auto"
        self._hash_gate()

    def resolved_router(self) -> str:  # the table looked up in one launch ("fused") or in torch, on this device
        fused = self._hash_router is not None and (self.w13.device.type == "cuda" or not self._hash_cuda_only)
        return "fused" if fused else "torch"

    def _weights_changed(self) -> None:
        super()._weights_changed()  # the routers resolved again (the setter above)
        decode = self.__dict__.get("_hash_decode")  # None while MoE.__init__ runs
        if decode is not None:
            decode.clear()  # it holds buffers on the old device and the experts' kept calls

    def _hash_gate(self) -> None:
        """The gate kernel (``MoE._gate``'s, up to 8 rows) wherever the one-launch hash router routes this layer's
        logits (on the weights' device): so the full forward and ``layer_hash_fast`` gate alike, and neither through
        cuBLAS's host setup (``F.linear``: the torch router's path, compiled and autograd calls too)."""
        device = self.w13.device
        fused = self._hash_router is not None and triton_runs_on(device) and (
            device.type == "cuda" or not self._hash_cuda_only)
        self._gate_fn = gate_logits if fused else None

    def load_table_(self, table: torch.Tensor) -> HashMoE:
        """Copy ``table`` [V, k] (checked: shape, integer dtype, experts in [0, E)) into ``tid2eid``."""
        with torch.no_grad():
            self.tid2eid.copy_(check_table(table, self.config))
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args):
        table = state_dict.get(prefix + "tid2eid")
        if table is not None:  # a table entry outside [0, E) is refused at load, never met in a forward
            check_table(table, self.config, name=prefix + "tid2eid")
        super()._load_from_state_dict(state_dict, prefix, *args)

    def route_tokens(self, x2d: torch.Tensor, workspace=None, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        """Gate x2d [M, K], route by ``token_ids`` [M], drop over capacity (opt-in), append the fused shared slots.
        ``workspace`` is ``MoE.route_tokens``' and unused (no kept buffers)."""
        c = self.config
        if not isinstance(x2d, torch.Tensor) or not x2d.is_floating_point() or x2d.shape[1:] != (c.hidden_size,):
            raise input_error("x2d", x2d, c.hidden_size, rows=True)
        if token_ids is None:
            raise TypeError("token_ids is required: a HashMoE (config.hash_table_size) chooses each token's experts "
                            "by its id, tid2eid[token_ids]; call moe(x, token_ids=input_ids)")
        logits = self._router_logits(x2d)  # [M, E]
        in_kernel = self.fuse_shared and self.capacity_factor is None and self.shared_gate is None  # S appended
        fused = self._hash_router is not None and (logits.is_cuda or not self._hash_cuda_only)
        if fused:
            routing = self._hash_router(logits, token_ids, self._buffers["tid2eid"], in_kernel)  # [M, k(+S)]
        else:
            routing = hash_route(logits, token_ids, self._buffers["tid2eid"], c)  # [M, k]
        ids, dropped = routing.topk_ids[:, :c.top_k], None
        if self.capacity_factor is not None:
            capped = apply_capacity(routing, c.num_experts, self.capacity_factor, self.drop_policy)
            routing, dropped = capped.routing, capped.dropped
        if self.fuse_shared and not (in_kernel and fused):
            gate_logits = self.shared_gate(x2d) if self.shared_gate is not None else None  # [M, 1]
            routing = append_shared_slots(routing, c, gate_logits)
        return RoutedTokens(routing=routing, dropped_count=dropped, router_logits=logits, router_ids=ids,
                            top_k=c.top_k)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None, return_stats: bool = False,
                return_aux_loss: bool = False) -> torch.Tensor | MoEOutput:
        """x [..., K], token_ids [...] (x's shape without K) -> [..., K]; ``return_stats`` / ``return_aux_loss`` as
        ``MoE.forward``'s. ``torch.compile`` traces it whole (the id range check is a device-side assert there)."""
        if return_aux_loss and return_stats:
            raise ValueError("pass return_stats=True or return_aux_loss=True, not both (as MoE.forward)")
        extra = return_stats or return_aux_loss
        out = None if extra else self._hash_decode(self, x, token_ids)  # a repeated decode call: straight to its
        if out is not None:  # launches (layer_hash_fast: a plain 2-D x and [M] ids; implies the checks below)
            return out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or \
                x.shape[-1] != self.config.hidden_size:
            raise input_error("x", x, self.config.hidden_size)
        if isinstance(token_ids, torch.Tensor) and token_ids.shape != x.shape[:-1]:
            raise ValueError(f"token_ids must have x's shape without its last dim, {tuple(x.shape[:-1])}, got "
                             f"{tuple(token_ids.shape)}")
        flat = x.dim() == 2  # the common decode case: no reshapes (each ~1-2 µs of host, as MoE.forward)
        x2d = x if flat else x.reshape(-1, x.shape[-1])  # [M, K]
        ids = token_ids.reshape(-1) if isinstance(token_ids, torch.Tensor) and not flat else token_ids  # [M]
        out = None if extra or flat else self._hash_decode(self, x2d, ids)  # a flattened call's, or None
        if out is None:
            routed = self.route_tokens(x2d, token_ids=ids)
            out = self._experts_and_shared(x2d, routed)  # [M, K]
            if not extra:
                self._hash_decode.keep(self, x2d, ids, routed.router_logits)
        out = out if flat else out.reshape(x.shape)  # [..., K]
        if not extra:
            return out
        seq_len = x.shape[-2] if x.dim() >= 3 else x2d.shape[0]
        return MoEOutput(out=out, stats=stats_on_host(self, routed) if return_stats else None,
                         router_logits=routed.router_logits, aux_loss=self._aux_loss(routed, seq_len))

    def traced_forward(self, x2d: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x2d [M, K], token_ids [M] -> [M, K]: ``forward`` as a compiled caller traces it (``MoE.traced_forward``)."""
        return self._experts_and_shared(x2d, self.route_tokens(x2d, token_ids=token_ids))
