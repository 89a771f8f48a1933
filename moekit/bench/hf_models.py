"""The transformers models behind ``moekit bench --hf``: built offline from a config, random weights.

Models at their published widths (moekit's presets, which are the models' own ``config.json``
fields; for DeepSeek-V4 and Step-3.7, which have no preset, the widths of the checkpoint transformers' config class
documents, pinned here), cut to a few layers and a 32000-token vocabulary (Qwen3's own is 151936; Mixtral's is 32000):

    qwen3        Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top-8, 32 query / 4 kv heads of 128
    mixtral      Mixtral-8x7B:  hidden 4096, 8 experts of width 14336, top-2, 32 query / 8 kv heads of 128
    gpt-oss-20b  gpt-oss-20b:   hidden 2880, 32 experts of width 2880, top-4, 64 query / 8 kv heads of 64;
                 experts with biases, interleaved gate/up, clamped SwiGLU (alpha 1.702, limit 7), transposed
    deepseek-v3  DeepSeek-V3:   hidden 7168, 256 experts of width 2048, top-8 of 8 groups keeping 4, sigmoid scores
                 with a correction bias (drawn: zeros at init), routed scaling 2.5, one shared expert, MLA
                 attention (128 heads, q / kv ranks 1536 / 512); every layer an MoE layer (the published
                 model's first 3 are dense). 2 layers: 48 GB in bf16; with --hf-quant fp8, 62 GB while the
                 fp8 copy is made (hf_quant), so one 80 GB card holds either run
    deepseek-v4  DeepSeek-V4-Flash-Base (transformers' DeepseekV4Config defaults, its docstring's checkpoint): hidden
                 4096, 256 experts of width 2048, top-6, sqrt(softplus) scores with a correction bias, routed
                 scaling 1.5, SwiGLU clamped at 10, one shared expert, hyper-connections (hc_mult 4), compressed
                 attention (64 heads of 512, one kv head); layer 0 hash-routes (tid2eid[input_ids], drawn), the rest
                 top-k (the published model's first 3 hash). 2 layers: 27 GB in bf16. transformers compiles no
                 DeepSeek-V4 decode (its compressor keeps state in its own dynamic cache: no static cache), so its
                 compiled rows say so (``static_cache_gap``) and only the eager ones run
    step-3.7     Step-3.7-Flash (transformers' Step3p7TextConfig defaults): hidden 4096, 288 experts of width 1280,
                 top-8, sigmoid scores with a correction bias, a shared expert of width 1280, 64 query / 8 kv heads of
                 128; every layer an MoE layer (the published model's first 3 are dense), the last one clamped as
                 the published model's last two (routed experts 7, shared 16, after the activation). An image-text
                 model: its vision tower cut to one 32-wide layer (never run: text ids only). 4 layers: 37 GB in bf16.
                 All full attention (transformers' default layer types); sliding_window is set only because the
                 mask code reads it. Under transformers 5.17 its experts class is not dispatched (no
                 ``use_experts_implementation``): the experts implementations' rows say so (``not_run``)

``tiny=True`` shrinks every width, and sets DeepSeek-V4's and Step-3.7's clamps to ``TINY_CLAMP`` (the CPU tests run
the same code path on it). No tokenizer, no checkpoint: nothing here reaches the hub.

The experts implementations are discovered from transformers' registry at run time (``"eager"`` plus
every key of ``ALL_EXPERTS_FUNCTIONS``, which holds ``"moekit"`` once ``moekit.hf`` is imported; an fp8
model's from ``FP8ExpertsInterface``, ``hf_quant``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from moekit.bench.hf_wo import QUANT_BLOCKS_IMPL, BLOCK_QUANTS, use_blocks
from moekit.config import MoEConfig
from moekit.presets import hf_config_of_preset

VOCAB_SIZE = 32000  # both models' embeddings and LM head at this size: random ids need no real vocabulary
REFERENCE_IMPL = "eager"  # transformers' per-expert loop: every other implementation is compared with it
# The ceiling: experts that return zeros at no cost. Its decode tok/s is what any experts implementation
# could reach at best in that model (the rest of the step: attention, router, norms, generate's loop), so
# a speed-up target over another implementation can be checked against it. Never in the default set;
# registered when asked for by name.
NO_EXPERTS_IMPL = "no_experts"
# Not an experts implementation: every MoE block runs moekit's whole layer (``moekit.hf.use_moekit_blocks``:
# moekit's router and the layer's decode fast path); blocks it leaves run the "moekit" experts. Runs when named.
BLOCKS_IMPL = "moekit_blocks"
# Of the correction bias drawn for DeepSeek-V3's routers (build_model): about the spread of its sigmoid scores at the
# real width (router logits of std ~1.7), so the bias moves some choices, not all
CORRECTION_BIAS_STD = 0.1
_IMPL_ORDER = ("eager", "moekit", "grouped_mm", "batched_mm")  # the rest follow in name order


@dataclass(frozen=True)
class HFModelSpec:
    name: str  # the --hf-model value
    preset: str | None  # the moekit preset holding the published config.json fields; None: ``fields`` hold them
    default_layers: int  # decoder layers on the GPU (the CPU default is 1: fp32 real widths are GBs per layer)
    tiny: dict  # config overrides for --tiny
    fields: dict = field(default_factory=dict)  # config overrides at every width (the preset's model cut to fit)
    model_type: str | None = None  # transformers' model type, where no preset names it
    layer_fields: Callable[[int, bool], dict] | None = None  # the per-layer list fields: (layers, tiny) -> fields
    # an image-text model's vision tower config (the text fields go to its text_config): never run, at every width
    vision: dict | None = None


# The SwiGLU clamp of the tiny models (--tiny): where their activations reach (gate and up of std ~0.16), so the clamp
# bites: without it the tiny models' logits move 5e-2 (DeepSeek-V4: 8e-2), and a row that skipped it would show
TINY_CLAMP = 0.1


def _v4_layers(n: int, tiny: bool) -> dict:
    # layer 0 hash-routes, the rest route top-k: both router kinds in the fewest layers
    return {"mlp_layer_types": ["hash_moe"] + ["moe"] * (n - 1)}


STEP_CLAMPS = (7.0, 16.0)  # Step-3.7-Flash's last layers' limits: routed experts, shared expert (transformers' note)


def _step_layers(n: int, tiny: bool) -> dict:
    # every layer MoE, the last one clamped (0: no clamp)
    experts, shared = (TINY_CLAMP, TINY_CLAMP) if tiny else STEP_CLAMPS
    return {"mlp_layer_types": ["sparse"] * n, "swiglu_limits": [0.0] * (n - 1) + [experts],
            "swiglu_limits_shared": [0.0] * (n - 1) + [shared]}


MODELS = {
    "qwen3": HFModelSpec(
        "qwen3", "qwen3-30b-a3b", 8,
        dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
    ),
    "mixtral": HFModelSpec(
        "mixtral", "mixtral-8x7b", 2,
        dict(hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
    ),
    "gpt-oss-20b": HFModelSpec(
        "gpt-oss-20b", "gpt-oss-20b", 4,
        dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=8),
    ),
    "deepseek-v3": HFModelSpec(
        "deepseek-v3", "deepseek-v3", 2,
        dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
             num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256),
        dict(first_k_dense_replace=0),  # every decoder layer an MoE layer (the published model's first 3 are dense)
    ),
    "deepseek-v4": HFModelSpec(
        "deepseek-v4", None, 2,
        dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
             num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=4,
             index_head_dim=16, index_topk=8, sliding_window=8,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
             swiglu_limit=TINY_CLAMP, vocab_size=256),
        dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
             n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
             num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, o_groups=8,
             o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4),
        model_type="deepseek_v4", layer_fields=_v4_layers,
    ),
    "step-3.7": HFModelSpec(
        "step-3.7", None, 4,
        dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, share_expert_dim=32,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, vocab_size=256),
        # sliding_window: read by the mask code whatever the layer types (all full attention here)
        dict(hidden_size=4096, moe_intermediate_size=1280, n_routed_experts=288, num_experts_per_tok=8,
             share_expert_dim=1280, num_attention_heads=64, num_key_value_heads=8, head_dim=128, sliding_window=512),
        model_type="step3p7", layer_fields=_step_layers, vision=dict(hidden_size=32, num_hidden_layers=1,
                                                                     num_attention_heads=2),
    ),
}


def model_names() -> list[str]:
    return list(MODELS)


def model_type(name: str) -> str:
    """transformers' model type of model ``name``."""
    spec = MODELS[name]
    return spec.model_type or hf_config_of_preset(spec.preset)["model_type"]


def missing_family(name: str) -> str | None:
    """Why the installed transformers cannot build model ``name`` (it lacks its model type), else None."""
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type(name) in CONFIG_MAPPING:
        return None
    return (f"hf-model {name} needs transformers' {model_type(name)!r} models, which the installed transformers "
            f"{transformers.__version__} does not have")


def available_models() -> list[str]:
    """The models the installed transformers can build (``--hf-model all``)."""
    return [name for name in MODELS if missing_family(name) is None]


def hf_config(name: str, layers: int, tiny: bool = False):
    """The transformers config object of model ``name`` with ``layers`` decoder layers; ValueError where the name is
    unknown or the installed transformers lacks its family."""
    from transformers import AutoConfig

    if name not in MODELS:
        raise ValueError(f"model must be one of {model_names()}, got {name!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if missing_family(name):
        raise ValueError(missing_family(name))
    spec = MODELS[name]
    fields = hf_config_of_preset(spec.preset) if spec.preset else {"model_type": spec.model_type}
    kind = fields.pop("model_type")
    fields.update(spec.fields)
    fields.update(num_hidden_layers=layers, vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0)  # no EOS: every generate call runs its full number of new tokens
    if tiny:
        fields.update(spec.tiny)
    if spec.layer_fields is not None:
        fields.update(spec.layer_fields(layers, tiny))
    if spec.vision is not None:
        return AutoConfig.for_model(kind, text_config=fields, vision_config=dict(spec.vision))
    return AutoConfig.for_model(kind, **fields)


def text_config(config):
    """The config of ``config``'s language model: itself, or an image-text model's ``text_config``."""
    return config.get_text_config()


def build_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A causal LM from ``config`` (an image-text model's generating class where the config is one) with random
    weights, made directly on ``device`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForCausalLM if text_config(config) is config else AutoModelForImageTextToText
    torch.manual_seed(seed)
    with torch.device(device):
        model = auto.from_config(config, dtype=dtype)
    _draw_correction_biases(model, seed)
    _draw_hash_tables(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _draw_correction_biases(model, seed: int) -> None:
    """Every router's ``e_score_correction_bias`` (DeepSeek-V3's selection-only bias; zeros at init) drawn
    N(0, ``CORRECTION_BIAS_STD``²), so the rows route with it as a trained model does: an implementation that
    dropped it, or weighted the experts by the biased scores, would differ from eager."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * CORRECTION_BIAS_STD)


def _draw_hash_tables(model, seed: int) -> None:
    """Every hash router's ``tid2eid`` [V, k] (DeepSeek-V4's token-id table; zeros at init: every token on expert 0)
    drawn: each token's k experts distinct and uniform, as a trained table spreads them."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.get_submodule(name.rsplit(".", 1)[0]).num_experts
            order = torch.rand(buf.shape[0], experts, generator=g).argsort(-1)  # [V, E] a permutation a token
            buf.copy_(order[:, :buf.shape[1]])


def experts_implementations(quant: str | None = None) -> list[str]:
    """Every experts implementation transformers knows in this process, the reference first; with ``quant``
    "fp8", those of its fp8 experts (``hf_quant.fp8_implementations``; a weight-only ``quant`` leaves the
    experts float: ``hf_wo``)."""
    import moekit.hf  # noqa: F401  (registers "moekit")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from moekit.bench.hf_quant import fp8_implementations

    names = set(fp8_implementations() if quant == "fp8" else ALL_EXPERTS_FUNCTIONS.valid_keys()) | {REFERENCE_IMPL}
    rank = {n: i for i, n in enumerate(_IMPL_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def _no_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    # [T, H]: the experts' sum, skipped. It reads the routing weights (times 0.0): a result that ignored
    # them let torch.compile drop the router itself (gate GEMM, softmax, top-k) from the ceiling. A float
    # zero: inductor's constant folder replaces a multiply by the int 0 with zeros (a joint-graph peephole),
    # which dropped the router all the same (torch 2.13, benchmarks/triton-notes.md "session 35 ... prof35").
    return (top_k_weights.sum(-1, keepdim=True) * 0.0).to(hidden_states.dtype).expand(hidden_states.shape)


def register_no_experts() -> None:
    """Register ``NO_EXPERTS_IMPL`` with transformers' experts interfaces, the fp8 one too (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NO_EXPERTS_IMPL, _no_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(NO_EXPERTS_IMPL, _no_experts_forward)


def select_impls(requested: list[str] | None, quant: str | None = None,
                 device: torch.device | None = None) -> list[str]:
    """``requested`` (default: every registered one but ``NO_EXPERTS_IMPL`` and ``BLOCKS_IMPL``, which run only
    when named, and, on a ``device`` other than CUDA, ``hf_quant.CUDA_ONLY_IMPLS``) in the registry's order
    (``BLOCKS_IMPL`` after "moekit"), the reference always included first;
    with ``quant`` "fp8", among the implementations of transformers' fp8 experts; with a ``quant`` of moekit's
    blocks (``hf_wo.BLOCK_QUANTS``), ``QUANT_BLOCKS_IMPL`` always included after ``BLOCKS_IMPL`` (default: those two and
    ``NO_EXPERTS_IMPL``, the rows its ratios need)."""
    from moekit.bench.hf_quant import CUDA_ONLY_IMPLS

    blocks = quant in BLOCK_QUANTS
    if blocks:
        requested = list(requested or (BLOCKS_IMPL, NO_EXPERTS_IMPL)) + [QUANT_BLOCKS_IMPL]
    elif QUANT_BLOCKS_IMPL in (requested or ()):
        raise ValueError(f"hf-impls {QUANT_BLOCKS_IMPL} runs with hf-quant one of {BLOCK_QUANTS}, "
                         f"got hf-quant {quant!r}")
    if requested and NO_EXPERTS_IMPL in requested:
        register_no_experts()
    known = experts_implementations(quant)
    named_only = [NO_EXPERTS_IMPL, BLOCKS_IMPL] + [QUANT_BLOCKS_IMPL] * blocks
    unknown = sorted(set(requested or ()) - set(known) - set(named_only))
    if unknown:
        raise ValueError(f"hf-impls must be among {known + named_only}, got unknown {unknown}")
    off_cuda = set(CUDA_ONLY_IMPLS) if device is not None and device.type != "cuda" else set()
    wanted = set(requested or set(known) - {NO_EXPERTS_IMPL} - off_cuda) | {REFERENCE_IMPL}
    at = known.index("moekit") + 1
    order = known[:at] + [BLOCKS_IMPL, QUANT_BLOCKS_IMPL] + known[at:]
    return [n for n in order if n in wanted]


def use_impl(model, impl: str, quant: str | None = None, quant_options: tuple = ()) -> None:
    """Run ``model`` with ``impl``: an experts implementation, ``BLOCKS_IMPL`` or ``QUANT_BLOCKS_IMPL`` (the blocks
    swapped once, their experts quantized with ``quant`` and ``quant_options`` for the latter, then put in place or
    switched off without rebuilding anything: ``hf_wo.use_blocks``, so a compiled graph meets the same modules every
    pass)."""
    from moekit.hf.swap import set_blocks_active

    if impl in (BLOCKS_IMPL, QUANT_BLOCKS_IMPL):
        model.set_experts_implementation("moekit")  # for a block the swap leaves
        if impl == QUANT_BLOCKS_IMPL:
            use_blocks(model, quant, quant_options)
        else:
            use_blocks(model, None)
    else:
        set_blocks_active(model, False)
        model.set_experts_implementation(impl)


def not_run(model, impl: str, quant: str | None, device: torch.device, compiled: bool) -> str | None:
    """Why ``impl`` is not attempted on ``model`` (``compiled``: in the compiled decode), else None: the device's
    (``hf_quant.unavailable``); a compiled decode where generate's static cache has no layer for one of the model's
    (``static_cache_gap``); an experts implementation where no experts module of the model is dispatched through
    transformers' experts interface (Step-3.7's under transformers 5.17: set_experts_implementation changes nothing
    there, and the row would time the model's own loop under another name)."""
    from moekit.bench.hf_quant import unavailable
    from moekit.hf.set_check import is_interface_experts

    reason = unavailable(impl, quant, device)
    if reason is None and compiled:
        reason = static_cache_gap(model)
    own = (REFERENCE_IMPL, BLOCKS_IMPL, QUANT_BLOCKS_IMPL)  # the model's loop, and rows that swap the blocks
    if reason is None and impl not in own and not any(is_interface_experts(m) for m in model.modules()):
        reason = (f"Skipped: no experts module of {type(model).__name__} runs through transformers' experts "
                  f"interface in this transformers: {impl} would run the model's own loop; not attempted")
    return reason


def static_cache_gap(model) -> str | None:
    """Why generate's static cache (the compiled decode's) cannot hold ``model``'s layers, else None: DeepSeek-V4's
    compressed attention keeps its state in cache layers of its own, which ``StaticCache`` has no kind of."""
    from transformers import StaticCache

    try:
        StaticCache(config=model.config, max_cache_len=1)
    except KeyError as err:
        return (f"Skipped: transformers' static cache (the compiled decode's) has no layer of type {err}, which "
                f"{type(model).__name__} uses; not attempted")
    return None


def gathered_weight_bytes(impl: str, config, num_tokens: int, element_size: int) -> int:
    """Bytes of expert weights ``impl`` copies for one forward over ``num_tokens`` tokens: ``batched_mm``
    gathers a full expert (3·N·K) for every (token, slot) pair; the others read the weights in place."""
    if impl != "batched_mm":
        return 0
    moe = MoEConfig.from_hf_config(config, layer="typical")
    return num_tokens * moe.top_k * 3 * moe.moe_intermediate_size * moe.hidden_size * element_size


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU); a large number where the OS says nothing."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 50
