"""The words decode's own copy of an mxfp4 weight pair whose reduction dims are no multiple of 256 (gpt-oss's
K = N = 2880; issue #16 target 1, session 46): the words kernels run whole 256-column steps, so the copy pads K and N
to K', N' (multiples of 256) with code 0 (+0.0 in e2m1: the padded columns add nothing, whatever their scale) and the
activations are reordered into [M, K'] with zeros past K (``_kernels/words_x.py``).

    w13 [E, 2N, K] -> [E, 2N', K']: gate rows 0..N-1 at 0..N-1, up rows N..2N-1 at N'..N'+N-1, zeros elsewhere
                                    (interleaved rows, gpt-oss's: the 2N rows first); b13 [E, 2N] likewise
    w2  [E, K, N]  -> [E, K, N']:   the output rows as they are, zeros past column N

Made once per version of the originals (a device copy, no host sync) and kept, never per call: a lean call's
sequence holds the copy's addresses, and a hit looks the copy up here first (its key: the originals' addresses and
versions, the very tensors held weakly; the copy goes when w13's codes are freed). Memory: the copy beside the
originals (the route's other decodes read those): gpt-oss-20b's layer, 423 MB of codes and scales, gets a 471 MB
copy (w13 +14%, w2 +7%): 11.3 GB over its 24 layers. Only mxfp4 is padded (an
int4 group of 128 would not divide 2880).

Shapes: E experts, N intermediate, K hidden, N' / K' rounded up to 256.
"""

from __future__ import annotations

import threading
import weakref

import torch

from moekit._bounded import put_bounded
from moekit.experts.triton_wo_plan import weight_args

STEP = 256  # the words kernels' columns a step
MAX_KEPT = 64  # weight pairs kept; the oldest goes first
_KEPT: dict[tuple, tuple] = {}
_lock = threading.Lock()


def padded(n: int) -> int:
    return -(-n // STEP) * STEP


def needs_padding(x: torch.Tensor, w13) -> bool:
    """Whether the words call of x on w13 reads a padded copy (mxfp4 with K or N no multiple of 256)."""
    return w13.scale.dtype == torch.uint8 and bool(x.shape[1] % STEP or w13.q.shape[1] // 2 % STEP)


def words_weights(w13, w2, interleaved: bool = False, b13=None) -> tuple:
    """(w13, w2, b13) of the kept padded copy of this mxfp4 pair (``WeightArgs``; b13 [E, 2N'] or None), made now if
    new or if an original changed (its address or version). ``interleaved``: w13's rows gate i at 2i, up i at 2i + 1
    (then the padded rows follow them all). K and N must be multiples of 32 (whole scale groups)."""
    tensors = (w13.q, w13.scale, w2.q, w2.scale) + (() if b13 is None else (b13,))
    key = tuple((t.data_ptr(), t._version) for t in tensors) + (w13.q.device, interleaved)
    kept = _KEPT.get(key)
    if kept is not None and all(ref() is t for ref, t in zip(kept[0], tensors)):  # not a new tensor at an old address
        return kept[1]
    copy = (*_pad_pair(w13, w2, interleaved), None if b13 is None else _pad_rows(b13, w13.q.shape[1] // 2,
                                                                                   interleaved))
    with _lock:
        refs = (weakref.ref(tensors[0], _forget(key)), *(weakref.ref(t) for t in tensors[1:]))  # goes with w13.q
        put_bounded(_KEPT, key, (refs, copy), MAX_KEPT)
    return copy


def _pad_rows(t: torch.Tensor, n: int, interleaved: bool, fill: int = 0) -> torch.Tensor:
    """t [E, 2N, ...] -> [E, 2N', ...] (``fill`` elsewhere): gate rows at 0.., up rows at N'.. (interleaved: all
    2N rows first)."""
    np_ = padded(n)
    out = t.new_full((t.shape[0], 2 * np_, *t.shape[2:]), fill)
    if interleaved:
        out[:, :2 * n] = t
    else:
        out[:, :n], out[:, np_:np_ + n] = t[:, :n], t[:, n:]
    return out


def _forget(key: tuple):
    def forget(ref: weakref.ref) -> None:
        kept = _KEPT.get(key)
        if kept is not None and kept[0][0] is ref:
            _KEPT.pop(key, None)

    return forget


def _pad_pair(w13, w2, interleaved: bool) -> tuple:
    num_experts, two_n, half_k = w13.q.shape
    n, k = two_n // 2, 2 * half_k
    if n % 32 or k % 32:
        raise ValueError(f"decode='gluon_words' pads mxfp4 K and N to multiples of {STEP} by whole scale groups: K and "
                         f"N must be multiples of 32, got K {k}, N {n}")
    np_, kp = padded(n), padded(k)
    q13 = _pad_rows(torch.nn.functional.pad(w13.q, (0, (kp - k) // 2)), n, interleaved)
    s13 = _pad_rows(torch.nn.functional.pad(w13.scale[:, :, :k // 32], (0, (kp - k) // 32), value=127), n,
                    interleaved, 127)  # any byte: the padded codes are 0
    q2 = torch.nn.functional.pad(w2.q, (0, (np_ - n) // 2))
    s2 = torch.nn.functional.pad(w2.scale[:, :, :n // 32], (0, (np_ - n) // 32), value=127)
    return weight_args(q13, s13, None, 32), weight_args(q2, s2, None, 32)


def clear_padded() -> None:
    _KEPT.clear()
