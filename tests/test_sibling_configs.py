"""Sibling config files (``configs.tuned_files``): a CUDA device with no packaged file of its own takes, under its own
user files, the files of the nearest device of its compute capability (``KNOWN_DEVICES``' order), on every path that
reads tuned files (bf16 ``get_config``, the fp8 plan's entries, the weight-only files); the switch, the cache, the
name of the file that served (``served_by``), and ``moekit tune`` writing the device's own file. The CUDA queries are
faked: no kernel runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from _config_dirs import config_dirs  # noqa: F401  (fixture)
from moekit.experts import configs
from moekit.experts.configs import (
    GemmTile, KernelConfig, config_file_name, get_config, heuristic_config, served_by, sibling_devices, write_configs,
)

H100, H200, NVL = "NVIDIA_H100_80GB_HBM3", "NVIDIA_H200", "NVIDIA_H100_NVL"
E, N, K, TOP_K = 8, 17, 33, 2  # no packaged file has this shape
DTYPE = torch.bfloat16


def _entry(m: int, width: int) -> KernelConfig:
    """An entry that says which file it came from (``width``) and its M (the gate-up tile)."""
    return KernelConfig(16, GemmTile(16 * m, 128), GemmTile(width, 128))


def _write(directory, device: str, width: int, ms) -> None:
    write_configs(directory / config_file_name(E, N, K, DTYPE, device), E, N, K, DTYPE, device,
                  {m: _entry(m, width) for m in ms})


def _name_of(device: str) -> str:
    return config_file_name(E, N, K, DTYPE, device)


@pytest.fixture
def gpu(monkeypatch) -> dict:
    """One visible CUDA device whose name and capability the test sets (``gpu["name"]``, ``gpu["capability"]``); the
    capability queries counted in ``gpu["asked"]``."""
    gpu = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "asked": 0}

    def capability(index):
        gpu["asked"] += 1
        return gpu["capability"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return gpu


def _source(m: int, device: str = H100) -> int:
    """The down tile width of the entry a lookup at M = ``m`` takes: which file served."""
    return get_config(m, E, N, K, TOP_K, DTYPE, device).down.BLOCK_N


def test_siblings_are_the_known_devices_of_the_same_capability(config_dirs, gpu):
    assert configs.device_key(torch.device("cuda")) == H100
    assert sibling_devices(H100)[:2] == [H200, NVL] and H100 not in sibling_devices(H100)
    assert all(configs.KNOWN_DEVICES[d] == (9, 0) for d in sibling_devices(H100))
    assert sibling_devices("cpu") == []
    gpu["name"], gpu["capability"] = "NVIDIA A100-SXM4-80GB", (8, 0)  # an Ampere: no known device shares its SM
    configs.clear_config_cache()
    assert sibling_devices("NVIDIA_A100-SXM4-80GB") == []
    gpu["name"], gpu["capability"] = "NVIDIA H100 Test Edition", (9, 0)  # a Hopper the table does not name
    configs.clear_config_cache()
    assert sibling_devices("NVIDIA_H100_Test_Edition")[0] == H200
    assert sibling_devices("NVIDIA_Unseen") == []  # neither visible nor in the table: capability unknown


def test_the_nearest_sibling_with_files_serves(config_dirs, gpu):
    _write(config_dirs["packaged"], H200, 64, (1, 64))
    _write(config_dirs["packaged"], NVL, 32, (1, 64))
    assert _source(1) == _source(100) == 64  # the H200 first in KNOWN_DEVICES
    assert served_by(1, _name_of, H100) == "NVIDIA_H200 (sibling)"
    (config_dirs["packaged"] / _name_of(H200)).unlink()
    configs.clear_config_cache()
    assert _source(1) == 32 and served_by(1, _name_of, H100) == "NVIDIA_H100_NVL (sibling)"
    gpu["name"], gpu["capability"] = "NVIDIA A100-SXM4-80GB", (8, 0)
    configs.clear_config_cache()
    assert get_config(1, E, N, K, TOP_K, DTYPE, "NVIDIA_A100-SXM4-80GB") == heuristic_config(1, E, N, K, TOP_K)
    assert served_by(1, _name_of, "NVIDIA_A100-SXM4-80GB") == "heuristic"


def test_precedence_own_user_then_sibling_user_then_sibling_packaged(config_dirs, gpu):
    """Per M: the device's own user file over the sibling's user file over the sibling's packaged file; the nearest
    M of them all."""
    _write(config_dirs["user"], H100, 16, (1, 2))
    _write(config_dirs["user"], H200, 32, (2, 3))
    _write(config_dirs["packaged"], H200, 64, (3, 4))
    assert [_source(m) for m in (1, 2, 3, 4, 4096)] == [16, 16, 32, 64, 64]
    assert [get_config(m, E, N, K, TOP_K, DTYPE, H100).up.BLOCK_N for m in (1, 2, 3, 4)] == [16, 32, 48, 64]
    assert [served_by(m, _name_of, H100) for m in (1, 2, 3, 4096)] == [
        H100, H100, "NVIDIA_H200 (sibling)", "NVIDIA_H200 (sibling)"]


def test_a_packaged_file_of_the_device_own_keeps_the_sibling_out(config_dirs, gpu):
    """A device with a packaged file of its own reads its own files only (a sibling's M never slips between them),
    the user's over the packaged per M."""
    _write(config_dirs["user"], H100, 16, (1,))
    _write(config_dirs["packaged"], H100, 128, (64,))
    _write(config_dirs["packaged"], H200, 64, (2, 4096))
    assert [_source(m) for m in (1, 2, 64, 4096)] == [16, 16, 128, 128]
    assert served_by(4096, _name_of, H100) == H100


def test_the_switch(config_dirs, gpu, monkeypatch):
    """$MOEKIT_SIBLING_CONFIGS=0: the heuristic (read at a shape's first lookup: a change takes the cache cleared);
    unset: ``SIBLING_CONFIGS`` decides; anything but 0 / 1: an error naming the variable."""
    _write(config_dirs["packaged"], H200, 64, (1,))
    heuristic = heuristic_config(1, E, N, K, TOP_K)
    assert _source(1) == 64
    monkeypatch.setenv("MOEKIT_SIBLING_CONFIGS", "0")
    assert _source(1) == 64  # cached as it was looked up
    configs.clear_config_cache()
    assert get_config(1, E, N, K, TOP_K, DTYPE, H100) == heuristic
    assert served_by(1, _name_of, H100) == "heuristic"
    monkeypatch.delenv("MOEKIT_SIBLING_CONFIGS")
    for default in (False, True):
        monkeypatch.setattr(configs, "SIBLING_CONFIGS", default)
        configs.clear_config_cache()
        took_heuristic = get_config(1, E, N, K, TOP_K, DTYPE, H100) == heuristic
        assert (_source(1) == 64) is default and took_heuristic is not default
    monkeypatch.setenv("MOEKIT_SIBLING_CONFIGS", "yes")
    configs.clear_config_cache()
    with pytest.raises(ValueError, match="MOEKIT_SIBLING_CONFIGS must be 1 .* or 0"):
        get_config(1, E, N, K, TOP_K, DTYPE, H100)


def test_the_lookup_is_cached(config_dirs, gpu, monkeypatch):
    """One search of the directories per shape and one capability query per device, however many lookups."""
    _write(config_dirs["packaged"], H200, 64, (1, 64))
    searches, real = [], configs.tuned_files
    monkeypatch.setattr(configs, "tuned_files",
                        lambda name_of, device: searches.append(device) or real(name_of, device))
    for m in (1, 2, 64, 1, 2, 64):
        get_config(m, E, N, K, TOP_K, DTYPE, H100)
        get_config(m, E, N, 2 * K, TOP_K, DTYPE, H100)  # a shape with no file anywhere
    assert searches == [H100, H100] and gpu["asked"] == 1


def test_the_fp8_plan_takes_the_sibling_entries_with_their_switches(config_dirs, gpu):
    from moekit.experts.triton_fp8_plan import config_file_name as fp8_name
    from moekit.experts.triton_fp8_plan import fp8_entry, heuristic_fp8_config

    tuned = KernelConfig(16, GemmTile(128, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 3))
    data = {"E": E, "N": N, "K": K, "dtype": "fp8_block", "device": H200,
            "configs": {"1": {**tuned.to_dict(), "weight_tma": False, "pair_dot": True}}}
    config_dirs["packaged"].mkdir(parents=True)
    (config_dirs["packaged"] / fp8_name(E, N, K, H200)).write_text(json.dumps(data))
    entry = fp8_entry(1, E, N, K, TOP_K, 128, H100)
    assert (entry.config, entry.weight_tma, entry.pair_dot) == (tuned, False, True)
    assert served_by(1, lambda dev: fp8_name(E, N, K, dev), H100) == "NVIDIA_H200 (sibling)"
    assert fp8_entry(1, E, N, K, TOP_K, 128, "cpu").config == heuristic_fp8_config(1, E, N, K, TOP_K, 128)


def test_the_weight_only_files_take_the_sibling(config_dirs, gpu):
    from moekit.experts.triton_wo_configs import config_name, wo_config, wo_heuristic_config

    tile = GemmTile(32, 128, 1, 1, 3)
    name = config_name("int8_w8a16", "mma")
    write_configs(config_dirs["packaged"] / config_file_name(E, N, K, name, H200), E, N, K, name, H200,
                  {1: KernelConfig(16, tile, GemmTile(64, 128, 1, 2, 3))})
    assert wo_config(1, E, N, K, TOP_K, "int8_w8a16", H100, "mma").down.BLOCK_N == 64
    assert wo_config(1, E, N, K, TOP_K, "int8_w8a16", "cpu", "mma") == wo_heuristic_config(
        1, E, N, K, TOP_K, "int8_w8a16", "mma")


def test_tune_writes_the_device_own_file(config_dirs, gpu, monkeypatch):
    """With the sibling's files read, ``moekit tune`` still writes the device's own file, and its M then win."""
    from moekit.bench import tuning
    from moekit.bench.cells import Shape

    _write(config_dirs["packaged"], H200, 64, (1, 256))
    mine = KernelConfig(32, GemmTile(64, 64, 8), GemmTile(128, 64, 8, 8, 3))
    real_scheme = tuning.scheme_for
    monkeypatch.setattr(tuning, "scheme_for", lambda dtype: replace(real_scheme(dtype), make_weights=lambda s, d: None))
    monkeypatch.setattr(tuning, "tune_one", lambda shape, m, scheme, device, weights: tuning.TuneResult(mine, 1.0, 2.0))
    path = tuning.tune(Shape("tiny", E, N, K, TOP_K), [256], dtype=DTYPE, device="cuda")
    assert path == config_dirs["user"] / _name_of(H100)
    assert get_config(256, E, N, K, TOP_K, DTYPE, H100) == mine and _source(1) == 64
    assert served_by(256, _name_of, H100) == H100 and served_by(1, _name_of, H100) == "NVIDIA_H200 (sibling)"


def test_tune_show_names_the_file_per_m(config_dirs, gpu, capsys):
    from moekit.cli import main

    _write(config_dirs["packaged"], H200, 64, (1, 64))
    _write(config_dirs["user"], H100, 16, (4096,))
    assert main(["tune", "--show", "--shape", f"{E},{N},{K},{TOP_K}", "--batches", "1,64,4096"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"E{E}_N{N}_K{K}_k{TOP_K} bfloat16 on {H100}: M=1,64: NVIDIA_H200 (sibling); M=4096: {H100}")
    assert main(["tune", "--show", "--shape", f"{E},{N},{K},{TOP_K}", "--dtype", "fp8_block", "--batches", "8"]) == 0
    assert capsys.readouterr().out.strip().endswith("fp8_block on NVIDIA_H100_80GB_HBM3: M=8: heuristic")


def test_tune_show_on_a_cpu_says_no_tuned_config_applies(config_dirs, monkeypatch, capsys):
    """Without a CUDA GPU no M takes a tuned file or the heuristic (both are the Triton kernels', which do not run
    there: the old line said "heuristic"); --show names the path a CPU call runs, the one a layer built there runs."""
    from moekit import MoE, MoEConfig
    from moekit.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _write(config_dirs["user"], "cpu", 64, (1, 64))  # even a file keyed "cpu" configures nothing a CPU call runs
    ran = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K))._experts_fn.__name__
    for dtype, path in (("bfloat16", "the CPU experts path"), ("int4_w4a16", "the CPU quantized experts")):
        assert main(["tune", "--show", "--shape", f"{E},{N},{K},{TOP_K}", "--batches", "1,64", "--dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"E{E}_N{N}_K{K}_k{TOP_K} {dtype} on cpu: no tuned config applies") and path in out
        assert "runs grouped_mm here" in out and "grouped_mm" in ran and "M=" not in out
