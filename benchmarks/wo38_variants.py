"""The cells and calls of ``wo38_device_check.py`` (issue #16, session 38: weight-only experts at mid batches): per
cell (scheme, preset, M) the route's pick and every decode that can run there, each a ``Variant`` (a fused decode and
its config through ``run_experts_wo(decode=, config=)``, the scratch decode, or the Gluon path with named GEMM options).

Which variants a cell gets depends on R = M * k / E, the mean rows an expert receives (``applies``): 16-row blocks up to
64 rows (4 blocks an expert), 32 from 12, 64 from 24 (mma: 48), 128-row tiles from 48, the Gluon path (128-row blocks)
from 16. ``SMOKE`` (the check sets TRITON_INTERPRET before importing this): tiny shapes, every variant.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

from moekit.bench.cells import Shape
from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_gluon_wo import GLUON_WO_OPTIONS, GluonWoGemms, gluon_wo_range, wo_options
from moekit.experts.triton_wo_configs import wo_config
from moekit.experts.triton_wo_gemv import WordConfig
from moekit.experts.triton_wo_plan import choose_decode
from moekit.experts.triton_wo_winners import tile

SMOKE = "--smoke" in sys.argv
SCHEMES = {"int4": "int4_w4a16", "int8": "int8_w8a16", "mxfp4": "mxfp4"}
# The cells in order of the gain the H200 bench of d9495089 leaves (route µs / bf16 µs, brief wo38); the lead's
# calls (--cells) take a slice each
CALLS = {
    "1": ("int4:mixtral-8x7b:256", "int4:mixtral-8x7b:512", "mxfp4:mixtral-8x7b:256", "mxfp4:mixtral-8x7b:512"),
    "2": ("int4:deepseek-v3:512", "mxfp4:deepseek-v3:512", "int4:deepseek-v3:1024", "mxfp4:deepseek-v3:1024"),
    "3": ("int4:qwen3-30b-a3b:256", "mxfp4:qwen3-30b-a3b:256", "int8:mixtral-8x7b:512", "int8:mixtral-8x7b:256"),
    "4": ("int8:deepseek-v3:512", "int8:deepseek-v3:1024", "int4:mixtral-8x7b:128", "mxfp4:mixtral-8x7b:128"),
}
SMOKE_CELLS = ("int4:mixtral-8x7b:16", "mxfp4:deepseek-v3:16")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run a cell: ``decode`` one of ``triton_wo_plan.DECODES`` (None: the route, naming nothing),
    ``config`` the fused decodes' (None: the lookup's), ``gluon`` the Gluon path's GEMM options (decode "gluon")."""

    decode: str | None
    config: KernelConfig | None = None
    gluon: GluonWoGemms | None = None

    def describe(self) -> str:
        """One short line: the decode, then the Gluon GEMMs' options or the config (rows, each GEMM's BN x BK, GROUP_M,
        warps, stages, and its switches that are on)."""
        if self.decode == "gluon":
            return f"gluon up {_options(self.gluon.up)} down {_options(self.gluon.down)}"
        if self.config is None:
            return f"{self.decode} (lookup)"
        c = self.config.to_dict()
        tiles = " / ".join(f"{t['BLOCK_N']}x{t['BLOCK_K']} g{t['GROUP_M']} w{t['num_warps']} s{t['num_stages']}"
                           for t in (c["up"], c["down"]))
        on = [k for k, v in c.items() if k not in ("BLOCK_M", "up", "down") and (v is True or type(v) is int and v > 1)]
        return f"{self.decode} m{c['BLOCK_M']} {tiles}" + "".join(f" {k}={c[k]}" for k in on)


def _options(o) -> str:
    """The GEMM options that are on ("base": none)."""
    on = [f.name if isinstance(getattr(o, f.name), bool) else f"{f.name}={getattr(o, f.name)}"
          for f in dataclasses.fields(o) if getattr(o, f.name) != f.default]
    return "+".join(on) or "base"


@dataclasses.dataclass(frozen=True)
class CellSpec:
    scheme: str  # the full name (int4_w4a16, ...)
    preset: str
    m: int

    @classmethod
    def parse(cls, text: str) -> CellSpec:
        """``SCHEME:PRESET:M`` (SCHEME int4, int8 or mxfp4), a clear error otherwise."""
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in SCHEMES or not parts[2].isdigit():
            raise ValueError(f"--cells takes SCHEME:PRESET:M with SCHEME one of {tuple(SCHEMES)}, got {text!r}")
        return cls(SCHEMES[parts[0]], parts[1], int(parts[2]))

    @property
    def label(self) -> str:
        return f"{self.scheme.split('_')[0]} {self.preset} M={self.m}"


def shape_of(preset: str) -> Shape:
    return Shape(f"{preset}/smoke", 8, 128, 256, 2) if SMOKE else Shape.from_preset(preset)


def compile_shape(preset: str) -> Shape:
    """The shape a compile worker runs on: the preset's with at most 32 experts (the GEMMs' constexprs are those of the
    preset's: E stays a multiple of 16 where it was one; DeepSeek-V3's 256 uninitialised experts would take 11 GB a
    worker)."""
    s = shape_of(preset)
    return s if s.num_experts <= 32 else dataclasses.replace(s, num_experts=32)


T128 = GemmTile(32, 128, 1, 1, 3)  # the mma decode's heuristic tile (``_mma_heuristic``)
T128G8 = GemmTile(32, 128, 8, 1, 3)  # the same with GROUP_M 8 (an expert's next blocks read its tile from L2)
T128W2 = GemmTile(32, 128, 8, 2, 3)  # 2 warps (64-row blocks)


def named(scheme: str) -> dict:
    """name -> (Variant, rows-an-expert range [lo, hi] where it runs)."""
    down16 = 128 if scheme == "int8_w8a16" else 64  # the tile decode's 16-row down tile (``wo_heuristic_config``)
    out = {
        "mma16": (Variant("mma"), (0, 64)),  # the route's mma config at this M (heuristic, MMA_HALVES, tuned file)
        "mma16g8": (Variant("mma", KernelConfig(16, T128G8, T128G8)), (12, 128)),
        "mma32": (Variant("mma", KernelConfig(32, T128, T128)), (12, 128)),
        "mma32g8": (Variant("mma", KernelConfig(32, T128G8, T128G8)), (24, 256)),
        "mma64": (Variant("mma", KernelConfig(64, T128W2, T128W2)), (48, 256)),
        "reg": (Variant("register"), (0, 64)),  # the register decode's heuristic for the bucket
        "tile16g8": (Variant("tile", tile(16, (64, 128, 8, 4, 4), (down16, 128, 8, 4, 4))), (0, 32)),
        "tile32": (Variant("tile", tile(32, (64, 128, 1, 4, 3), (64, 128, 1, 4, 3))), (12, 64)),
        "tile32g8": (Variant("tile", tile(32, (64, 128, 8, 4, 3), (64, 128, 8, 4, 3))), (12, 64)),
        "tile64": (Variant("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4))), (24, 256)),
        "tile64g8a": (Variant("tile", tile(64, (64, 64, 8, 4, 4), (64, 64, 8, 4, 4), True)), (24, 256)),
        "tile128": (Variant("tile", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3))), (48, 1 << 20)),
        "tile128n256a": (Variant("tile", tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True)), (48, 1 << 20)),
        "scratch": (Variant("scratch"), (16, 1 << 20)),
        "gluon": (Variant("gluon", gluon=GluonWoGemms()), (16, 1 << 20)),  # the session-27 GEMMs
    }
    if scheme != "int8_w8a16":  # the gate rows and up rows in separate programs (``WordConfig.halves``)
        out["mma32h"] = (Variant("mma", WordConfig(32, T128, T128, halves=True)), (12, 128))
    return out


def measured_gluon(scheme: str, s: Shape) -> GluonWoGemms | None:
    """The GEMM options measured fastest for this shape at any M (``GLUON_WO_OPTIONS``), or None."""
    got = GLUON_WO_OPTIONS.get((scheme, s.num_experts, s.n, s.k))
    return None if got is None else got.gemms


def pick_variant(spec: CellSpec, s: Shape, device_key: str, gluon_ok: bool) -> Variant:
    """What the route runs at the real shape, named (the compile workers run it on fewer experts, where the route
    would choose otherwise): the Gluon path where ``gluon_wo_range`` takes M on this device (and it runs Gluon), else
    ``choose_decode``'s decode with ``wo_config``'s config."""
    lo, hi = gluon_wo_range(spec.scheme, s.num_experts, s.n, s.k, device_key)
    if gluon_ok and lo <= spec.m < hi:
        return Variant("gluon", gluon=_options_at(spec.scheme, s, spec.m))
    decode = choose_decode(spec.scheme, spec.m, s.num_experts, s.n, s.k, s.top_k)
    if decode in ("scratch", "gluon"):
        return Variant(decode)
    return Variant(decode, wo_config(spec.m, s.num_experts, s.n, s.k, s.top_k, spec.scheme, device_key, decode))


def _options_at(scheme: str, s: Shape, m: int) -> GluonWoGemms:
    """``wo_options`` of the real shape at M (it reads the shape off the weights' q: stand-ins with its dims)."""
    q13, q2 = SimpleNamespace(shape=(s.num_experts, 2 * s.n, s.k)), SimpleNamespace(shape=(s.num_experts, s.k, s.n))
    return wo_options(SimpleNamespace(q=q13), SimpleNamespace(q=q2), scheme, m)


def variants(spec: CellSpec, device_key: str, gluon_ok: bool) -> dict:
    """name -> Variant of the cell: "pick" (the route, named), then each named variant whose rows range holds R, the
    Gluon path with the shape's measured options ("gluonM", where they differ from the session-27 GEMMs); the scratch
    decode not on shapes of more than 64 experts (DeepSeek-V3: 15 GB of scratch in 8 chunks, measured 2.3-2.9x the
    tile decode at M = 1024); the mma decode's lookup config resolved at the real shape."""
    s = shape_of(spec.preset)
    rows = spec.m * s.top_k / s.num_experts
    out = {"pick": pick_variant(spec, s, device_key, gluon_ok)}
    for name, (v, (lo, hi)) in named(spec.scheme).items():
        if not SMOKE and not lo <= rows <= hi:
            continue
        if v.decode == "scratch" and s.num_experts > 64:
            continue
        if v.decode == "gluon" and not gluon_ok:
            continue
        if v.config is None and v.decode in ("mma", "register"):
            v = Variant(v.decode, wo_config(spec.m, s.num_experts, s.n, s.k, s.top_k, spec.scheme, device_key,
                                            v.decode))
        out[name] = v
    got = measured_gluon(spec.scheme, s)
    if gluon_ok and "gluon" in out and got is not None and got != GluonWoGemms():
        out["gluonM"] = Variant("gluon", gluon=got)
    return out
