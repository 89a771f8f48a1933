"""``ParamBill``: a whole model's parameters by part, and the MoE layers' parts of it (``moe_parts``), shared by the
bill of the families ``bills.param_bill`` reads as attention + MLP layers and by those whose layers are their own
(``bills_hybrid``: Nemotron-H, DBRX, JetMoE; ``bills_seq2seq``: Switch-Transformers, NLLB-MoE).

Shapes: d = hidden size, E = routed experts, k = experts per token, N = one expert's intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.analysis.billed import BilledLayer


@dataclass(frozen=True)
class ParamBill:
    """Parameters of a whole model, by part. ``active`` counts what one token's forward pass uses,
    embedding included (Mixtral's and Qwen's cards count it: 12.9B, 3.3B); ``active_matmul`` leaves the
    embedding lookup out (DeepSeek's cards do: 37B for V3, 2.4B for V2-Lite). An encoder-decoder's bill is its
    decoder's (with the shared embedding and the head), the encoder's by part in ``encoder``: a decode step runs the
    decoder only (its cross-attention reads the encoder's output, made once per prompt), so ``active`` and the
    step's floors leave the encoder out, and ``total`` and the memory bills hold it."""

    embedding: int  # V·d
    output: int  # V·d, 0 when tied to the embedding
    attention: int  # all L layers' token mixers (an encoder-decoder's decoder: self- and cross-attention)
    dense_mlp: int  # 3·d·intermediate_size per dense layer (2·d·width ungated)
    routed_experts: int  # E·3·d·N per MoE layer
    active_routed_experts: int  # k·3·d·N per MoE layer
    shared_experts: int  # 3·d·width (+ d for a shared gate) per MoE layer
    router: int  # d·E per MoE layer
    norms: int  # 2·d per layer + the final d; DeepSeek-V4's hyper-connection mixers too (its residual streams')
    num_moe_layers: int
    num_dense_layers: int  # the layers without a MoE block
    exact: bool = False  # the family is in EXACT_BILL: this bill equals transformers' model to the parameter
    # a MoE layer's second sparse block, experts and gate, per MoE layer (ERNIE-4.5-VL's vision tokens' block,
    # ``second_sparse_block``): in the total, not active (a text token runs none of it)
    second_blocks: int = 0
    # attention's own experts (JetMoE's mixture of attention heads: E query / output projection pairs a layer, k
    # of them a token), beside ``attention`` (what every token runs: its kv projection, router and bias)
    attention_experts: int = 0
    active_attention_experts: int = 0
    # an encoder-decoder's decoder's cross-attention key / value projections: run over the encoder's output once per
    # prompt and cached, so a decode step reads none of them (``attention`` holds their q and o)
    cross_kv: int = 0
    encoder: ParamBill | None = None  # an encoder-decoder's encoder (no embedding, no head: the decoder's count them)

    @property
    def step_total(self) -> int:
        """The parameters of the stack a decode step runs: all of them but an encoder's."""
        return (self.embedding + self.output + self.attention + self.attention_experts + self.cross_kv + self.dense_mlp
                + self.routed_experts + self.shared_experts + self.router + self.norms + self.second_blocks)

    @property
    def total(self) -> int:
        return self.step_total + (self.encoder.total if self.encoder else 0)

    @property
    def active(self) -> int:
        """Parameters one (text) token of a decode step uses: everything but the routed (and attention) experts it
        did not pick, the second sparse blocks (ERNIE-4.5-VL's vision blocks), an encoder and the cross-attention's
        key / value projections (made once per prompt)."""
        return (self.step_total - self.routed_experts + self.active_routed_experts - self.second_blocks
                - self.attention_experts + self.active_attention_experts - self.cross_kv)

    @property
    def total_matmul(self) -> int:
        """All parameters that take part in a matmul: the total less the embedding lookup and the norms."""
        encoder = self.encoder.total_matmul if self.encoder else 0
        return self.step_total - self.embedding - self.norms + encoder

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in a matmul (the embedding is a lookup): F ≈ 2·this per token."""
        return self.active - self.embedding - self.norms

    @property
    def in_format(self) -> int:
        """The matmul weights a checkpoint stores in its format (attention, dense MLPs, routed, shared and second
        experts), an encoder's too; the embedding, head, router and norms are kept in bf16."""
        own = (self.attention + self.attention_experts + self.cross_kv + self.dense_mlp + self.routed_experts
               + self.second_blocks + self.shared_experts)
        return own + (self.encoder.in_format if self.encoder else 0)


def moe_parts(layer: BilledLayer, moe_layers: int) -> dict[str, int]:
    """The MoE layers' part of a bill (``ParamBill``'s keyword arguments): ``moe_layers`` layers of ``layer``'s
    routed experts (k·E/(E + Z) of them active: identity experts run nothing), shared experts and router."""
    return dict(routed_experts=moe_layers * layer.config.num_experts * layer.expert_params,
                active_routed_experts=round(moe_layers * layer.config.routed_slots_per_token * layer.expert_params),
                shared_experts=moe_layers * layer.shared_params, router=moe_layers * layer.router_params)
