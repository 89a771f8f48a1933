"""A training step's inputs and gradients for the experts-backward device checks (``vbw48``, ``auto49``): a layer
(E, top_k, K, N, activation, biases) -> bf16 inputs by name; one step through an experts function -> the gradient of
every input it has.

    p = layer_inputs((8, 4, 2880, 2880, spec, True), m=256, dev=dev, seed=1)
    grads = step_grads(backend_fn("triton", dev), spec, p)       # {"x": ..., "w13": ..., ..., "b2": ...}

Also the helpers trn50's and trn51's checks share: ``check_device``, ``grads_apart``, ``auto_pick``, ``sync``,
``free``.

Shapes: M tokens, K hidden, N expert intermediate, E experts, k = top_k.
"""

from __future__ import annotations

import torch

NAMES = ("x", "w13", "w2", "topk_weights", "b13", "b2")  # the inputs a step differentiates (biases where present)


def layer_inputs(layer: tuple, m: int, dev, seed: int) -> dict:
    """The inputs by name: x [M, K], w13 [E, 2N, K], w2 [E, K, N], b13 [E, 2N], b2 [E, K] bf16 (biases None where
    the layer has none), topk_weights [M, k] float32 softmax, ids [M, k] int32 (k distinct experts), dout [M, K]."""
    e, top_k, k, n, _, biases = layer
    g = torch.Generator(device=dev).manual_seed(seed)
    return {
        "x": torch.randn(m, k, generator=g, device=dev).bfloat16(),
        "w13": (torch.randn(e, 2 * n, k, generator=g, device=dev) * k**-0.5).bfloat16(),
        "w2": (torch.randn(e, k, n, generator=g, device=dev) * n**-0.5).bfloat16(),
        "topk_weights": torch.softmax(torch.rand(m, top_k, generator=g, device=dev), dim=1),
        "b13": (torch.randn(e, 2 * n, generator=g, device=dev) * 0.1).bfloat16() if biases else None,
        "b2": (torch.randn(e, k, generator=g, device=dev) * 0.1).bfloat16() if biases else None,
        "ids": torch.rand(m, e, generator=g, device=dev).argsort(dim=1)[:, :top_k].int(),
        "dout": torch.randn(m, k, generator=g, device=dev).bfloat16(),
    }


def step_grads(fn, activation, p: dict, dtype=None) -> dict:
    """One training step through experts function ``fn`` (forward + ``torch.autograd.grad`` of dout): name -> the
    gradient of every input ``p`` has, the inputs cast to ``dtype`` first (topk_weights kept float32)."""
    leaves = {n: None if p[n] is None else (p[n] if dtype is None or n == "topk_weights" else p[n].to(dtype))
              .detach().requires_grad_() for n in NAMES}
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], p["ids"], leaves["topk_weights"], activation=activation,
             b13=leaves["b13"], b2=leaves["b2"])
    wanted = [n for n in NAMES if leaves[n] is not None]
    grads = torch.autograd.grad(out, [leaves[n] for n in wanted], p["dout"].to(out.dtype))
    return dict(zip(wanted, grads))


def grads_apart(got: dict, want: dict) -> dict:
    """name -> ``bench_run.rel_l2`` of ``got[name]`` against ``want[name]``, for each name of ``want``."""
    from bench_run import rel_l2

    return {n: rel_l2(got[n], want[n]) for n in want}


def auto_pick(dev, p: dict, m: int) -> str:
    """The backend ``backend="auto"`` as committed trains a plain silu call of ``p``'s shapes with ``m`` tokens on."""
    from moekit.experts import backend_fn, resolve_backend
    from moekit.experts.auto_train import auto_choice_of

    choice = auto_choice_of(backend_fn("auto", dev))
    x_leaf = p["x"].detach().requires_grad_()  # a call that records gradients
    return resolve_backend("auto", dev) if choice is None else choice.pick(
        x_leaf, p["w13"], p["w2"], p["topk_weights"], "silu", None, None, m)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def check_device(smoke: bool) -> torch.device:
    """CUDA; a smoke run's CPU with "auto" given CUDA's order (its inference pick the interpreted triton), so
    ``auto_pick`` meets the dispatcher there too."""
    if not smoke:
        return torch.device("cuda")
    import moekit.experts

    moekit.experts._AUTO_ORDER_OTHER = ("triton", "grouped_mm", "reference")
    return torch.device("cpu")
