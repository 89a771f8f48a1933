"""A whole vision-language MoE model, not its text model alone: Qwen3-VL-MoE's ``ForConditionalGeneration`` built
offline (a 1-block vision tower whose deepstack features enter the MoE text tower's layers), a prompt with one 4 x 4
patch image, every MoE block of ``model.language_model`` swapped, the logits held to the unswapped model's in float32
and float64 (the hf tests' block bound: the router rounds its weights through float32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402

from _helpers import rel_l2  # noqa: E402

IMAGE, VIDEO, START, END = 60, 61, 62, 63  # token ids within the tiny vocabulary


def _model() -> torch.nn.Module:
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
                  deepstack_visual_indexes=[0], temporal_patch_size=2, spatial_merge_size=2)
    cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    model.set_experts_implementation("eager")  # transformers' own loop, the reference
    return model


@pytest.mark.parametrize("dtype, backend", [(torch.float32, "auto"), (torch.float64, "reference")])
def test_a_whole_vl_model_with_an_image_swapped_equals_its_forward(dtype, backend):
    model = _model().to(dtype)
    ids = torch.tensor([[1, 2, START, IMAGE, IMAGE, IMAGE, IMAGE, END, 5, 6, 7]])  # 16 patches merged 2 x 2: 4 tokens
    g = torch.Generator().manual_seed(1)
    inputs = dict(input_ids=ids, pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=g, dtype=dtype),
                  image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == IMAGE).long())
    with torch.no_grad():
        want = model(**inputs).logits
        report = moekit_hf.use_moekit_blocks(model, backend=backend)
        got = model(**inputs).logits
    assert [s.path for s in report.swapped] == [f"model.language_model.layers.{i}.mlp" for i in (0, 1)]
    assert not report.left
    assert rel_l2(got, want) < 1e-5
