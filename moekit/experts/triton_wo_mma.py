"""The word MMA decode's host side (``_kernels/gemm_wo_mma.py``, decode "mma", issue #16): what it requires of the
weights and config (``check_mma``, refused by name), whether the chooser may take it (``mma_fits``), and what its
launches add to the plan's (``mma_launch_args``: the rows in words, SCALE_WORD). The plan (``triton_wo_plan``)
calls these; the config is ``triton_wo_configs``' (``_mma_heuristic``).

A weight here is a ``triton_wo_plan.WeightArgs`` (q, scale, zero, group_size, strides: q (e, r, c), scale (e, r, g),
zero (e, r, g) in elements).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moekit.experts.configs import KernelConfig
from moekit.experts.triton_launch import cdiv
from moekit.experts.triton_wo_gemv import PER, WordConfig, up_splits, words_ok

MMA_WORDS = 16  # the mma decode's words a dot (4-bit, K 128); a step loads 1 or 2 dots' words of a row at once
SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")
STEP_COLUMNS = (128, 256)  # BLOCK_K: 64 or 128 bytes of a 4-bit row a step, 128 or 256 of int8 (``gemm_wo_mma``)
# the mma decode's gate-up splits measured faster (a tuned file holds none): (scheme, E, N, K, M) -> splits, for calls
# of M / 2 .. 2M. DeepSeek-V3 mxfp4 M = 1 (its tuned 256-column steps, the multiply placement): split 2 104.1 µs
# against unsplit 131.5 and the gemv's 144.0 (session 29, mx9 CK1b, 5/5); Mixtral mxfp4 M = 1: split 2 134.4 µs
# against unsplit 140.4 / 140.3 (session 31, merged main 814ebdc, two runs, 5/5 each)
MMA_UP_SPLITS = {("mxfp4", 256, 2048, 7168, 1): 2, ("mxfp4", 8, 14336, 4096, 1): 2}


def mma_fits(w13, w2, scheme: str) -> bool:
    """Whether both weights meet ``check_mma``'s layout needs (the chooser's "mma" falls back where not)."""
    kind = "zero" if scheme == "int4_w4a16" else "scale"
    return (scheme in SCHEMES and words_ok(w13.q) and words_ok(w2.q)
            and (scheme == "int8_w8a16" or all(getattr(w, kind).data_ptr() % 4 == 0 for w in (w13, w2)))
            and (scheme != "int4_w4a16" or all(w.group_size % (8 * MMA_WORDS) == 0 for w in (w13, w2))))


def check_mma(config: KernelConfig, scheme: str, w13, w2) -> None:
    """The mma decode's requirements, each refused by name: one of SCHEMES, rows read as words, the byte tensors (int4
    zero points, mxfp4 scales) at 4-byte aligned addresses (the kernel reads their bytes as aligned words), steps of
    1 or 2 dots of 128 columns (BLOCK_K 128 or 256), int4 each dot inside one group (g a multiple of
    128), no folded activation (a ``triton_wo_gemv.WordConfig``'s up_split and halves are taken: float32 partials
    activated by the split_glu launch, ``mma_gate_up``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"decode='mma' runs {', '.join(SCHEMES)}, got {scheme}")
    if not (words_ok(w13.q) and words_ok(w2.q)):
        raise ValueError("decode='mma' needs w13.q and w2.q rows of a multiple of 4 contiguous bytes with strides "
                         "and addresses of multiples of 4 bytes")
    kind = "zero" if scheme == "int4_w4a16" else "scale"
    if scheme != "int8_w8a16" and any(getattr(w, kind).data_ptr() % 4 for w in (w13, w2)):
        raise ValueError(f"decode='mma' needs w13.{kind} and w2.{kind} at addresses of multiples of 4 bytes")
    if getattr(config, "glu_fold", False):
        raise ValueError("decode='mma' activates its float32 partials in their own launch: config.glu_fold must be "
                         "False")
    for name, tile, group in (("up", config.up, w13.group_size), ("down", config.down, w2.group_size)):
        if tile.BLOCK_K not in STEP_COLUMNS or (scheme == "int4_w4a16" and group % (8 * MMA_WORDS)):
            raise ValueError(f"decode='mma': config.{name}.BLOCK_K must be one of {STEP_COLUMNS} and int4's group "
                             f"size a multiple of {8 * MMA_WORDS}, got BLOCK_K {tile.BLOCK_K}, group_size {group}")


@functools.cache
def operand_pairs() -> int:
    """The kernels' PAIRS: the MMA order matching the 16-bit B operand layout this Triton gives the decoded weights
    (``wo_mma_values``), so they reach the MMA without a shared-memory hop. Read from sm_90 SASS of the int4 gate-up
    (``benchmarks/wo_mma_sass_cpu.py``, 32 x 128 in 1 warp): Triton 3.6 and 3.7 lay the operand 4 values a thread
    (kWidth 4: PAIRS 2, 2.67-2.69 instructions a weight; PAIRS 1 3.70-3.71 with 151 LDS a step), 3.8 and 3.9 2
    values (PAIRS 1: 2.49-2.73; PAIRS 2 on 3.8 3.25). Either order computes the same sums; only the speed depends on
    it."""
    import triton

    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return 2 if (major, minor) < (3, 8) else 1


def mma_split(config: KernelConfig, scheme: str, num_experts: int, n: int, k: int, num_tokens: int) -> KernelConfig:
    """``config`` with the gate-up split of the ``MMA_UP_SPLITS`` row covering the call (a ``WordConfig``), or
    unchanged."""
    splits = [v for (s, e, nn, kk, m), v in MMA_UP_SPLITS.items()
              if (s, e, nn, kk) == (scheme, num_experts, n, k) and m / 2 <= num_tokens <= 2 * m]
    if not splits or getattr(config, "up_split", 1) != 1:
        return config
    return WordConfig(config.BLOCK_M, config.up, config.down, config.swap_ab, up_split=splits[0])


def mma_launch_args(w, scheme: str) -> tuple[tuple[int, tuple], dict]:
    """((a row's words, the strides with q's in words), the launch's extra constexprs) of a weight that meets
    ``check_mma``. SCALE_WORD (mxfp4): a step's four e8m0 bytes of a row read as one aligned 32-bit word, where
    the scale rows start at multiples of 4 bytes and their groups are contiguous. PAIRS: ``operand_pairs``; PER: values
    a word (int8 4)."""
    qe, qr, _, se, sr, sg, *_ = w.strides
    scale_word = scheme == "mxfp4" and sg == 1 and se % 4 == 0 and sr % 4 == 0 and w.scale.data_ptr() % 4 == 0
    return (w.q.shape[2] // 4, (qe // 4, qr // 4, 1, *w.strides[3:])), {
        "SCALE_WORD": scale_word, "PAIRS": operand_pairs(), "PER": PER[scheme]}


@dataclass(frozen=True)
class MmaGateUp:
    """How decode "mma" launches its gate-up (``mma_gate_up``)."""

    kernel: str  # the gate-up kernel's name in ``_kernels/gemm_wo_mma``
    grid: tuple[int, int]  # (programs, K splits)
    h_tail: tuple[int, int]  # the gate-up's last two scalars: the row stride of its output (h or p), a split's words
    partials: int  # float32 partial sets p holds a row ([partials * A, 2N], the split_glu launch's); 0: h itself


def mma_gate_up(config: KernelConfig, kw: int, scheme: str, n: int, num_pid_m: int) -> MmaGateUp:
    """The gate-up of a config (rows of ``kw`` words, N = ``n``): both halves a program, h written activated, unless
    split along K (``up_split``) or ``halves`` (``triton_wo_gemv.WordConfig``: each program BLOCK_N of the 2N gate
    and up rows, one accumulator; ``gate_up_halves_wo_mma_kernel``); those write float32 partials p, which the
    split_glu launch activates into h."""
    split, words = up_splits(config, kw, scheme)
    halves = getattr(config, "halves", False)
    partials = split if split > 1 or halves else 0
    return MmaGateUp("gate_up_halves_wo_mma_kernel" if halves else "gate_up_wo_mma_kernel",
                     (num_pid_m * cdiv(2 * n if halves else n, config.up.BLOCK_N), split),
                     (2 * n if partials else n, words), partials)
