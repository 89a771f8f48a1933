"""The lean launch (``triton_lean``) under Triton's interpreter: a plan's recorded launch sequence hands
the kernels what the ``BoundLaunch`` calls hand them (outputs equal bit for bit, call after call with
new tensors), at every alignment plan, with an expert map, biases, and above the pool's size (h and y
per call); and a sequence is rebuilt when what it recorded changes: a new weight tensor, new workspaces,
a retune, another thread (an in-place weight update keeps it: it records addresses, never values).
"""

from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import TOLERANCE as TOL, RacingDict, make_problem, rel_l2  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import clear_config_cache  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N = 8, 40, 24  # 16-byte weight rows in bf16: the TMA descriptor path runs
ALIGN_PLANS = {  # forced by the options where A allows it (M = 33, k = 2: A = 66)
    "single": {},
    "place": dict(align_small_max=0),
    "hist_place": dict(align_small_max=0, align_one_launch_max=0),
    "three": dict(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0),
}


def _lean():
    from moekit.experts import triton_lean

    return triton_lean


def _both(tri, problem, extra: dict | None = None, bound=None, **kwargs):
    """(lean, BoundLaunch calls) outputs of one problem; ``bound``: the latter, computed before for these very
    inputs (the BoundLaunch calls keep nothing: a repeat would only cost an interpreted call)."""
    extra = extra or {}
    lean = tri.experts_triton(*problem, options=LaunchOptions(lean_launch=True, **extra), **kwargs)
    if bound is None:
        bound = tri.experts_triton(*problem, options=LaunchOptions(lean_launch=False, **extra), **kwargs)
    return [lean, bound]


def _ref(problem, **kwargs):
    x, w13, w2, ids, weights = problem
    return experts_reference(x.double(), w13.double(), w2.double(), ids, weights, **kwargs)


@pytest.mark.parametrize("m, plan", [(1, "naive"), (8, "folded"), *((33, p) for p in ALIGN_PLANS)])
def test_lean_equals_bound_launches(interpreter, launched, m, plan):
    interpreter.clear_launch_caches()
    for seed in range(3):  # the first call compiles (no sequence yet), the next two launch from it
        problem = make_problem(m, 2, E, K, N, torch.bfloat16, seed=seed, skips=True)
        lean, bound = _both(interpreter, problem, ALIGN_PLANS.get(plan))
        assert torch.equal(lean, bound)
        assert rel_l2(lean, _ref(problem)) < TOL[torch.bfloat16]
    assert launched[0] == 2


def test_lean_with_map_and_biases(interpreter, launched):
    interpreter.clear_launch_caches()
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1], dtype=torch.int32)  # [12] global -> local
    g = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(E, 2 * N, generator=g).bfloat16(), torch.randn(E, K, generator=g).bfloat16()
    for seed in range(3):
        x, w13, w2, _, weights = make_problem(33, 2, E, K, N, torch.bfloat16, seed=seed)
        ids = torch.randint(-1, 12, (33, 2), generator=g, dtype=torch.int32)
        problem = (x, w13, w2, ids, weights)
        lean, bound = _both(interpreter, problem, expert_map=expert_map, b13=b13, b2=b2)
        assert torch.equal(lean, bound)
        want = _ref(problem, expert_map=expert_map, b13=b13.double(), b2=b2.double())
        assert rel_l2(lean, want) < TOL[torch.bfloat16]
    assert launched[0] == 2


def test_lean_above_pool_size(interpreter, launched, monkeypatch):
    """Above the pool's max_bytes h and y come from one fresh buffer per call, the rest stays pooled."""
    from moekit.experts.triton import _WORKSPACES

    interpreter.clear_launch_caches()
    three = ALIGN_PLANS["three"]
    problems = [make_problem(33, 2, E, K, N, torch.bfloat16, seed=s) for s in range(3)]
    pooled = [_both(interpreter, p, three)[1] for p in problems]
    interpreter.clear_launch_caches()
    launched[0] = 0
    monkeypatch.setattr(_WORKSPACES, "max_bytes", 1024)  # below h + y of A = 66
    for problem, want in zip(problems, pooled):
        lean, bound = _both(interpreter, problem, three)
        assert torch.equal(lean, want) and torch.equal(bound, want)
    assert launched[0] == 2
    h_and_y = 66 * (N + K) * 4  # float32 workspaces under the interpreter
    assert all(b.numel() < h_and_y for b in interpreter.held_workspaces().values())  # only the small regions kept


def _sequence_count() -> int:
    return len(_lean()._SEQUENCES)


def test_sequence_rebuilt_when_its_inputs_change(interpreter, launched):
    """A new weight tensor, new workspaces, a retune and another thread each get a sequence of their own; an
    in-place update keeps it (addresses, never values, are recorded); every output equals the BoundLaunch calls'."""
    from moekit.experts.triton import _WORKSPACES

    interpreter.clear_launch_caches()
    x, w13, w2, ids, weights = make_problem(33, 2, E, K, N, torch.bfloat16, seed=0)
    problem = (x, w13, w2, ids, weights)
    _, bound = _both(interpreter, problem)  # compiles
    lean, _ = _both(interpreter, problem, bound=bound)
    assert torch.equal(lean, bound) and _sequence_count() == 1
    recorded = next(iter(_lean()._SEQUENCES.values()))

    def check(problem, bound=None):
        lean, bound = _both(interpreter, problem, bound=bound)
        assert torch.equal(lean, bound)
        assert rel_l2(lean, _ref(problem)) < TOL[torch.bfloat16]
        return next(iter(_lean()._SEQUENCES.values()))

    w13.mul_(-0.5)  # in place: _version moves, the addresses stay: the same descriptors and sequence
    assert check(problem) is recorded
    new_w2 = w2.clone() * 2  # a new tensor of the same kind: same plan, new descriptors
    assert check((x, w13, new_w2, ids, weights)) is not recorded
    recorded = next(iter(_lean()._SEQUENCES.values()))
    bound = interpreter.experts_triton(x, w13, new_w2, ids, weights, options=LaunchOptions(lean_launch=False))
    _WORKSPACES.clear()  # the pool hands out other buffers: the recorded addresses are stale
    assert check((x, w13, new_w2, ids, weights), bound) is not recorded
    clear_config_cache()  # a retune: new plans, no sequence of the old ones left
    assert _sequence_count() == 0
    _both(interpreter, (x, w13, new_w2, ids, weights), bound=bound)  # the new plan's launches compile: no sequence yet
    check((x, w13, new_w2, ids, weights), bound)
    outs = []
    thread = threading.Thread(target=lambda: outs.append(_both(interpreter, (x, w13, new_w2, ids, weights),
                                                               bound=bound)))
    thread.start()
    thread.join()
    assert torch.equal(outs[0][0], outs[0][1]) and _sequence_count() == 2  # per (plan, thread)


def test_layers_of_one_shape_keep_their_sequences(interpreter, launched, monkeypatch):
    """Two weight sets of one shape (two layers of a model) share a plan but not their descriptors: each
    keeps its own sequence, recorded once, however the calls alternate; outputs equal the BoundLaunch calls'."""
    lean = _lean()
    records = [0]
    real = lean._record

    def record(*args):
        sequence = real(*args)
        records[0] += sequence is not None  # None: a launch not compiled yet (the first call)
        return sequence

    monkeypatch.setattr(lean, "_record", record)
    interpreter.clear_launch_caches()
    layers = [make_problem(8, 2, E, K, N, torch.bfloat16, seed=s) for s in range(2)]
    bounds = [None, None]
    for _ in range(3):
        for i, problem in enumerate(layers):
            got, bounds[i] = _both(interpreter, problem, bound=bounds[i])
            assert torch.equal(got, bounds[i])
            assert rel_l2(got, _ref(problem)) < TOL[torch.bfloat16]
    assert records[0] == 2 and _sequence_count() == 2


def test_lean_off_where_it_cannot_run(interpreter, launched):
    """Poisoned workspaces, no reuse, no cached launchers: the BoundLaunch calls, never a sequence."""
    interpreter.clear_launch_caches()
    problem = make_problem(8, 2, E, K, N, torch.bfloat16, seed=1)
    for off in (dict(poison_workspace=True), dict(reuse_workspace=False), dict(cached_launcher=False)):
        for _ in range(2):
            interpreter.experts_triton(*problem, options=LaunchOptions(**off))
    assert launched[0] == 0 and _sequence_count() == 0


def test_workspace_parts_pool_only_the_alignment():
    """Above the pool's size only the alignment's regions (and the counters) are kept; every other region
    (bf16's h and y, fp8's x_q and h_q, ...) is carved per call from one fresh buffer."""
    from moekit.experts.triton_cache import WorkspacePool, WorkspaceSpec

    i32 = torch.int32
    spec = WorkspaceSpec.of([("x_q", torch.uint8, (64, 256)), ("h_q", torch.uint8, (512, 128)),
                             ("y", torch.bfloat16, (512, 64)), ("sorted_ids", i32, (640,)), ("hist", i32, (4, 16))],
                            counters=8)
    parts = spec.parts()
    small, large = parts.pooled, parts.fresh
    assert small.names == ("sorted_ids", "hist") and small.counters == 8
    assert large.names == ("x_q", "h_q", "y") and large.counters == 0
    pool = WorkspacePool(max_bytes=4096)
    for _ in range(2):
        views = pool.buffers(spec, torch.device("cpu"))
        assert set(views) == {"x_q", "h_q", "y", "sorted_ids", "hist", "counters"}
        assert views["y"].shape == (512, 64) and views["counters"].eq(0).all()
    held = [b.numel() for b in pool.held().values()]
    assert len(held) == 1 and small.nbytes <= held[0] <= pool.max_bytes < large.nbytes  # the large regions never kept


def test_sequence_goes_with_its_weights(interpreter, launched):
    """A weight set's sequence (it holds the weights' descriptors, so their storage) goes when its w13 is
    freed: a model's dropped layers neither pile up in the sequences nor keep their weights' memory."""
    import gc

    interpreter.clear_launch_caches()
    x, w13, w2, ids, weights = make_problem(8, 2, E, K, N, torch.bfloat16, seed=3)
    for _ in range(2):  # the first call compiles, the second records
        interpreter.experts_triton(x, w13, w2, ids, weights)
    assert _sequence_count() == 1
    del w13, w2
    gc.collect()
    assert _sequence_count() == 0


def test_descriptors_follow_a_dtype_swap(interpreter, launched):
    """``.data`` swapped for a same-address view of another dtype (same shape, same version): the weights'
    descriptors are built again for the new dtype, so the call equals one on fresh tensors."""
    interpreter.clear_launch_caches()
    x, w13, w2, ids, weights = make_problem(8, 2, E, K, N, torch.bfloat16, seed=4)
    w13, w2 = torch.nn.Parameter(w13, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
    for _ in range(2):
        interpreter.experts_triton(x, w13, w2, ids, weights)
    x16 = x.view(torch.float16)
    w13.data, w2.data = w13.data.view(torch.float16), w2.data.view(torch.float16)
    got = interpreter.experts_triton(x16, w13, w2, ids, weights.half())
    fresh = interpreter.experts_triton(x16.clone(), w13.detach().clone(), w2.detach().clone(), ids, weights.half())
    assert torch.equal(got.isnan(), fresh.isnan()) and torch.equal(got.nan_to_num(), fresh.nan_to_num())


def test_eviction_survives_the_oldest_sequence_going_meanwhile(monkeypatch):
    """A sequence can go at any moment (its w13 freed: a weakref callback, no lock); evicting the oldest
    must not fail when it is already gone."""
    from types import SimpleNamespace

    lean = _lean()

    class Plan:  # hashable by identity, as a real plan
        workspace, descriptor_key = SimpleNamespace(nbytes=0), None

    monkeypatch.setattr(lean, "_SEQUENCES", RacingDict())
    monkeypatch.setattr(lean, "MAX_SEQUENCES", 1)
    monkeypatch.setattr(lean, "_record", lambda *args: lean.LaunchSequence([], None, None, None, None))
    pool = SimpleNamespace(max_bytes=1, pooled=lambda spec, device: {})
    for plan in (Plan(), Plan()):
        assert lean.lean_sequence(plan, pool, None, torch.device("cpu"), None, None, None, None, None) is not None
    assert len(lean._SEQUENCES) == 1


@pytest.mark.parametrize("addresses", [True, False])
def test_raw_sequence_hands_the_call_tensors_as_their_addresses(monkeypatch, addresses):
    """Every launch raw: the C launch gets each tensor of the call as its address (what Triton's launcher
    would read through data_ptr), ints (h, y) and None as they are, the templates untouched; a sequence with
    a launch that is not raw keeps the tensors (its launcher reads them itself)."""
    lean = _lean()
    from moekit import triton_bind

    monkeypatch.setattr(triton_bind, "PASS_ADDRESSES", addresses)
    monkeypatch.setattr(lean, "current_stream", lambda: 77)
    calls = []
    x, ids, weights, out = torch.ones(2, 4), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2), torch.empty(2, 4)
    values = (x, ids, weights, out, None, None, None, None, None, 4096, 8192)
    gate_up = [0, 1, 1, 0, "fn", False, True, None, None, "meta", None, None, None, None, 11, None, 12]  # x, ids, h
    down = [0, 1, 1, 0, "fn", False, True, None, None, "meta", None, None, None, None, None, None, 3]  # w, ids, y, out
    steps = [(lambda *a: calls.append(("gate_up", a)), gate_up, ((13, lean.X), (15, lean.IDS), (14, lean.H)), True),
             (lambda *a: calls.append(("down", a)), down, ((13, lean.WEIGHTS), (14, lean.IDS), (15, lean.Y),
                                                          (16, lean.OUT)), True)]
    sequence = lean.LaunchSequence(steps, None, None, None, None)
    sequence.launch(values)
    want = (lambda t: t.data_ptr()) if addresses else (lambda t: t)
    assert calls[0] == ("gate_up", (0, 1, 1, 77, "fn", False, True, None, None, "meta", None, None, None,
                                    want(x), 4096, want(ids), 12))
    assert calls[1] == ("down", (0, 1, 1, 77, "fn", False, True, None, None, "meta", None, None, None,
                                 want(weights), want(ids), 8192, want(out)))
    assert gate_up[13] is None and down[16] == 3  # the templates are copied, never filled in place
    mixed = lean.LaunchSequence([steps[0], (lambda *a: calls.append(("runner", a)), [None, None], ((0, lean.X),),
                                            False)], None, None, None, None)
    mixed.launch(values)
    assert calls[2][1][13] is x and calls[3] == ("runner", (x, None))


def test_raw_sequence_with_the_callers_stream_and_addresses_launches_the_same():
    """A sequence of raw launches (fake C launches here) handed the stream and x's, ids' and weights' addresses
    (``triton_fast.run_fast`` reads them for its checks) passes the C launches what it passes reading them itself:
    the same grid, stream and addresses, out's own address."""
    lean = _lean()
    seen = []

    def c_launch(*args):
        seen.append(args)

    # [grid x3, stream, function, cooperative, pdl, 6 objects, x, ids, weights, out, a constant]
    template = [2, 1, 1, 0, "fn", False, True, None, None, "meta", None, None, None, None, None, None, None, 5]
    slots = ((13, lean.X), (14, lean.IDS), (15, lean.WEIGHTS), (16, lean.OUT))
    sequence = lean.LaunchSequence([(c_launch, template, slots, True), (c_launch, template, slots[1:], True)],
                                   None, None, None, None)
    assert sequence.addressed == (lean.X, lean.IDS, lean.WEIGHTS, lean.OUT)
    x, ids, weights = torch.ones(3, 8), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    pointers = (x.data_ptr(), ids.data_ptr(), weights.data_ptr())
    original = lean.current_stream
    lean.current_stream = lambda: 7
    try:
        out = lean.launch_lean(sequence, x, ids, weights, None, None, None, None, None)
        lean.current_stream = None  # not read where the caller hands the stream over
        given = lean.launch_lean(sequence, x, ids, weights, None, None, None, None, None, 7, pointers)
    finally:
        lean.current_stream = original
    assert len(seen) == 4 and seen[0][:16] == seen[2][:16] and seen[1][:16] == seen[3][:16]
    assert seen[0][3] == 7 and seen[0][13:16] == pointers and seen[1][13] is None and seen[1][14:16] == pointers[1:]
    assert (seen[0][16], seen[1][16], seen[2][16], seen[3][16]) == (out.data_ptr(),) * 2 + (given.data_ptr(),) * 2
    assert seen[0][17] == seen[3][17] == 5 and template[13:17] == [None] * 4  # the template itself untouched
