"""``moekit bench --hf --hf-quant-options``: the quantizer options of ``--hf-quant``'s scheme, typed from the text.

``group_size=64,symmetric=true`` -> (("group_size", 64), ("symmetric", True)); ``block_shape=64x128`` -> a tuple.
Each value takes the type of the option's default (``moekit.quant.schemes.scheme_defaults``): an int is a decimal
integer, a bool ``true`` or ``false``, a pair ``AxB``. Then ``moekit.hf.swap_state.checked_quant_options`` checks the
values with the scheme's own quantizer and normalises them as ``use_moekit_blocks`` keeps them (defaults left out).
Every error is a ValueError starting ``hf-quant-options`` (the CLI prefixes ``--``).
"""

from __future__ import annotations

FLAG = "hf-quant-options"


def parse_quant_options(text: str | None, quant: str | None, block_quants: tuple[str, ...]) -> tuple:
    """``text`` as sorted (name, value) pairs for ``quant`` (one of ``block_quants``: moekit's quantizer runs them);
    () for no text."""
    if text is None:
        return ()
    if quant not in block_quants:
        raise ValueError(f"{FLAG} are options of moekit's quantizer: they need --hf-quant one of {block_quants}, "
                         f"got --hf-quant {quant}")
    from moekit.hf.swap_state import checked_quant_options
    from moekit.quant.schemes import scheme_defaults

    defaults = scheme_defaults(quant)
    options = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"{FLAG} must be name=value pairs separated by commas, got {item!r} in {text!r}")
        if name not in defaults:
            raise ValueError(f"{FLAG}: {name!r} is not an option of --hf-quant {quant}; it takes "
                             f"{sorted(defaults) or 'none'}")
        if name in options:
            raise ValueError(f"{FLAG}: {name!r} is given twice in {text!r}")
        options[name] = _typed(name, value, defaults[name])
    try:
        return checked_quant_options(quant, options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{FLAG}: {err}") from None


def _typed(name: str, value: str, default):
    """``value`` read as the type of ``default``; ValueError naming the option and the form it takes."""
    if isinstance(default, bool):
        if value not in ("true", "false"):
            raise ValueError(f"{FLAG}: {name} must be true or false, got {value!r}")
        return value == "true"
    if isinstance(default, int):
        if not value.lstrip("-").isdigit():
            raise ValueError(f"{FLAG}: {name} must be an integer, got {value!r}")
        return int(value)
    if isinstance(default, tuple):
        parts = value.split("x")
        if len(parts) != len(default) or not all(p.isdigit() for p in parts):
            form = "x".join("N" * len(default))
            raise ValueError(f"{FLAG}: {name} must be {len(default)} integers as {form} (e.g. "
                             f"{'x'.join(map(str, default))}), got {value!r}")
        return tuple(int(p) for p in parts)
    raise ValueError(f"{FLAG}: {name} takes no value from the command line")  # no scheme has such an option yet
