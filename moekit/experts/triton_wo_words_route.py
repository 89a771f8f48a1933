"""The route's decode "gluon_words" (``triton_wo.run_experts_wo(decode="gluon_words")``; issue #16 target 1, sessions
45-46; the default of the cells in ``triton_wo_words_default``, session 48): what the words kernels run of a call,
refused by name otherwise (as a default: ``words_fit``, the pick runs what does not fit); gpt-oss's
experts as a ``WordsVariant`` (expert biases, the clamped SwiGLU, interleaved rows: ``_kernels/words_glu.py``); mxfp4
off the 256 grid on the kept padded copy (``triton_wo_words_pad``); then a repeated eager call's kept sequence
(``triton_wo_words_lean.words_lean_call``) or, checked, the plan (``run_words``).

Shapes: x [M, K], w13 [E, 2N, K], w2 [E, K, N], ids / weights [M, k], b13 [E, 2N], b2 [E, K].
"""

from __future__ import annotations

import torch

from moekit.experts.triton_wo_words import PLAIN, WordsVariant, check_words, check_words_down, check_words_x_k

WORDS_SCHEMES = ("int4_w4a16", "mxfp4")


def words_variant(activation, b13, b2) -> WordsVariant:
    """The call's ``WordsVariant``; refuses by name an activation the epilogue does not run (not gated SiLU)."""
    from moekit.activations import as_spec

    spec = as_spec(activation)
    if spec.name != "silu" or not spec.gated:
        raise ValueError(f"decode='gluon_words' runs gated silu (alpha, limit, up_shift and interleaved rows "
                         f"included), got activation {spec.name}, gated {spec.gated}")
    return WordsVariant(b13 is not None, b2 is not None, spec.interleaved, 0.0 if spec.limit is None else spec.limit,
                        spec.alpha, spec.up_shift, spec.limit_after_act)


def words_call_variant(activation, b13, b2) -> WordsVariant:
    """``words_variant``, plain SiLU without biases first (no spec built)."""
    return PLAIN if activation == "silu" and b13 is None and b2 is None else words_variant(activation, b13, b2)


def run_experts_words(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map,
                      scheme: str, activation, b13=None, b2=None, default: bool = False,
                      shortcut: bool = True) -> torch.Tensor | None:
    """out [M, K] of the call on the words kernels: int4 or mxfp4, the tiny-batch shortcut or 8-row aligned blocks,
    the down split by ``down_split`` (``triton_wo_words_lean.words_plan``); a repeated eager call of a kind launches
    its kept sequence (``words_lean_call``) after the refusals alone. ``default``: the route's default took the call
    (``triton_wo_words_default``), not its caller: None where the kernels do not fit it (``words_fit``) or it would
    need the padded copy (a default never doubles the experts' memory), and the caller runs the pick. ``shortcut``:
    the tiny-batch shortcut where ``use_naive`` holds (False: 8-row aligned blocks there too, an expert's slots in
    one; ``LaunchOptions.shortcut_max_tokens``)."""
    from moekit.experts.triton_wo_words_lean import run_words, words_lean_call
    from moekit.experts.triton_wo_words_pad import needs_padding, words_weights

    if scheme not in WORDS_SCHEMES or expert_map is not None:
        raise ValueError(f"decode='gluon_words' runs int4_w4a16 or mxfp4 without an expert_map, got {scheme}, "
                         f"expert_map {expert_map is not None}")
    variant = words_call_variant(activation, b13, b2)
    b13 = None if b13 is None else b13.contiguous()  # the kernels read them flat (no copy unless strided)
    b2 = None if b2 is None else b2.contiguous()
    cols = None  # the kernels' reduction: x's K, or the padded copy's K'
    if needs_padding(x, w13):  # mxfp4 at K or N no multiple of 256 (gpt-oss's 2880): the kept padded copy
        if default:
            return None
        check_words_x_k(x, w13)
        w13, w2, b13 = words_weights(w13, w2, variant.interleaved, b13)
        cols = 2 * w13.q.shape[2]
    out = words_lean_call(x, w13, w2, topk_ids, topk_weights, variant, b13, b2, shortcut=shortcut)
    if out is not None:
        return out
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # the kernels read them flat: [A]
    if ids.numel() == 0 or x.shape[1] == 0:
        return x.new_zeros(x.shape)
    if default and not words_fit(x, w13, w2, ids.shape[1]):
        return None
    if not runs_on(x.device):
        raise ValueError(f"decode='gluon_words' runs on CUDA sm_80+ (Gluon), got {x.device}")
    check_words(x, w13, ids.shape[1], cols=cols)
    check_words_down(w2, 1)
    _check_biases(w13, w2, b13, b2)
    return run_words(x, w13, w2, ids, weights, variant=variant, b13=b13, b2=b2, shortcut=shortcut)


def _check_biases(w13, w2, b13, b2) -> None:
    """b13 [E, 2N] and b2 [E, K], as the kernels read them (by name)."""
    for name, b, shape in (("b13", b13, w13.q.shape[:2]), ("b2", b2, w2.q.shape[:2])):
        if b is not None and tuple(b.shape) != tuple(shape):
            raise ValueError(f"decode='gluon_words' needs {name} {tuple(shape)}, got {tuple(b.shape)}")


def runs_on(device: torch.device) -> bool:
    """Whether the words kernels (Gluon) run on ``device``: CUDA (the CPU tests patch it, with their stand-ins)."""
    return device.type == "cuda"


def words_fit(x: torch.Tensor, w13, w2, top_k: int) -> bool:
    """Whether the words kernels take this call on x's K (no padded copy): their checks pass (``check_words``,
    ``check_words_down``: bf16 x, int4 groups of 128 or mxfp4 scales in the decode's range, 16-byte aligned codes,
    N and K on the 256 grid)."""
    if not runs_on(x.device):
        return False
    try:
        check_words(x, w13, top_k)
        check_words_down(w2, 1)
    except ValueError:
        return False
    return True
