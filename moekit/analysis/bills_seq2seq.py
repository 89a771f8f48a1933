"""Whole-model bills of the encoder-decoder MoE families (Switch-Transformers, NLLB-MoE), the encoder and the decoder
apart (``ParamBill.encoder``): a decode step runs the decoder only (its self-attention, its cross-attention over the
encoder's output, whose keys and values are projected once per prompt and cached: ``ParamBill.cross_kv``, and its MoE
layers), so the step's active parameters and floors are the decoder's and the encoder is in the total and the memory
bills. Each counted as transformers 5.25's model holds its
tensors (``tests/test_analysis_whole.py``).

Shapes: V = vocab, d = ``d_model``, N = the MLPs' width, E = experts, H = heads.
"""

from __future__ import annotations

import dataclasses

from moekit.analysis.bill_parts import ParamBill, moe_parts
from moekit.analysis.billed import BilledLayer, nllb_sparse_layers, switch_sparse_layers


def _stack(layer: BilledLayer, layers: int, sparse: int, projection: int, cross: bool, dense_mlp: int,
           norms: int) -> ParamBill:
    """One stack (an encoder or a decoder, without the embedding and head) of ``layers`` layers: self-attention of
    four projections of ``projection`` parameters each (q, k, v, o), with ``cross`` cross-attention's too (its k and
    v apart: ``cross_kv``); ``sparse`` MoE layers (``layer``'s experts and router), the others a dense MLP of
    ``dense_mlp`` parameters; ``norms`` the stack's."""
    return ParamBill(embedding=0, output=0, attention=layers * (4 + 2 * cross) * projection,
                     cross_kv=layers * 2 * cross * projection, dense_mlp=(layers - sparse) * dense_mlp,
                     **moe_parts(layer, sparse), norms=norms, num_moe_layers=sparse, num_dense_layers=layers - sparse,
                     exact=True)


def _with_embedding(c: dict, d: int, decoder: ParamBill, encoder: ParamBill) -> ParamBill:
    """The decoder's bill with the shared embedding [V, d] and the encoder. Tied (``tie_word_embeddings``, both
    families' default) the encoder's and decoder's lookups and the head are that one tensor; untied, transformers
    5.25's model ties none of them (its ``_tied_weights_keys`` go with the flag): the shared table, each stack's own
    ``embed_tokens`` [V, d] and the head [V, d]."""
    table = c["vocab_size"] * d
    if c.get("tie_word_embeddings", True):
        return dataclasses.replace(decoder, embedding=table, encoder=encoder)
    return dataclasses.replace(decoder, embedding=2 * table, output=table,
                               encoder=dataclasses.replace(encoder, embedding=table))


def _switch(c: dict, layer: BilledLayer) -> ParamBill:
    """Switch-Transformers (T5's layers): attention q, k, v [H·d_kv, d] and o [d, H·d_kv] without biases, a relative
    position bias [buckets, H] in each stack's first layer, RMSNorms (weights [d]) before each sublayer and at each
    stack's end, the dense MLPs ungated (wi [N, d], wo [d, N]); the decoder's layers add cross-attention and its norm.
    ``num_decoder_layers`` None: ``num_layers``."""
    d, heads = c["d_model"], c.get("num_heads", 12)
    projection = d * heads * c.get("d_kv", 64)
    position = c.get("relative_attention_num_buckets", 32) * heads  # counted with attention
    layers = c["num_layers"]
    decoder_layers = layers if c.get("num_decoder_layers") is None else c["num_decoder_layers"]
    encoder_sparse, decoder_sparse = switch_sparse_layers(c)
    mlp = 2 * d * c["d_ff"]
    encoder = _stack(layer, layers, encoder_sparse, projection, False, mlp, 2 * layers * d + d)
    decoder = _stack(layer, decoder_layers, decoder_sparse, projection, True, mlp, 3 * decoder_layers * d + d)
    decoder, encoder = (dataclasses.replace(s, attention=s.attention + position) for s in (decoder, encoder))
    return _with_embedding(c, d, decoder, encoder)


def _nllb_stack(c: dict, layer: BilledLayer, part: str) -> ParamBill:
    """NLLB-MoE's ``part`` ("encoder", "decoder": cross-attention too): attention q, k, v, out_proj [d, d] with
    biases, a LayerNorm (weight and bias) before each sublayer and at the stack's end, the dense MLPs ungated with
    biases (fc1 [N, d], fc2 [d, N], N = ``<part>_ffn_dim``); sinusoidal positions (no parameters)."""
    d, layers, width = c["d_model"], c[f"{part}_layers"], c[f"{part}_ffn_dim"]
    cross = part == "decoder"
    return _stack(layer, layers, nllb_sparse_layers(c, part), d * d + d, cross, 2 * d * width + width + d,
                  layers * (2 + cross) * 2 * d + 2 * d)


def _nllb_moe(c: dict, layer: BilledLayer) -> ParamBill:
    return _with_embedding(c, c["d_model"], _nllb_stack(c, layer, "decoder"), _nllb_stack(c, layer, "encoder"))


ENCODER_DECODERS = {"switch_transformers": _switch, "nllb-moe": _nllb_moe}
