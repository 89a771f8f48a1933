"""Tuned kernel configs: the lookup (user directory first, nearest M, cached in memory), the heuristic
default, the shared-memory fit. No kernels run here."""

from __future__ import annotations

import json

import pytest
import torch

from moekit.experts import configs
from moekit.experts.configs import (
    PACKAGED_DIR, GemmTile, KernelConfig, config_file_name, fit_shared_memory, get_config, heuristic_config,
    load_configs, read_configs, shared_memory_bytes, write_configs,
)

SMALL = KernelConfig(16, GemmTile(32, 128), GemmTile(64, 128))


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user config directory, searched first; no XDG directory of this machine."""
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "user"


@pytest.fixture
def disk_loads(monkeypatch) -> list:
    """A cold cache, and the file name of every search of the directories from here on."""
    loads, real = [], configs.tuned_files
    configs.clear_config_cache()
    monkeypatch.setattr(configs, "tuned_files",
                        lambda name_of, device: loads.append(name_of(device)) or real(name_of, device))
    return loads


def test_lookup_searches_the_filesystem_once_per_shape(user_dir, disk_loads):
    packaged = ("bfloat16", 128, 768, 2048, "NVIDIA_H200")  # a shipped file
    for _ in range(3):
        tuned = get_config(8, 128, 768, 2048, 8, torch.bfloat16, "NVIDIA_H200")
        missing = get_config(8, 7, 5, 3, 2, torch.bfloat16, "NVIDIA_H200")
    assert len(disk_loads) == 2, disk_loads  # one search per shape, file found or not
    assert tuned == read_configs(PACKAGED_DIR / config_file_name(*packaged[1:4], torch.bfloat16, packaged[4]))[8]
    assert missing == heuristic_config(8, 7, 5, 3, 2)


def test_other_user_dir_is_searched_again(user_dir, disk_loads, tmp_path, monkeypatch):
    assert load_configs(8, 17, 33, torch.float32, "cpu") is None
    other = tmp_path / "other"
    other.mkdir()
    (other / config_file_name(8, 17, 33, torch.float32, "cpu")).write_text(json.dumps(
        {"E": 8, "N": 17, "K": 33, "dtype": "float32", "device": "cpu", "configs": {"1": SMALL.to_dict()}}))
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(other))
    assert load_configs(8, 17, 33, torch.float32, "cpu") == {1: SMALL}
    assert len(disk_loads) == 2


def test_files_overlay_per_m(user_dir, tmp_path, monkeypatch):
    """$MOEKIT_CONFIG_DIR's file over $XDG_CONFIG_HOME's over the packaged one, M by M: each M from the first file
    that has it; the other M of every file stay."""
    packaged = tmp_path / "packaged"
    monkeypatch.setattr(configs, "PACKAGED_DIR", packaged)
    xdg = tmp_path / "xdg" / "moekit" / "configs"
    # directory -> (its down tile width, the M its file holds); an entry's gate-up tile says its M
    holdings = {user_dir: (32, (1, 2)), xdg: (64, (2, 3, 4)), packaged: (128, (4, 5))}
    for directory, (width, ms) in holdings.items():
        entries = {m: KernelConfig(16, GemmTile(16 * m, 128), GemmTile(width, 128)) for m in ms}
        write_configs(directory / config_file_name(8, 17, 33, torch.float32, "cpu"), 8, 17, 33, torch.float32,
                      "cpu", entries)
    got = load_configs(8, 17, 33, torch.float32, "cpu")
    assert {m: (c.up.BLOCK_N, c.down.BLOCK_N) for m, c in got.items()} == {
        1: (16, 32), 2: (32, 32), 3: (48, 64), 4: (64, 64), 5: (80, 128)}
    assert get_config(6, 8, 17, 33, 2, torch.float32, "cpu").down.BLOCK_N == 128  # nearest: the packaged file's 5


def test_tune_save_clears_the_cache(user_dir, disk_loads, monkeypatch):
    """A lookup before ``moekit tune`` caches "no file"; the tuner's save makes the next lookup in the
    same process find the new file (the timing itself needs a GPU: stubbed)."""
    from moekit.bench import tuning
    from moekit.bench.cells import Shape

    shape = Shape("tiny", 8, 17, 33, 2)
    assert get_config(1, 8, 17, 33, 2, torch.float32, "cpu") == heuristic_config(1, 8, 17, 33, 2)
    tuned = {1: SMALL, 64: KernelConfig(64, GemmTile(64, 64, 8), GemmTile(128, 64, 8, 8, 3))}
    monkeypatch.setattr(tuning, "tune_one", lambda shape, m, scheme, device,
                        weights: tuning.TuneResult(tuned[m], 1.0, 2.0))
    path = tuning.tune(shape, [1, 64], dtype=torch.float32, device="cpu")
    assert path.parent == user_dir and path.is_file()
    assert get_config(1, 8, 17, 33, 2, torch.float32, "cpu") == SMALL
    assert get_config(50, 8, 17, 33, 2, torch.float32, "cpu") == tuned[64]


def test_heuristic_without_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert load_configs(7, 5, 3, torch.bfloat16, "nowhere") is None
    assert get_config(1, 7, 5, 3, 2, torch.bfloat16, "nowhere") == heuristic_config(1, 7, 5, 3, 2)
    heights = [heuristic_config(m, 128, 768, 2048, 8).BLOCK_M for m in (1, 64, 512, 4096, 16384)]
    assert heights == sorted(heights) and heights[0] == 16 and heights[-1] == 128


H200_SHARED_MEMORY = 232448  # the limit Triton 3.6 reported on the H200


def test_shared_memory_fit():
    # The H200 run that found this: Triton asked for 294912 bytes (gate-up, BLOCK_M 32, tile 128x128,
    # 3 stages, fp32) and refused to launch.
    refused = KernelConfig(32, GemmTile(128, 128, 8, 8, 3), GemmTile(64, 128, 1, 4, 4))
    assert shared_memory_bytes(32, refused.up, 4, weight_tiles=2) == 294912
    fitted = fit_shared_memory(refused, 4, H200_SHARED_MEMORY)
    for tile, old, weight_tiles in ((fitted.up, refused.up, 2), (fitted.down, refused.down, 1)):
        assert shared_memory_bytes(32, tile, 4, weight_tiles) <= H200_SHARED_MEMORY
        assert (tile.BLOCK_N, tile.GROUP_M, tile.num_warps) == (old.BLOCK_N, old.GROUP_M, old.num_warps)
    assert (fitted.up.num_stages, fitted.up.BLOCK_K) == (2, 128)  # one buffered step: 147456 bytes
    assert fitted.down == refused.down  # 3 x (32*128 + 64*128) x 4 = 147456 already fits
    # With descriptors Triton buffers every stage: it asked 245848 bytes at BLOCK_M 128, 128x64, 5 stages, bf16.
    tma = KernelConfig(128, GemmTile(128, 64, 8, 8, 5), GemmTile(128, 64, 8, 8, 5))
    assert 245848 <= shared_memory_bytes(128, tma.up, 2, 2, descriptors=True) <= 245848 + 1024
    assert fit_shared_memory(tma, 2, H200_SHARED_MEMORY, descriptors=True).up.num_stages == 4
    # A tiny limit bottoms out at 2 stages and BLOCK_K 16 instead of looping forever.
    floor = fit_shared_memory(refused, 4, 1)
    assert (floor.up.num_stages, floor.up.BLOCK_K, floor.down.BLOCK_K) == (2, 16, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shipped_and_heuristic_configs_fit_16_bit(dtype):
    """Everything that ran on the H200 in bf16 fits as it is: the fit changes nothing there. (The packaged
    files of quantized paths, e.g. ``*_fp8_block_*``, have their own tiles and fits.)"""
    configs = [c for p in PACKAGED_DIR.glob("*_bfloat16_*.json") for c in read_configs(p).values()]
    configs += [heuristic_config(m, e, n, k, top_k) for m in (1, 8, 64, 512, 4096, 16384)
                for e, n, k, top_k in ((128, 768, 2048, 8), (256, 2048, 7168, 8), (8, 14336, 4096, 2))]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for config in configs:
        for descriptors in (False, True):
            assert fit_shared_memory(config, itemsize, H200_SHARED_MEMORY, descriptors=descriptors) == config


def test_packaged_configs_parse():
    for path in PACKAGED_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        dtype = getattr(torch, data["dtype"], data["dtype"])  # a torch dtype, or a quantized scheme ("fp8_block")
        assert path.name == config_file_name(data["E"], data["N"], data["K"], dtype, data["device"])
        for entry in data["configs"].values():
            KernelConfig.from_dict(entry)
