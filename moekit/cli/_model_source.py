"""``--preset`` / ``--config``: the MoE layer a subcommand reads from a preset or a transformers config.json, with
errors that name the flag and the file (``moekit analyze``, ``moekit simulate``, ``moekit serve``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from moekit.analysis.billed import BilledLayer, billed_layer
from moekit.cli._args import UsageError
from moekit.config import MissingConfigField, MoEConfig
from moekit.presets import hf_config_of_preset, preset_names


def add_source_arguments(group, config_help: str = "a transformers config.json") -> None:
    """``--preset NAME`` and ``--config CONFIG_JSON`` on ``group`` (a parser or an argument group)."""
    group.add_argument("--preset", choices=preset_names(), help="a published model's shapes and router")
    group.add_argument("--config", metavar="CONFIG_JSON", help=config_help)


@dataclass(frozen=True)
class ModelSource:
    """The model a ``--preset`` / ``--config`` names."""

    layer: MoEConfig  # its MoE layer (a family moekit cannot serve: its numbers, routed as softmax top-k)
    hf: dict  # its config.json fields (a preset's as the model ships them)
    name: str  # the preset's name or the config file's path, for messages
    note: str | None = None  # why moekit cannot serve the layer and what stands for it (``BilledLayer.note``)


def preset_source(name: str) -> ModelSource:
    """The model of preset ``name`` (one of ``preset_names()``)."""
    hf = hf_config_of_preset(name)
    return ModelSource(MoEConfig.from_hf_config(hf, layer="typical"), hf, name)


def source_of(args) -> ModelSource | None:
    """The model of ``--preset`` or ``--config``; None when neither is given."""
    if args.preset and args.config:
        raise UsageError("give one of --preset and --config, not both")
    if args.preset:
        return preset_source(args.preset)
    if args.config:
        hf = read_config_json(args.config)
        billed = layer_config(hf, args.config)
        return ModelSource(billed.config, hf, args.config, billed.note)
    return None


def read_config_json(path: str) -> dict:
    """The ``--config`` file as a dict of config fields."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except OSError as err:
        raise UsageError(f"--config: cannot read {path}: {err.strerror}") from err
    except ValueError as err:  # json.JSONDecodeError, or bytes that are not UTF-8
        raise UsageError(f"--config: {path} is not JSON: {err}") from err
    if not isinstance(hf, dict):
        raise UsageError(f"--config: {path} holds a JSON {type(hf).__name__}, not a config.json object of fields")
    return hf


def layer_config(hf: dict, path: str) -> BilledLayer:
    """The MoE layer the config.json at ``path`` describes (a family ``from_hf_config`` refuses: its numbers and the
    refusal's note, ``moekit.analysis.billed``), or a ``UsageError`` naming the file and the field."""
    try:
        return billed_layer(hf)
    except MissingConfigField as err:
        raise UsageError(err.message(f"config.json at {path}")) from err
    except (TypeError, ValueError) as err:
        raise UsageError(f"config.json at {path}: {err}") from err


def simulated_source(args) -> ModelSource | None:
    """``source_of(args)`` for the simulator (``moekit simulate``, ``moekit serve``): a model whose every MoE layer
    hash-routes (DeepSeek-V4's hash layers: ``moekit.sim.run``'s module doc) is a ``UsageError`` naming the flag."""
    from moekit.sim.run import hash_layers_of  # the simulator's rule; analyze and bench never load it

    source = source_of(args)
    if source is not None:
        try:
            hash_layers_of(source.hf)
        except ValueError as err:
            raise UsageError(f"{'--preset' if args.preset else '--config'} {source.name}: {err}") from err
    return source
