"""A tuned entry adds or replaces its own M and nothing else (``moekit.bench.tuning_merge``): ``moekit tune``'s save
keeps the file's other entries as they were, switches and all; the lookups (bf16 ``get_config``, fp8 ``fp8_entry``,
weight-only ``wo_config``) overlay a user file's M over the packaged file's; ``--install`` merges per M and says which
M it added and replaced, and which replaced entries had switches. No kernel runs: the search is stubbed (it needs a
GPU), the fp8 weights it makes are the tiny shape's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from _helpers import cli_error  # noqa: E402
from moekit.bench import tuning  # noqa: E402
from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts import configs  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig, clear_config_cache, get_config  # noqa: E402
from moekit.experts.triton_fp8_persistent import Persistent  # noqa: E402
from moekit.experts.triton_fp8_plan import Fp8Entry, fp8_entry, read_entries  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)
FP8_NAME = "E8_N24_K40_fp8_block_cpu.json"  # TINY's fp8 file on the CPU
# fp8 tiles (BLOCK_K the scale group, 128): a decode one, a prefill one, and what the stubbed search "finds"
PLAIN = KernelConfig(16, GemmTile(128, 128, 1, 4, 3), GemmTile(128, 128, 1, 4, 3))
TALL = KernelConfig(64, GemmTile(128, 128, 8, 8, 4), GemmTile(128, 128, 8, 4, 4))
TUNED = KernelConfig(16, GemmTile(32, 128, 1, 4, 5), GemmTile(64, 128, 1, 4, 4))
# M -> an entry with switches, as the packaged fp8 files hold them (E128_N768_K2048_fp8_block_NVIDIA_H200.json)
SWITCHED = {
    "1": {**PLAIN.to_dict(), "weight_tma": True, "x_in_gate_up": True, "swap_ab": True},
    "64": {**PLAIN.to_dict(), "weight_tma": True, "pair_dot": True},
    "4096": {**TALL.to_dict(), "weight_tma": False, "persistent": {"up_per_sm": 1, "down_per_sm": 2}},
}
MEASURED = {m: {"us": 10.0 + int(m), "heuristic_us": 20.0 + int(m)} for m in SWITCHED}
# What the fp8 plan must read of SWITCHED's 1 and 4096, written out here
ENTRY_1 = Fp8Entry(replace(PLAIN, swap_ab=True), weight_tma=True, x_in_gate_up=True)
ENTRY_4096 = Fp8Entry(TALL, weight_tma=False, persistent=Persistent(1, 2))


def fp8_file(entries: dict, measured: dict | None = None, device: str = "cpu", shape: Shape = TINY) -> str:
    body = {"E": shape.num_experts, "N": shape.n, "K": shape.k, "dtype": "fp8_block", "device": device,
            "configs": entries}
    return json.dumps({**body, "measured": measured} if measured else body, indent=1) + "\n"


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """An empty user config directory searched first, a packaged directory of the test's own (the real one holds
    no CPU file), the lookups' caches cleared around the test, and the search stubbed to find TUNED."""
    user, packaged = tmp_path / "user", tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(user))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(configs, "PACKAGED_DIR", packaged)
    monkeypatch.setattr(tuning, "PACKAGED_DIR", packaged)
    monkeypatch.setattr(tuning, "tune_one",
                        lambda shape, m, scheme, device, weights: tuning.TuneResult(TUNED, 5.0, 9.0))
    clear_config_cache()
    yield user, packaged
    clear_config_cache()


def tiny_fp8(m: int) -> Fp8Entry:
    return fp8_entry(m, TINY.num_experts, TINY.n, TINY.k, TINY.top_k, 128, "cpu")


@pytest.mark.parametrize("where", ["user", "packaged"])
def test_tuning_one_m_leaves_the_others_switches(dirs, where):
    """Retuning M = 64 of a user file (``--batches 64``), or tuning it into a fresh user directory over a packaged
    file: the entries of 1 and 4096 keep their switches, in the file and in the fp8 plan's lookup; 64 becomes the
    tuned plain entry, and the note says which switches it has not."""
    user, packaged = dirs
    old_dir = user if where == "user" else packaged
    old_dir.mkdir(exist_ok=True)
    (old_dir / FP8_NAME).write_text(fp8_file(SWITCHED, MEASURED))
    assert tiny_fp8(64) == Fp8Entry(PLAIN, weight_tma=True, pair_dot=True)  # cached: the save must clear it
    notes = []
    path = tuning.tune(TINY, [64], "fp8_block", device="cpu", note=notes.append)
    assert path == user / FP8_NAME
    assert [tiny_fp8(m) for m in (1, 2, 64, 90, 2048, 4096)] == [ENTRY_1, ENTRY_1, Fp8Entry(TUNED), Fp8Entry(TUNED),
                                                                  ENTRY_4096, ENTRY_4096]
    assert len(notes) == 1 and notes[0].startswith("M=64: replaces an entry with weight_tma/pair_dot;"), notes
    data = json.loads(path.read_text())
    if where == "user":  # the other entries and their records as they were
        assert data["configs"] == {"1": SWITCHED["1"], "64": TUNED.to_dict(), "4096": SWITCHED["4096"]}
        assert data["measured"] == {**MEASURED, "64": {"us": 5.0, "heuristic_us": 9.0}}
    else:  # the user file holds the tuned M alone; the packaged file is untouched
        assert data["configs"] == {"64": TUNED.to_dict()}
        assert (packaged / FP8_NAME).read_text() == fp8_file(SWITCHED, MEASURED)


def test_tuning_a_plain_entry_says_nothing(dirs):
    user, packaged = dirs
    (packaged / FP8_NAME).write_text(fp8_file({"64": TALL.to_dict()}))
    notes = []
    tuning.tune(TINY, [64, 512], "fp8_block", device="cpu", note=notes.append)
    assert notes == []


@pytest.fixture
def user(tmp_path, monkeypatch):
    """An empty user config directory searched first, beside the real packaged files."""
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "user").mkdir()
    yield tmp_path / "user"
    clear_config_cache()


def user_file_over(name: str, m: int, entry: KernelConfig, user) -> dict:
    """A user file holding ``entry`` at M = ``m`` alone, named as the packaged file ``name``; returns the packaged
    file's JSON."""
    shipped = json.loads((configs.PACKAGED_DIR / name).read_text())
    (user / name).write_text(json.dumps({**shipped, "configs": {str(m): entry.to_dict()}, "measured": {}}))
    clear_config_cache()
    return shipped


USER_BF16 = KernelConfig(32, GemmTile(64, 32, 4, 2, 2), GemmTile(32, 32, 4, 2, 2))  # no packaged entry's tiles


def test_bf16_user_file_changes_only_the_m_near_its_own(user):
    name = "E128_N768_K2048_bfloat16_NVIDIA_H200.json"
    shipped = user_file_over(name, 128, USER_BF16, user)
    assert {"1", "4096"} <= shipped["configs"].keys()

    def lookup(m):
        return get_config(m, 128, 768, 2048, 8, torch.bfloat16, "NVIDIA_H200")

    assert lookup(128) == lookup(100) == USER_BF16
    for m in (1, 4096):
        assert lookup(m) == KernelConfig.from_dict(shipped["configs"][str(m)]), m


def test_fp8_user_file_changes_only_the_m_near_its_own(user):
    name = "E128_N768_K2048_fp8_block_NVIDIA_H200.json"
    shipped = user_file_over(name, 128, TUNED, user)
    assert {"1", "4096"} <= shipped["configs"].keys()
    packaged = read_entries(configs.PACKAGED_DIR / name)  # the packaged file alone, switches and all

    def lookup(m):
        return fp8_entry(m, 128, 768, 2048, 8, 128, "NVIDIA_H200")

    assert lookup(128) == lookup(100) == Fp8Entry(TUNED)
    for m in (1, 4096):
        assert lookup(m) == packaged[m], m


def test_weight_only_user_file_changes_only_the_m_near_its_own(user):
    """The mma decode's mxfp4 file of DeepSeek-V3's shape (M = 1, 8, 64 shipped; no measured row of
    ``MMA_CONFIGS`` below M = 512 there, and M = 1's gate-up split of ``MMA_UP_SPLITS`` on top of the tiles)."""
    name = "E256_N2048_K7168_mxfp4_mma_NVIDIA_H200.json"
    tile = GemmTile(64, 128, 1, 2, 3)
    mine = KernelConfig(16, tile, tile)
    shipped = user_file_over(name, 128, mine, user)
    assert {"1", "8"} <= shipped["configs"].keys()

    def lookup(m):
        return wo_config(m, 256, 2048, 7168, 8, "mxfp4", "NVIDIA_H200", decode="mma")

    assert lookup(128) == lookup(100) == mine
    for m in (1, 8):
        got, packaged = lookup(m), KernelConfig.from_dict(shipped["configs"][str(m)])
        assert (got.BLOCK_M, got.up, got.down) == (packaged.BLOCK_M, packaged.up, packaged.down), m


def test_weight_only_tile_file_leaves_the_winners_rows_at_other_m(user):
    """The tile decode's measured rows (``triton_wo_winners``) count as entries under a tuned file's: a user file
    tuned at M = 128 alone leaves Qwen3 int4's M = 1024 row in charge at 1024 (it took every M before)."""
    from moekit.experts.triton_wo_winners import winner

    name = "E128_N768_K2048_int4_w4a16_NVIDIA_H200.json"
    tile = GemmTile(32, 64, 1, 4, 2)
    mine = KernelConfig(32, tile, tile)
    (user / name).write_text(json.dumps({"E": 128, "N": 768, "K": 2048, "dtype": "int4_w4a16",
                                         "device": "NVIDIA_H200", "configs": {"128": mine.to_dict()}}))
    clear_config_cache()

    def lookup(m):
        return wo_config(m, 128, 768, 2048, 8, "int4_w4a16", "NVIDIA_H200")

    row = winner("int4_w4a16", 128, 768, 2048, 1024).tile
    assert row is not None and row != mine
    assert lookup(128) == lookup(100) == mine
    assert lookup(1024) == lookup(900) == row


def test_install_merges_per_m_and_says_so(dirs, tmp_path, capsys):
    """``moekit tune --install`` of a file tuned at M = 64 and 128 into a packaged file of 1, 64, 4096: 64 replaced
    (its switches named), 128 added, 1 and 4096 and their records as they were."""
    from moekit.cli import main

    _, packaged = dirs
    (packaged / FP8_NAME).write_text(fp8_file(SWITCHED, MEASURED))
    tuned = tmp_path / "fetched" / FP8_NAME
    tuned.parent.mkdir()
    tuned_measured = {"64": {"us": 1.0, "heuristic_us": 2.0}, "128": {"us": 3.0, "heuristic_us": 4.0}}
    tuned.write_text(fp8_file({"64": TUNED.to_dict(), "128": TALL.to_dict()}, tuned_measured))
    assert main(["tune", "--install", str(tuned)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0] == f"{FP8_NAME}: added M=128; replaced M=64", out
    assert out[1].startswith("M=64: replaces an entry with weight_tma/pair_dot;"), out
    assert out[2] == f"installed {packaged / FP8_NAME}"
    data = json.loads((packaged / FP8_NAME).read_text())
    assert data["configs"] == {"1": SWITCHED["1"], "64": TUNED.to_dict(), "128": TALL.to_dict(),
                               "4096": SWITCHED["4096"]}
    assert data["measured"] == {**MEASURED, **tuned_measured}
    assert [tiny_fp8(m) for m in (1, 64, 128, 4096)] == [ENTRY_1, Fp8Entry(TUNED), Fp8Entry(TALL), ENTRY_4096]


def test_install_into_no_file_writes_the_tuned_one(dirs, tmp_path):
    _, packaged = dirs
    tuned = tmp_path / FP8_NAME
    tuned.write_text(fp8_file({"64": TUNED.to_dict()}, {"64": {"us": 1.0, "heuristic_us": 2.0}}))
    notes = []
    assert tuning.install(tuned, note=notes.append).read_text() == tuned.read_text()
    assert notes == [f"{FP8_NAME}: added M=64"]


def test_install_refuses_a_packaged_file_of_another_shape(dirs, tmp_path, capsys):
    """A packaged file whose fields disagree with its name (edited by hand): refused naming the field, unchanged."""
    _, packaged = dirs
    wrong = fp8_file(SWITCHED, shape=Shape("other", 8, 24, 48, 2))
    (packaged / FP8_NAME).write_text(wrong)
    tuned = tmp_path / FP8_NAME
    tuned.write_text(fp8_file({"64": TUNED.to_dict()}))
    error = cli_error(capsys, ["tune", "--install", str(tuned)])
    assert f"--install: {packaged / FP8_NAME} holds K=48; the tuned entries are for K=40" in error
    assert (packaged / FP8_NAME).read_text() == wrong
