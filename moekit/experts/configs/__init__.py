"""Tuned launch configurations of the Triton experts kernels, as JSON data files.

One file per (E, N, K, dtype, device), named ``E{E}_N{N}_K{K}_{dtype}_{device}.json`` (device as
``torch.cuda.get_device_name`` gives it, spaces -> ``_``), holding one entry per batch size M:

    {"E": 128, "N": 768, "K": 2048, "dtype": "bfloat16", "device": "NVIDIA_H200",
     "configs": {"1": {"BLOCK_M": 16, "up": {...}, "down": {...}}, "8": {...}, ...}}

``up``/``down`` each hold BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages. BLOCK_M is shared: both
GEMMs walk the same block-aligned layout. Optional, written only when true: "swap_ab" (``KernelConfig.swap_ab``).
A lookup takes the entry of the nearest M (in log2 distance).

Search order: ``$MOEKIT_CONFIG_DIR``, then ``$XDG_CONFIG_HOME/moekit/configs`` (default
``~/.config/moekit/configs``), where ``moekit tune`` writes, then the files shipped here. The files of one
name are overlaid per M (``overlay``): an entry of a file earlier in that order replaces the same M of the
later ones and nothing else, so a user file tuned at M = 128 alone changes the lookups near 128 (nearer 128
than any shipped M) and leaves M = 1 or 4096 on the shipped entries.

Sibling files (``tuned_files``): a CUDA device with no packaged file of its own for a shape takes, under its own
files, those of its nearest sibling that has any: a device of ``KNOWN_DEVICES`` (the names a file may carry) with the
device's compute capability (``torch.cuda.get_device_capability``), nearest = first in that table's order (the H200,
whose files are the packaged ones, first). So an H100 (sm_90, as the H200) reads, per M: its own user files, then
the H200's user files, then the H200's packaged file; a device with a packaged file of its own reads only its own.
``$MOEKIT_SIBLING_CONFIGS`` = 1 / 0 turns the fallback on / off (unset: ``SIBLING_CONFIGS``; read at a shape's first
lookup: after changing it in a running process, ``clear_config_cache()``); off, such a device gets its own user files
or the heuristic. ``served_by`` names the file a lookup takes its entry from ("NVIDIA_H200
(sibling)"), for reports. With no file, ``heuristic_config`` decides.

Lookups are cached in memory per shape (see ``_TABLES``): the filesystem is searched once per (E, N,
K, dtype, device), and the nearest entry once per M (``_LOOKUPS``). ``write_configs`` and
``write_config_data`` (what ``moekit tune`` and ``--install`` save through) clear the cache; after
editing a file by hand, or writing one from another process, call ``clear_config_cache()``. Whoever
keeps configs of its own (the Triton path's plans) registers with ``on_config_cache_clear`` to be
cleared with it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, TypeVar

import torch

from moekit._bounded import put_bounded

PACKAGED_DIR = Path(__file__).parent
Entry = TypeVar("Entry")  # what a reader makes of one file entry: a KernelConfig, an fp8 plan's Fp8Entry, a raw dict


@dataclass(frozen=True)
class GemmTile:
    """The tile of one GEMM: BLOCK_N output columns x BLOCK_K reduction per step."""

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class KernelConfig:
    """A launch configuration of the fused experts path."""

    BLOCK_M: int  # rows per block of the aligned layout; shared by both GEMMs
    up: GemmTile  # gate-up GEMM: columns tile N, reduction over K
    down: GemmTile  # down GEMM: columns tile K, reduction over N
    # The fp8 GEMMs compute the transposed product per step (``_kernels/gemm_fp8.py``, SWAP_AB): the weight tile as
    # the MMA's M side, so decode tiles of 16 rows run on Hopper's wgmma, not mma.sync with f16 conversions of every
    # weight tile. The bf16 kernels refuse it (measured no faster, session 20).
    swap_ab: bool = False

    def to_dict(self) -> dict:
        d = {"BLOCK_M": self.BLOCK_M, "up": asdict(self.up), "down": asdict(self.down)}
        if self.swap_ab:
            d["swap_ab"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        return cls(BLOCK_M=int(d["BLOCK_M"]), up=GemmTile(**d["up"]), down=GemmTile(**d["down"]),
                   swap_ab=bool(d.get("swap_ab", False)))


def device_key(device: torch.device | str | None = None) -> str:
    """The device part of a config file name: 'NVIDIA_H200'; 'cpu' off CUDA."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return "cpu"
    return name_key(torch.cuda.get_device_name(device))


def name_key(name: str) -> str:
    """A device name as config file names carry it: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
    return name.replace(" ", "_").replace("/", "_")


# The devices whose files a device of the same compute capability may take when it has none of its own
# (``sibling_devices``), as file names carry them (``device_key``), with their capability: a file name says nothing
# of it. Nearest first: the H200 (the packaged files are its), then the H100 SXM (the Hopper most users have, the
# same SM, 3.0 TB/s copy against the H200's 4.26), then the other Hopper parts.
KNOWN_DEVICES: dict[str, tuple[int, int]] = {
    "NVIDIA_H200": (9, 0),
    "NVIDIA_H100_80GB_HBM3": (9, 0),
    "NVIDIA_H100_NVL": (9, 0),
    "NVIDIA_H100_PCIe": (9, 0),
    "NVIDIA_GH200_480GB": (9, 0),
    "NVIDIA_H800": (9, 0),
    "NVIDIA_H20": (9, 0),
}
# Whether a device without a packaged file of its own takes its sibling's (``tuned_files``) when
# $MOEKIT_SIBLING_CONFIGS is unset. On: f6f35e93:benchmarks/hop41_device_check.py on one H100 (session 42, 87f368f; raw
# results/raw/NVIDIA_H100-2026-12-06-87f368f-hop41.*): every check PASS, the H200's files >= 3% faster in 5/5 rounds
# at fp8 M = 1 (Mixtral x1.117, Qwen3 x1.080) and bf16 Mixtral M = 64 (x1.047), never >= 3% slower in any round of the
# 12 timed cells.
SIBLING_CONFIGS = True
SIBLING_ENV = "MOEKIT_SIBLING_CONFIGS"


def sibling_configs_on() -> bool:
    """$MOEKIT_SIBLING_CONFIGS (1: on, 0: off), else ``SIBLING_CONFIGS``."""
    value = os.environ.get(SIBLING_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${SIBLING_ENV} must be 1 (take a sibling device's config files) or 0 (never), "
                         f"got {value!r}")
    return SIBLING_CONFIGS if value == "" else value == "1"


@functools.lru_cache(maxsize=64)
def device_capability(device: str) -> tuple[int, int] | None:
    """The compute capability of the visible CUDA device ``device`` (a ``device_key``), else ``KNOWN_DEVICES``',
    else None. Cached (cleared with the lookups)."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if name_key(torch.cuda.get_device_name(index)) == device:
                return tuple(torch.cuda.get_device_capability(index))
    return KNOWN_DEVICES.get(device)


def sibling_devices(device: str) -> list[str]:
    """The devices whose files ``device`` may take, nearest first: those of ``KNOWN_DEVICES`` of its compute
    capability, in the table's order, itself left out; none off CUDA or of an unknown capability."""
    capability = None if device == "cpu" else device_capability(device)
    if capability is None:
        return []
    return [other for other, cap in KNOWN_DEVICES.items() if cap == capability and other != device]


def dtype_key(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(num_experts: int, n: int, k: int, dtype: torch.dtype | str, device: str) -> str:
    return f"E{num_experts}_N{n}_K{k}_{dtype_key(dtype)}_{device}.json"


def user_config_dirs() -> list[Path]:
    """Directories searched before the packaged one, first wins."""
    dirs = []
    if os.environ.get("MOEKIT_CONFIG_DIR"):
        dirs.append(Path(os.environ["MOEKIT_CONFIG_DIR"]))
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    dirs.append(Path(xdg) / "moekit" / "configs")
    return dirs


def default_user_dir() -> Path:
    """Where ``moekit tune`` writes: the first user directory."""
    return user_config_dirs()[0]


# (E, N, K, dtype, device, the two of ``lookup_env()``) -> the tuned entries {M: config} of the files found
# (``tuned_files``), overlaid per M (``overlay``), None where there is none. A lookup used to stat each directory
# and read the file on every call (~50 µs on the host path); a hit is one dictionary lookup. The variables that name
# the user directories are in the key, so pointing them elsewhere searches again. $MOEKIT_SIBLING_CONFIGS is not: an
# unset variable costs ~0.77 µs to read (os.environ raises KeyError inside), +45% on a ``get_config`` hit (1.7 ->
# 2.5 µs, CPU); it is read at a shape's first lookup, like the files, so after changing it in a running process call
# ``clear_config_cache()``.
_TABLES: dict[tuple, dict[int, KernelConfig] | None] = {}
# (M, E, N, K, top_k, dtype, device, the two of ``lookup_env()``) -> what ``get_config`` returned. The log2 search
# over a file's entries cost ~14 µs a call on the H200's host; a hit is one lookup. Bounded: the oldest
# entry goes first past _MAX_LOOKUPS.
_LOOKUPS: dict[tuple, KernelConfig] = {}
_MAX_LOOKUPS = 4096
_ON_CLEAR: list[Callable[[], None]] = []


def lookup_env() -> tuple[str | None, str | None]:
    """The variables that name the user directories, $MOEKIT_CONFIG_DIR and $XDG_CONFIG_HOME (part of every cache
    key of the files' entries)."""
    return os.environ.get("MOEKIT_CONFIG_DIR"), os.environ.get("XDG_CONFIG_HOME")


def clear_config_cache() -> None:
    """Forget every cached lookup (and whatever registered with ``on_config_cache_clear``): the next
    one searches the directories again."""
    _TABLES.clear()
    _LOOKUPS.clear()
    device_capability.cache_clear()
    for clear in _ON_CLEAR:
        clear()


def on_config_cache_clear(clear: Callable[[], None]) -> None:
    """Call ``clear`` whenever ``clear_config_cache`` runs: for caches built from looked-up configs."""
    _ON_CLEAR.append(clear)


@functools.lru_cache(maxsize=16)
def call_device_key(device: torch.device) -> str:
    """``device_key`` of a call's device, kept (the driver asked for the name once a device): per-call rules."""
    return device_key(device)


on_config_cache_clear(call_device_key.cache_clear)


def read_configs(path: Path) -> dict[int, KernelConfig]:
    """The entries {M: config} of one config file."""
    data = json.loads(Path(path).read_text())
    return {int(m): KernelConfig.from_dict(c) for m, c in data["configs"].items()}


def config_files(name: str) -> list[Path]:
    """The files named ``name`` in the search order: the user directories' first, the packaged one last."""
    return [directory / name for directory in [*user_config_dirs(), PACKAGED_DIR] if (directory / name).is_file()]


def overlay(paths: list[Path], read: Callable[[Path], dict[int, Entry]]) -> dict[int, Entry] | None:
    """The entries {M: entry} of ``paths`` (in the search order) taken together: per M the entry of the first file
    that has one, so a tuned M replaces that M of the files after it and nothing else. None where ``paths`` is
    empty."""
    if not paths:
        return None
    entries: dict[int, Entry] = {}
    for path in reversed(paths):
        entries.update(read(path))
    return entries


@dataclass(frozen=True)
class TunedFiles:
    """The files one lookup overlays (``overlay``), in the search order: the device's own, then a sibling's."""

    own: tuple[Path, ...]  # the device's files of the shape: user directories first, the packaged one last
    sibling: str | None  # the sibling device whose files follow (``sibling_devices``); None: own files only
    theirs: tuple[Path, ...]  # that sibling's files of the shape, in the same order; () without a sibling

    @property
    def paths(self) -> list[Path]:
        return [*self.own, *self.theirs]


def tuned_files(name_of: Callable[[str], str], device: str) -> TunedFiles:
    """The files a lookup of one shape reads on ``device``: ``name_of(device)`` in the search order, then, where the
    packaged directory holds no such file of the device's own and the fallback is on (``sibling_configs_on``), the
    files ``name_of(sibling)`` of the nearest sibling with any (``sibling_devices``). ``name_of``: device key -> file
    name of the shape."""
    own = tuple(config_files(name_of(device)))
    if (PACKAGED_DIR / name_of(device)).is_file() or not sibling_configs_on():
        return TunedFiles(own, None, ())
    for sibling in sibling_devices(device):
        theirs = tuple(config_files(name_of(sibling)))
        if theirs:
            return TunedFiles(own, sibling, theirs)
    return TunedFiles(own, None, ())


def served_by(num_tokens: int, name_of: Callable[[str], str], device: str) -> str:
    """Whose file a lookup at ``num_tokens`` takes its entry from (``tuned_files``, the nearest M of the overlay):
    the device key, with " (sibling)" where it is a sibling's; "heuristic" where there is no file. Reads the files
    (uncached): for reports, not the call path."""
    files = tuned_files(name_of, device)
    entries = [(path, set(map(int, json.loads(path.read_text())["configs"]))) for path in files.paths]
    every_m = set().union(*(ms for _, ms in entries))
    if not every_m:
        return "heuristic"
    at = nearest({m: m for m in every_m}, num_tokens)
    path = next(path for path, ms in entries if at in ms)
    return f"{files.sibling} (sibling)" if path in files.theirs else device


def load_configs(num_experts: int, n: int, k: int, dtype: torch.dtype | str, device: str
                 ) -> dict[int, KernelConfig] | None:
    """The tuned entries {M: config} for this shape: each M from the first file of ``tuned_files`` that has it (a
    user file's M over the packaged file's, the device's own over a sibling's, ``overlay``); None where there is no
    file. ``dtype``: a torch dtype or a file's dtype part (the weight-only names). Cached (``_TABLES``); the dict
    returned is shared, so do not change it."""
    key = (num_experts, n, k, dtype, device, os.environ.get("MOEKIT_CONFIG_DIR"), os.environ.get("XDG_CONFIG_HOME"))
    if key not in _TABLES:
        files = tuned_files(lambda dev: config_file_name(num_experts, n, k, dtype, dev), device)
        _TABLES[key] = overlay(files.paths, read_configs)
    return _TABLES[key]


def nearest(configs: dict[int, KernelConfig], num_tokens: int) -> KernelConfig:
    """The entry whose M is nearest to ``num_tokens`` in log2 distance (ties: the smaller M)."""
    target = math.log2(max(num_tokens, 1))
    return configs[min(configs, key=lambda m: (abs(math.log2(max(m, 1)) - target), m))]


def heuristic_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int) -> KernelConfig:
    """The default when no tuned file matches, distilled from the H200 sweeps of the three presets
    (benchmarks/results/raw: the ``measured`` entries of the packaged files time both).

    The tile height follows the mean rows per expert m_e = M*k/E (the padding tax: a tile much taller
    than m_e is mostly padding): 16 below m_e = 16, then 32, 64, and 128 from m_e = 64 (the retune on
    TMA weight loads picked 128-row tiles at m_e = 64: Mixtral M=256, Qwen3 M=1024). Decode tiles are
    narrow so that the few blocks still make enough programs to keep every SM streaming weights.
    """
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert < 16:
        blocks = max(1, min(num_experts, num_tokens * top_k))  # ~ one block per touched expert
        down_n = next((bn for bn in (128, 64) if blocks * k / bn >= 256), 32)  # >= ~2 programs per SM
        up = GemmTile(32 if n <= 4096 else 64, 128, 1, 4, 4)
        down = GemmTile(down_n, 256, 1, 4, 3) if n >= 2048 else GemmTile(down_n, 128, 1, 4, 4)
        return KernelConfig(16, up, down)
    if rows_per_expert < 32:
        return KernelConfig(32, GemmTile(128, 128, 8, 8, 3), GemmTile(64, 128, 1, 4, 4))
    if rows_per_expert < 64:
        return KernelConfig(64, GemmTile(64, 128, 1, 4, 4), GemmTile(128, 64, 8, 4, 4))
    return KernelConfig(128, GemmTile(128, 64, 8, 8, 4), GemmTile(128, 64, 8, 8, 3))


def shared_memory_bytes(block_m: int, tile: GemmTile, itemsize: int, weight_tiles: int,
                        descriptors: bool = False) -> int:
    """Shared memory of one GEMM's software pipeline: its buffered steps, each holding the [BLOCK_M,
    BLOCK_K] activation tile and ``weight_tiles`` [BLOCK_K, BLOCK_N] weight tiles (2 in the gate-up GEMM:
    gate and up). Pointer loads buffer ``num_stages - 1`` steps, TMA descriptor loads ``num_stages``
    (plus their barriers). Matches what Triton 3.6 asked for on the H200: 294912 bytes for pointer loads
    at BLOCK_M 32, BLOCK_N 128, BLOCK_K 128, 3 stages, fp32 (2 x (32*128 + 2*128*128) x 4), and 245848
    with descriptors at BLOCK_M 128, BLOCK_N 128, BLOCK_K 64, 5 stages, bf16 (5 x 49152 + 88)."""
    per_step = (block_m * tile.BLOCK_K + weight_tiles * tile.BLOCK_K * tile.BLOCK_N) * itemsize
    if descriptors:
        return tile.num_stages * per_step + 1024  # barriers: a few bytes per stage; 1 KiB covers them
    return max(tile.num_stages - 1, 1) * per_step


def fit_shared_memory(config: KernelConfig, itemsize: int, limit_bytes: int, descriptors: bool = False) -> KernelConfig:
    """``config`` with each GEMM's pipeline shrunk until it fits ``limit_bytes`` of shared memory: fewer
    stages first (down to 2), then a halved BLOCK_K (down to 16). A config tuned for bf16 used on fp32
    inputs needs this; a config that already fits comes back unchanged."""

    def fit(tile: GemmTile, weight_tiles: int) -> GemmTile:
        while shared_memory_bytes(config.BLOCK_M, tile, itemsize, weight_tiles, descriptors) > limit_bytes:
            if tile.num_stages > 2:
                tile = replace(tile, num_stages=tile.num_stages - 1)
            elif tile.BLOCK_K > 16:
                tile = replace(tile, BLOCK_K=tile.BLOCK_K // 2)
            else:
                break  # the smallest tile we make; let Triton report what it needs
        return tile

    return replace(config, up=fit(config.up, 2), down=fit(config.down, 1))


def get_config(
    num_tokens: int, num_experts: int, n: int, k: int, top_k: int, dtype: torch.dtype, device: str
) -> KernelConfig:
    """The tuned config of the nearest M for this shape, or the heuristic. Cached (``_LOOKUPS``)."""
    key = (num_tokens, num_experts, n, k, top_k, dtype, device, os.environ.get("MOEKIT_CONFIG_DIR"),
           os.environ.get("XDG_CONFIG_HOME"))
    config = _LOOKUPS.get(key)
    if config is None:
        configs = load_configs(num_experts, n, k, dtype, device)
        config = nearest(configs, num_tokens) if configs else heuristic_config(num_tokens, num_experts, n, k, top_k)
        put_bounded(_LOOKUPS, key, config, _MAX_LOOKUPS)
    return config


def write_configs(path: Path, num_experts: int, n: int, k: int, dtype: torch.dtype, device: str,
                  configs: dict[int, KernelConfig], measured: dict[int, dict] | None = None) -> None:
    """Write a config file atomically (a reader never sees half a file) and clear the lookup cache, so
    the next lookup in this process finds it. ``measured`` (optional, per M: the tuned and the heuristic
    µs) is kept beside the entries for the record; lookups ignore it."""
    data = {
        "E": num_experts, "N": n, "K": k, "dtype": dtype_key(dtype), "device": device,
        "configs": {str(m): configs[m].to_dict() for m in sorted(configs)},
    }
    if measured:
        data["measured"] = {str(m): measured[m] for m in sorted(measured)}
    write_config_data(path, data)


def write_config_data(path: Path, data: dict) -> None:
    """Write a config file's JSON ``data`` as it is (entries with keys of their path's own, such as the fp8
    switches, kept), atomically, and clear the lookup cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    clear_config_cache()
