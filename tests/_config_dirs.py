"""The config-lookup fixture of the sibling-file tests: a test module imports it,
``from _config_dirs import config_dirs  # noqa: F401  (fixture)``."""

from __future__ import annotations

import pytest

from moekit.experts import configs


@pytest.fixture
def config_dirs(tmp_path, monkeypatch) -> dict:
    """Empty user and packaged config directories ({"user": ..., "packaged": ...}), the sibling fallback switched on
    by its variable, a cold lookup cache (and cleared again after the test)."""
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MOEKIT_SIBLING_CONFIGS", "1")
    monkeypatch.setattr(configs, "PACKAGED_DIR", tmp_path / "packaged")
    configs.clear_config_cache()
    yield {"user": tmp_path / "user", "packaged": tmp_path / "packaged"}
    configs.clear_config_cache()
