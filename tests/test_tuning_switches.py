"""``moekit tune --dtype fp8_block`` searches the fp8 entries' switches (``moekit.bench.tuning_switches``): each
switch candidate is one the fp8 plan builds with real tensors, with the launches it names (TMA descriptors,
PAIR_DOT, the persistent kernels); the search starts from today's entry, switches and all; a tuned entry with
switches is written so that the plan's lookup reads them back; the timed call hands them to the launch. No kernel
runs: the timer is stubbed (timing needs the GPU), plans are built on the CPU."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

pytest.importorskip("triton")

from moekit.bench import tuning, tuning_quant, tuning_switches  # noqa: E402
from moekit.bench.cells import Shape, make_sets  # noqa: E402
from moekit.bench.tuning_switches import Fp8Candidate, Switches, switch_variants, with_switches  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_persistent import OFF, Persistent  # noqa: E402
from moekit.experts.triton_fp8_plan import Fp8Entry, build_plan, fp8_entry  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

# K and N multiples of 16 (TMA rows) and N of the 128-wide scale block (PAIR_DOT's one block a tile)
SMALL = Shape("small", num_experts=4, n=128, k=256, top_k=2)
CPU = torch.device("cpu")
DECODE = KernelConfig(16, GemmTile(128, 128, 1, 4, 4), GemmTile(128, 128, 1, 4, 4))
MID = KernelConfig(32, GemmTile(128, 128, 8, 8, 4), GemmTile(128, 128, 8, 4, 4))
NARROW = KernelConfig(32, GemmTile(64, 128, 8, 4, 4), GemmTile(128, 128, 8, 4, 4))  # h float32: no persistent


def real_plan(m: int, config: KernelConfig, **switches):
    """The fp8 plan of a call of SMALL at M = m on real CPU tensors (zeros), switches asked by name."""
    e, n, k = SMALL.num_experts, SMALL.n, SMALL.k
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(e, 2 * n, k).to(torch.float8_e4m3fn), torch.zeros(e, k, n).to(torch.float8_e4m3fn)
    s13, s2 = torch.ones(e, 2 * n // 128, k // 128), torch.ones(e, k // 128, n // 128)
    ids = torch.arange(m * SMALL.top_k, dtype=torch.int32).remainder(e).reshape(m, SMALL.top_k)
    return build_plan(x, w13, s13, w2, s2, ids, None, (128, 128), config, LaunchOptions(), **switches)


def kernel_name(launch) -> str:
    return launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else launch.kernel.__name__


@pytest.mark.parametrize("m, config", [(8, DECODE), (80, DECODE), (80, MID), (80, NARROW)])
def test_every_switch_variant_builds_with_what_it_names(m, config):
    variants = switch_variants(m, SMALL, config)
    assert len(variants) == len(set(variants)) and config not in variants
    for v in variants:
        assert KernelConfig(v.BLOCK_M, v.up, v.down) == KernelConfig(config.BLOCK_M, config.up, config.down)
        s = tuning_switches.switches_of(v)
        plan = real_plan(m, tuning.tiles_of(v), weight_tma=s.weight_tma, pair_dot=s.pair_dot,
                         persistent=s.persistent)  # raises where the plan refuses what the variant asks
        assert (plan.descriptor_key is not None) == (s.weight_tma or v.BLOCK_M <= 16)
        assert (plan.descriptor_key is not None and plan.descriptor_key[0] == "pair") == s.pair_dot
        persistent = s.persistent or OFF
        assert ("persistent" in kernel_name(plan.gate_up)) == bool(persistent.up_per_sm)
        assert ("persistent" in kernel_name(plan.down)) == bool(persistent.down_per_sm)
        assert plan.config.swap_ab == v.swap_ab


@pytest.mark.parametrize("m, config", [(8, DECODE), (80, DECODE), (80, MID), (80, NARROW)])
def test_no_combination_the_plan_takes_is_left_out(m, config):
    """Every combination of the switches that the real plan builds without refusing, and that launches something
    other than ``config`` alone, is a variant (TMA asked only where the plan's rule would load through pointers)."""
    variants = set(switch_variants(m, SMALL, config))
    rule_tma = real_plan(m, config).descriptor_key is not None
    swaps = (False, True) if config.BLOCK_M <= 16 else (config.swap_ab,)
    for tma, pair, swap, persistent in itertools.product((None, True), (False, True), swaps,
                                                         (None, *tuning_switches.PERSISTENT_CHOICES)):
        tiles = KernelConfig(config.BLOCK_M, config.up, config.down, swap)
        try:
            real_plan(m, tiles, weight_tma=tma, pair_dot=pair, persistent=persistent)
        except ValueError:
            continue
        candidate = with_switches(tiles, Switches(tma, pair, persistent))
        if candidate == config or (tma and rule_tma):
            continue
        assert candidate in variants, candidate


def test_the_switches_reach_only_where_the_plan_has_them():
    # 8 tokens x 2 slots: the alignment folds into gate-up, so no persistent GEMMs; a 64-wide gate-up tile hands h
    # over in float32, so no persistent GEMMs either
    assert not any(isinstance(v, Fp8Candidate) and v.switches.persistent for v in switch_variants(8, SMALL, DECODE))
    assert not any(isinstance(v, Fp8Candidate) and v.switches.persistent for v in switch_variants(80, SMALL, NARROW))
    mid = switch_variants(80, SMALL, MID)
    assert with_switches(MID, Switches(True, True, Persistent(1, 2))) in mid
    assert with_switches(MID, Switches(None, False, Persistent(0, 2))) in mid
    assert not any(v.swap_ab for v in mid)  # swap_ab at decode heights only
    swapped = with_switches(KernelConfig(16, DECODE.up, DECODE.down, True), Switches())
    assert swapped in switch_variants(8, SMALL, DECODE)


def test_a_candidate_writes_the_entry_the_plan_reads(tmp_path):
    candidate = with_switches(MID, Switches(True, True, Persistent(0, 2)))
    path = tmp_path / "E4_N128_K256_fp8_block_cpu.json"
    path.write_text(json.dumps({"E": 4, "N": 128, "K": 256, "dtype": "fp8_block", "device": "cpu",
                                "configs": {"80": candidate.to_dict()}}))
    from moekit.experts.triton_fp8_plan import read_entries

    assert read_entries(path) == {80: Fp8Entry(MID, weight_tma=True, pair_dot=True, persistent=Persistent(0, 2))}
    assert with_switches(candidate, Switches()) == MID and type(with_switches(candidate, Switches())) is KernelConfig


def _cost_fn(winner: KernelConfig):
    """A stubbed timer: ``winner`` 50 µs, every other candidate 100 + its BLOCK_M (a strict order by height)."""
    return lambda shape, num_tokens, scheme, device, weights: (
        lambda configs: [50.0 if c == winner else 100.0 + c.BLOCK_M for c in configs])


def test_the_tuner_finds_and_writes_a_switched_entry(user_config_dir, monkeypatch):
    winner = with_switches(MID, Switches(True, False, Persistent(1, 2)))
    assert winner in switch_variants(80, SMALL, MID)
    seen = []

    def timer(shape, num_tokens, scheme, device, weights):
        def measure(configs):
            seen.extend(configs)
            return [50.0 if c == winner else 100.0 + c.BLOCK_M for c in configs]
        return measure

    monkeypatch.setattr(tuning, "_timer", timer)
    monkeypatch.setattr(tuning_quant, "heuristic_fp8_config", lambda *a: MID)  # so the search walks MID's tiles
    path = tuning.tune(SMALL, [80], "fp8_block", device="cpu")
    data = json.loads(path.read_text())
    assert data["configs"]["80"] == winner.to_dict()
    assert data["configs"]["80"]["weight_tma"] is True and data["configs"]["80"]["persistent"] == {
        "up_per_sm": 1, "down_per_sm": 2}
    assert fp8_entry(80, 4, 128, 256, 2, 128, "cpu") == Fp8Entry(MID, weight_tma=True, persistent=Persistent(1, 2))
    assert data["measured"]["80"]["us"] == 50.0


def test_the_search_starts_from_todays_entry(user_config_dir, monkeypatch):
    """An entry with switches and tiles the candidate tables do not hold: the search times it, and where it stays the
    fastest the tuned entry is it, switches and all (no note of dropped switches), its time on record."""
    from moekit.experts.configs import clear_config_cache

    odd = KernelConfig(32, GemmTile(128, 128, 4, 8, 5), GemmTile(128, 128, 2, 8, 5))
    today = with_switches(odd, Switches(True, True, Persistent(0, 2)))
    (user_config_dir / "E4_N128_K256_fp8_block_cpu.json").write_text(json.dumps(
        {"E": 4, "N": 128, "K": 256, "dtype": "fp8_block", "device": "cpu", "configs": {"64": today.to_dict()}}))
    clear_config_cache()
    assert tuning_switches.current_fp8(80, SMALL, "cpu") == today  # entry 64 is M = 80's nearest
    monkeypatch.setattr(tuning, "_timer", _cost_fn(today))
    notes = []
    path = tuning.tune(SMALL, [80], "fp8_block", device="cpu", note=notes.append)
    data = json.loads(path.read_text())
    assert data["configs"]["80"] == today.to_dict() and notes == []
    assert data["measured"]["80"]["current_us"] == 50.0 and data["measured"]["80"]["heuristic_us"] > 100


def test_todays_entry_keeps_only_the_switches_the_plan_honours_at_m(user_config_dir):
    """Entry 16's persistent GEMMs serve M = 8 and 80 (nearest M); at 8 the alignment folds and the plan leaves them
    out: the seed is what runs at each M."""
    from moekit.experts.configs import clear_config_cache

    (user_config_dir / "E4_N128_K256_fp8_block_cpu.json").write_text(json.dumps(
        {"E": 4, "N": 128, "K": 256, "dtype": "fp8_block", "device": "cpu",
         "configs": {"16": with_switches(DECODE, Switches(None, True, Persistent(1, 2))).to_dict()}}))
    clear_config_cache()
    assert tuning_switches.current_fp8(8, SMALL, "cpu") == with_switches(DECODE, Switches(None, True, None))
    both = with_switches(DECODE, Switches(None, True, Persistent(1, 2)))
    assert tuning_switches.current_fp8(80, SMALL, "cpu") == both


def test_the_bf16_search_times_todays_entry(user_config_dir, monkeypatch):
    from moekit.experts.configs import clear_config_cache

    odd = KernelConfig(32, GemmTile(96, 64, 2, 4, 3), GemmTile(48, 64, 2, 4, 3))  # in no candidate table
    (user_config_dir / "E4_N128_K256_bfloat16_cpu.json").write_text(json.dumps(
        {"E": 4, "N": 128, "K": 256, "dtype": "bfloat16", "device": "cpu", "configs": {"80": odd.to_dict()}}))
    clear_config_cache()
    monkeypatch.setattr(tuning, "_timer", _cost_fn(odd))
    result = tuning.tune_one(SMALL, 80, tuning.scheme_for(torch.bfloat16), CPU, None)
    assert result.config == odd and result.current_us == 50.0


def test_the_timed_call_hands_the_switches_to_the_launch(monkeypatch):
    calls = []
    monkeypatch.setattr(tuning_quant, "fused_experts_fp8_launch", lambda *a, **kw: calls.append(kw))
    weights = tuning_quant.Fp8Weights(*tuning_quant._quantized("fp8_block", SMALL, CPU))
    s = make_sets(SMALL, 4, 1, torch.bfloat16, CPU)[0]
    scheme = tuning.scheme_for("fp8_block")
    scheme.call(weights, s, with_switches(MID, Switches(True, True, Persistent(1, 0))))
    scheme.call(weights, s, MID)
    picked = [{key: kw[key] for key in ("config", "weight_tma", "pair_dot", "persistent")} for kw in calls]
    assert picked == [dict(config=MID, weight_tma=True, pair_dot=True, persistent=Persistent(1, 0)),
                      dict(config=MID, weight_tma=None, pair_dot=False, persistent=None)]
    assert type(picked[0]["config"]) is KernelConfig  # the plan gets the tiles alone
