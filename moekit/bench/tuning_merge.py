"""How tuned entries go into a config file (``moekit tune``'s save, ``moekit tune --install``): per batch size M,
a tuned entry adds that M or replaces that M's entry, and nothing else. Every other entry stays as the file had it
(its JSON unchanged): its tiles and its path's own keys (the fp8 files' "weight_tma", "x_in_gate_up", "persistent",
"pair_dot", ``triton_fp8_plan.read_entries``; "swap_ab"), and its "measured" record. The lookups overlay the
directories' files the same way (``configs.overlay``), so a user file of a few M changes only the lookups near them.

    merge(file's JSON or None, tuned file's JSON) -> Merged: the JSON to write, the M added and replaced
    dropped_switches(entries read before, tuned entries) -> {M: the keys beside the tiles a tuned entry leaves off}

A tuned entry has the switches the search timed fastest: the fp8 search times them too (``tuning_switches``:
weight_tma, pair_dot, persistent, swap_ab; today's entry among its candidates), the others the tiles alone (a plain
entry). Where it replaces an entry whose switches it leaves off or sets otherwise, ``switch_notes`` says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moekit.experts.configs import config_files, overlay

HEADER = ("E", "N", "K", "dtype", "device")  # what names the file: equal in a file and the entries put into it
TILES = ("BLOCK_M", "up", "down")  # what the tuner searches; an entry's other keys are its path's switches


@dataclass(frozen=True)
class Merged:
    """A config file's JSON with tuned entries put in, and what they changed."""

    data: dict  # E, N, K, dtype, device, "configs" and "measured" ({str(M): ...}, M ascending), any other key kept
    added: tuple[int, ...]  # the tuned M the file had no entry of, ascending
    replaced: tuple[int, ...]  # the tuned M whose entry of the file they replaced, ascending

    def summary(self) -> str:
        """'added M=128, 256; replaced M=8' (a part left out where empty)."""
        parts = [f"{verb} M={', '.join(map(str, ms))}" for verb, ms in (("added", self.added),
                                                                        ("replaced", self.replaced)) if ms]
        return "; ".join(parts) or "no entry"


def raw_entries(path: Path) -> dict[int, dict]:
    """{M: the entry's JSON as the file has it} of one config file."""
    return {int(m): entry for m, entry in json.loads(Path(path).read_text())["configs"].items()}


def merge(target: dict | None, tuned: dict, where: str) -> Merged:
    """``target`` (a config file's JSON; None: no file yet) with each entry of ``tuned`` (a tuned file's JSON) in
    place of the same M; ``tuned``'s "measured" record of those M replaces theirs (a replaced M without one in
    ``tuned`` loses its record: it timed another entry). A ValueError naming ``where`` (the file) where the two
    disagree on E, N, K, dtype or device."""
    if target is not None:
        differ = [key for key in HEADER if target.get(key) != tuned[key]]
        if differ:
            raise ValueError(f"{where} holds {', '.join(f'{key}={target.get(key)!r}' for key in differ)}; the tuned "
                             f"entries are for {', '.join(f'{key}={tuned[key]!r}' for key in differ)}")
    old = {int(m): entry for m, entry in (target or {}).get("configs", {}).items()}
    new = {int(m): entry for m, entry in tuned["configs"].items()}
    measured = {int(m): v for m, v in (target or {}).get("measured", {}).items() if int(m) not in new}
    measured.update({int(m): v for m, v in tuned.get("measured", {}).items() if int(m) in new})
    configs = {**old, **new}
    data = {**(target or {key: tuned[key] for key in HEADER}),
            "configs": {str(m): configs[m] for m in sorted(configs)}}
    data.pop("measured", None)
    if measured:
        data["measured"] = {str(m): measured[m] for m in sorted(measured)}
    return Merged(data, tuple(sorted(new.keys() - old.keys())), tuple(sorted(new.keys() & old.keys())))


def looked_up(path: Path) -> dict[int, dict]:
    """Per M the entry the lookups of ``path``'s file name read before ``path`` is written: ``path``'s own entries
    over those of the config directories' files of that name (user ones over the packaged one)."""
    files = [path] if path.is_file() else []
    return overlay(files + config_files(path.name), raw_entries) or {}


def dropped_switches(before: dict[int, dict], tuned: dict[int, dict]) -> dict[int, tuple[str, ...]]:
    """{M: the keys beside the tiles that ``before``'s entry of M had and ``tuned``'s entry of M drops or sets
    otherwise}, for each tuned M that replaces an entry with such keys."""
    dropped = {}
    for m, entry in tuned.items():
        keys = tuple(key for key, value in before.get(m, {}).items() if key not in TILES and entry.get(key) != value)
        if keys:
            dropped[m] = keys
    return dropped


def switch_notes(dropped: dict[int, tuple[str, ...]]) -> list[str]:
    """One line per M of ``dropped_switches``: what the user now runs there without."""
    return [f"M={m}: replaces an entry with {'/'.join(keys)}; the tuned entry leaves them off or sets them otherwise "
            f"(what its search timed fastest), so M={m} now runs so" for m, keys in sorted(dropped.items())]
