"""``use_moekit_blocks`` under torch.compile: what a swapped block's compiled forward reads (its guards) and that
every change still takes effect in the compiled model (a recompile, never a stale result): weights updated in
place, Parameters replaced (``load_state_dict(assign=True)``, ``torch.func.functional_call``), the MoE's config,
``set_blocks_active`` and ``restore_blocks``. The reference is the unswapped twin (transformers' own forward) or,
for the MoE's config, the swapped model run eagerly."""

from __future__ import annotations

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.hf.swap import set_blocks_active  # noqa: E402

from _helpers import rel_l2  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402
from _swap_helpers import count_moe_calls, swaps  # noqa: E402

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))




def _swapped_and_twin(name: str = "olmoe"):
    model, _ = tiny.build(name)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    torch._dynamo.reset()
    return model, twin, torch.compile(model, backend="eager")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", ["olmoe", "gpt_oss", "glm4_moe"])  # the common layout; views; a correction bias
def test_weights_changed_in_place_or_replaced_take_effect(name):
    model, twin, compiled = _swapped_and_twin(name)
    calls = count_moe_calls(model)
    assert rel_l2(_logits(compiled), _logits(twin)) < 1e-5 and calls
    with torch.no_grad():  # an optimizer step's kind of update: the same tensors, new values
        for m in (model, twin):
            for p in m.parameters():
                p.mul_(1.25)
    before = _logits(twin)
    assert rel_l2(_logits(compiled), before) < 1e-5
    # new Parameters in place of the block's (the MoE holds the old ones): the block's own forward, not stale values
    fresh = {k: torch.randn_like(v) * 0.1 for k, v in twin.state_dict().items()}
    twin.load_state_dict(fresh)
    model.load_state_dict(fresh, assign=True)
    want = _logits(twin)
    assert rel_l2(want, before) > 0.1  # the replaced weights change the logits: the check below can fail
    calls.clear()
    assert rel_l2(_logits(compiled), want) < 1e-5 and not calls


def test_functional_call_substitution_is_seen_compiled():
    model, twin, compiled = _swapped_and_twin()
    params = {k: torch.randn_like(v) * 0.1 for k, v in twin.named_parameters()}
    with torch.no_grad():
        want = torch.func.functional_call(twin, params, (IDS,)).logits
        got = torch.func.functional_call(compiled, params, (IDS,)).logits
        plain = compiled(IDS).logits
    assert rel_l2(got, want) < 1e-5 and rel_l2(plain, _logits(twin)) < 1e-5 and rel_l2(plain, want) > 0.1


def test_a_changed_config_set_blocks_active_and_restore_take_effect():
    model, twin, compiled = _swapped_and_twin()
    calls = count_moe_calls(model)
    want = _logits(twin)
    assert rel_l2(_logits(compiled), want) < 1e-5 and calls
    for swap in swaps(model):  # a config of the MoE's own: top-1, unnormalised
        swap.moe.config = swap.moe.config.replace(top_k=1, renormalize=False)
    eager = _logits(model)
    assert rel_l2(eager, want) > 1e-3  # the MoE changed: the compiled model must follow
    assert rel_l2(_logits(compiled), eager) < 1e-5
    calls.clear()
    assert set_blocks_active(model, False) == len(swaps(model))
    for swap in swaps(model):
        swap.moe.config = swap.moe.config.replace(top_k=model.config.num_experts_per_tok, renormalize=False)
    assert rel_l2(_logits(compiled), want) < 1e-5 and not calls  # the blocks' own forward
    set_blocks_active(model, True)
    assert rel_l2(_logits(compiled), _logits(model)) < 1e-5 and calls
    calls.clear()
    assert moekit_hf.restore_blocks(model) > 0
    assert rel_l2(_logits(compiled), want) < 1e-5 and not calls


def test_a_plain_block_compiles_without_reading_its_swap_flags():
    """A block whose forward is the MoE's alone (OLMoE: no shared expert, norm or tuple) is traced through one flag
    (``BlockSwap.plain``) and ``is_bound`` on its router's and experts' Parameter dicts (``owners``: the names in the
    code); the flags ``plain`` stands for, ``own_forward_needed``'s further checks (copies, detached Parameters, a
    sampling router) and the generic ``bound`` entries give dynamo nothing to guard."""
    import torch._dynamo.guards as dynamo_guards

    model, twin, compiled = _swapped_and_twin()
    kept = []
    hook, dynamo_guards.guard_manager_testing_hook_fn = (dynamo_guards.guard_manager_testing_hook_fn,
                                                         lambda manager, scope, builder: kept.append(str(manager)))
    try:
        assert rel_l2(_logits(compiled), _logits(twin)) < 1e-5
    finally:
        dynamo_guards.guard_manager_testing_hook_fn = hook
    # the swap's attributes the guards read: "..._moekit_swap'].plain" (torch 2.13) or "..._moekit_swap.plain" (2.11)
    read = {name for text in kept for name in re.findall(r"_moekit_swap(?:'\])?\.(\w+)", text)} - {"moe", "__dict__"}
    assert {"plain", "owners"} <= read, sorted(read)
    for flag in ("shared", "output_norm", "tuple_len", "flat_with_logits", "sources", "detached", "training", "bound"):
        assert not any(r.startswith(flag) for r in read), (flag, sorted(read))


def test_traced_forward_is_forward_without_the_eager_caches():
    """``MoE.traced_forward`` (the compiled block's call) computes ``forward``'s output bit for bit, eager and compiled,
    and reads none of the caches ``forward`` consults first."""
    import torch._dynamo.guards as dynamo_guards

    model, _, _ = _swapped_and_twin()
    moe = swaps(model)[0].moe
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = moe.forward(x)
        assert torch.equal(moe.traced_forward(x), want)
        kept = []
        hook, dynamo_guards.guard_manager_testing_hook_fn = (dynamo_guards.guard_manager_testing_hook_fn,
                                                             lambda manager, scope, builder: kept.append(str(manager)))
        try:
            torch._dynamo.reset()
            assert torch.equal(torch.compile(moe.traced_forward, backend="eager")(x), want)
        finally:
            dynamo_guards.guard_manager_testing_hook_fn = hook
    text = "\n".join(kept)
    assert "_decode" not in text and "_route_ws" not in text and "eager_graphs" not in text and "_gate_inputs" in text
