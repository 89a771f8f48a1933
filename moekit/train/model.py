"""A small byte-level language model whose feed-forward layers are ``moekit.MoE``.

    bytes [B, T] -> embed + position -> L x [norm -> causal attention -> norm -> MoE] -> norm -> logits [B, T, 256]

Shapes: B sequences, T bytes each, D model width, H heads, E experts, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moekit.config import MoEConfig
from moekit.layer import MoE, MoEOutput, MoEStats

VOCAB = 256  # one token per byte value


@dataclass
class LMOutput:
    """One forward of the model."""

    loss: torch.Tensor  # [] next-byte cross-entropy, mean over B*T
    aux_loss: torch.Tensor | None  # [] the MoE layers' aux losses summed; None when no coefficient is set
    stats: list[MoEStats]  # one per MoE layer: counts [E], dropped, ...


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MoE layer, each residual."""

    def __init__(self, d_model: int, num_heads: int, moe: MoE) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # [3D, D]
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, MoEOutput]:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.num_heads, d // self.num_heads).unbind(2)  # [B, T, H, D/H]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))  # [B, T, D]
        res = self.moe(self.norm2(h), return_stats=True)  # x [B, T, D]: the sequence-wise loss sees T
        return h + res.out, res


class TinyMoELM(nn.Module):
    """``num_layers`` blocks of attention + ``MoE(config)``, then a linear head over the 256 byte values."""

    def __init__(self, config: MoEConfig, num_layers: int, num_heads: int, max_seq_len: int, **moe_kwargs) -> None:
        super().__init__()
        d = config.hidden_size
        if d % num_heads:
            raise ValueError(f"hidden_size ({d}) must be divisible by num_heads ({num_heads})")
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(max_seq_len, d))
        self.blocks = nn.ModuleList(Block(d, num_heads, MoE(config, **moe_kwargs)) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)  # [256, D]
        # Unit-variance byte embeddings: with small ones (GPT's 0.02) the attention's average over the
        # prefix dominates every token's vector, and at step 0 the router already sends most tokens to
        # the same experts (max/mean load 2.8 of 4 measured), before any training could skew it.
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.pos, std=0.02)

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> LMOutput:
        """inputs, targets [B, T] int64 byte values -> the loss, the summed aux loss and each layer's stats."""
        h = self.embed(inputs) + self.pos[: inputs.shape[1]]  # [B, T, D]
        results = []
        for block in self.blocks:
            h, res = block(h)
            results.append(res)
        logits = self.head(self.norm(h))  # [B, T, 256]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        aux = [r.aux_loss for r in results if r.aux_loss is not None]
        return LMOutput(loss=loss, aux_loss=sum(aux) if aux else None, stats=[r.stats for r in results])
