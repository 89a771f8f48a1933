"""The cells of ``bounds_device_check.py``: one call's bytes read by a pure-read launch, chains of dependent read
launches, torch's own reads, and moekit's experts call / layer on the same routing, each a list of zero-argument
calls over rotated input sets (so the graph replays stream from HBM, not L2), timed by ``GraphTimer``.

Shapes: E experts, N intermediate, K hidden, k slots, M tokens, S experts one set touches, W words an expert row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

import bounds_kernels as bk

ROTATION_BYTES = 256 << 20  # at least this many distinct bytes over a cell's sets (the H200's L2 is 50 MB)
MAX_SETS = 8
PAD_WORDS = 4096  # a part's words rounded up to this (16 KB): <= 0.5% more than the real bytes at every cell here


@dataclass(frozen=True)
class Parts:
    """Bytes of one expert as the experts kernels stream them."""

    gate_up: int  # w13 (+ its scales / zero points)
    down: int  # w2 (+ its scales / zero points)

    @property
    def words13(self) -> int:
        return _padded_words(self.gate_up)

    @property
    def words2(self) -> int:
        return _padded_words(self.down)


def _padded_words(nbytes: int) -> int:
    return -(-nbytes // (4 * PAD_WORDS)) * PAD_WORDS


def parts_of(fmt: str, n: int, k: int) -> Parts:
    """bf16: 2 bytes a weight; fp8: e4m3 + fp32 128 x 128 block scales; int4: packed codes + fp32 scale and uint8
    zero per 128 along the reduction dim (moekit's layouts; their ``nbytes_per_expert``)."""
    if fmt == "bf16":
        return Parts(2 * n * k * 2, k * n * 2)
    if fmt == "fp8":
        return Parts(2 * n * k + 4 * math.ceil(2 * n / 128) * math.ceil(k / 128),
                     k * n + 4 * math.ceil(k / 128) * math.ceil(n / 128))
    if fmt == "int4":
        return Parts(2 * n * math.ceil(k / 2) + 5 * 2 * n * math.ceil(k / 128),
                     k * math.ceil(n / 2) + 5 * k * math.ceil(n / 128))
    raise ValueError(f"fmt must be bf16, fp8 or int4, got {fmt!r}")


@dataclass
class ReadSets:
    """The experts each rotated set reads, placed in a pool of slabs: set i reads rows ids[i] (random rows of the
    pool, as routing scatters them); torch's peers read the same number of rows as one contiguous run."""

    slabs: torch.Tensor  # [sum S_i, W] int32, random words
    ids: list[torch.Tensor]  # per set [S_i] int32 on the device
    runs: list[tuple[int, int]]  # per set (first row, S_i): the contiguous rows torch's peers read
    parts: Parts
    gate: torch.Tensor  # [1, E·K/2] int32: the gate weight's words (bf16 [E, K]), which a chain's gate stage reads
    folds: dict = field(default_factory=dict)  # (set, first, words) -> ``xor_of``, computed once (700 MB at DS-V3)

    @property
    def touched(self) -> list[int]:
        return [int(t.numel()) for t in self.ids]


def read_sets(touched: list[int], parts: Parts, gate_words: int, dev, seed: int = 0) -> ReadSets:
    rows = sum(touched)
    g = torch.Generator(device=dev).manual_seed(seed)
    slabs = torch.randint(-2**31, 2**31 - 1, (rows, parts.words13 + parts.words2), generator=g, device=dev,
                          dtype=torch.int32)
    if gate_words % GATE_READ.block:
        raise ValueError(f"gate words {gate_words} is not a multiple of {GATE_READ.block}")
    gate = torch.randint(-2**31, 2**31 - 1, (1, gate_words), generator=g, device=dev, dtype=torch.int32)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    starts = np.cumsum([0] + touched[:-1]).tolist()
    ids = [perm[s:s + t].to(dev) for s, t in zip(starts, touched)]
    return ReadSets(slabs, ids, list(zip(starts, touched)), parts, gate)


def num_sets(bytes_per_call: float) -> int:
    return max(2, min(MAX_SETS, math.ceil(ROTATION_BYTES / max(bytes_per_call, 1))))


def xor_of(rs: ReadSets, i: int, first: int, words: int) -> int:
    """Every word set i reads in [first, first + words) of its rows, folded by xor (on the host)."""
    key = (i, first, words)
    if key not in rs.folds:
        rows = rs.slabs[rs.ids[i].long(), first:first + words]
        rs.folds[key] = int(np.bitwise_xor.reduce(rows.cpu().numpy().reshape(-1)))
    return rs.folds[key]


def fold(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().numpy().reshape(-1)))


@dataclass(frozen=True)
class Config:
    """A one-launch read: chunk words, warps, programs (per SM; 0: one program per 2 chunks), Triton stages (the loop
    compiles to the same loads at 1 and 3 stages on Triton 3.6 and 3.9, sm_90: four ld.global.v4 a thread a chunk at
    2048 words and 4 warps, no cp.async; so the sweep keeps 1)."""

    block: int
    warps: int
    per_sm: int
    stages: int = 1
    tma: int = 0  # > 0: the TMA read, boxes [block / tma, tma] (no PDL, no dependency: one-launch reads only)

    @property
    def name(self) -> str:
        g = f"{self.per_sm}/SM" if self.per_sm else "all"
        return f"b{self.block} w{self.warps} {g}" + (f" s{self.stages}" if self.stages > 1 else "") + (
            f" tma[{self.block // self.tma},{self.tma}]" if self.tma else "")

    def plan(self, first: int, words: int, touched: int, sms: int, **launch) -> bk.ReadPlan:
        chunks = touched * words // self.block
        programs = sms * self.per_sm if self.per_sm else -(-chunks // 2)
        return bk.ReadPlan(first, words, self.block, max(1, min(programs, chunks)), self.warps, self.stages,
                           tma=self.tma, **launch)


# Run 1 (091ac29) swept chunks of 1024 / 2048 / 4096 words, 4 / 8 warps, 1 / 2 / 4 / 8 programs an SM or one per
# 2 chunks, and TMA boxes at 4 / 8 / all: 1-2 programs an SM were 1.3-4x slower everywhere and 1024-word chunks
# never the best, so the sweep keeps the rest (fewer compiles and graphs in the 150 s of the merged call).
SWEEP = [Config(b, w, g) for b in (2048, 4096) for w in (4, 8) for g in (4, 8, 0)] + [
    Config(b, 4, 0, tma=256) for b in (2048, 4096)]
SMOKE_SWEEP = [Config(1024, 4, 1), Config(2048, 4, 0), Config(2048, 4, 1, tma=256)]


@dataclass
class Variant:
    """Zero-argument calls, one per rotated set, and a check of what set 0's call produced."""

    name: str
    kind: str  # "read1" (one launch), "chain", "torch", "ours", "layer"
    fns: list
    check: object = None  # () -> str: "PASS" or "FAIL ..." (run after fns[0]())
    per_graph: int = 0  # how it is timed: QUEUED, ANALYZE_WAY or BENCH_WAY (``GraphTimer``)
    samples: list = field(default_factory=list)  # µs per call, one a timed round
    status: str = ""  # the check's verdict ("PASS ...", "FAIL ...", "error: ...")
    us: float | None = None  # median of samples; None: not timed
    config: Config | None = None  # read1 variants: the launch they time


def read1(rs: ReadSets, cfg: Config, sms: int, pdl: bool = False, part: str = "") -> Variant:
    """The whole rows [0, W) in one launch; pdl: launched with PDL, waiting before its first load (as ours); part
    "gate-up" / "down": that part of each row alone (what each of ours' two GEMMs streams)."""
    first, words = {"": (0, rs.parts.words13 + rs.parts.words2), "gate-up": (0, rs.parts.words13),
                    "down": (rs.parts.words13, rs.parts.words2)}[part]
    launch = dict(pdl=True, wait=1, signal=2) if pdl else {}
    plans = [cfg.plan(first, words, t, sms, **launch) for t in rs.touched]
    outs = [torch.zeros(p.programs, dtype=torch.int32, device=rs.slabs.device) for p in plans]
    fns = [lambda i=i: bk.launch_read(rs.slabs, rs.ids[i], plans[i], outs[i]) for i in range(len(plans))]
    want = xor_of(rs, 0, first, words)
    check = lambda: "PASS" if fold(outs[0]) == want else f"FAIL (xor {fold(outs[0])} != {want})"  # noqa: E731
    name = cfg.name + (" pdl" if pdl else "") + (f", {part} part only" if part else "")
    return Variant(name, "part" if part else "read1", fns, check, config=cfg)


@dataclass(frozen=True)
class Chain:
    """A dependency chain of launches: [gate] -> gate-up read -> down read (reads the gate-up launch's words) ->
    [k-sum] (reads the down launch's words); PDL on every launch after the first (or none). The gate stage reads
    the gate weight's words and writes the ids the reads take (``bounds_kernels``: a lower bound of gate + router)."""

    name: str
    pdl: bool = True
    early: bool = False  # the gate-up read signals its dependents at its start (else after its stream)
    down_wait_last: bool = False  # the down read streams before its PDL wait (the loosest legal dependency)
    ksum: bool = False
    gate: bool = False
    whole: bool = False  # one read of gate-up and down parts together (the experts in one launch) after the gate


def timed_as(v: Variant, per_graph: int) -> Variant:
    """The same calls (and buffers) timed another way."""
    return Variant(v.name, v.kind, v.fns, v.check, per_graph, config=v.config)


CHAINS = [Chain("2 launches, no PDL", pdl=False), Chain("2 launches, PDL"), Chain("2, PDL, signal early", early=True),
          Chain("2, PDL, down waits last", early=True, down_wait_last=True),
          Chain("3 launches (+k-sum), PDL", ksum=True), Chain("3, PDL, down waits last", early=True,
                                                                      down_wait_last=True, ksum=True),
          Chain("3 launches, no PDL", pdl=False, ksum=True), Chain("gate + 1, PDL", gate=True, whole=True),
          Chain("gate + 2, PDL", gate=True), Chain("gate + 2, PDL, down waits last", early=True,
                                                                    down_wait_last=True, gate=True),
          Chain("gate + 3, PDL", ksum=True, gate=True), Chain("gate + 3, no PDL", pdl=False, ksum=True, gate=True)]
# The chains of each length, best taken: the experts need >= 2 dependent launches (gate-up, down; the k-sum folds into
# down), the layer >= 3 (gate + router, gate-up, down). "down waits last" is legal for the hardware: the down step's
# weights depend on nothing the gate-up step writes (a kernel could stage them in SMEM / L2 before its wait).
LENGTHS = {"2 launches": ("2 launches, PDL", "2, PDL, signal early", "2, PDL, down waits last"),
           "3 launches": ("3 launches (+k-sum), PDL", "3, PDL, down waits last"),
           "gate + 1": ("gate + 1, PDL",), "gate + 2": ("gate + 2, PDL", "gate + 2, PDL, down waits last"),
           "gate + 3": ("gate + 3, PDL",)}
NEEDED = {"experts": "2 launches", "layer": "gate + 2"}
GATE_READ = Config(1024, 4, 0)  # the gate stage: 512 KB at Qwen3, 64 KB at Mixtral; one program per 2 chunks


@dataclass
class ChainBuffers:
    """What one set's chain writes (allocated once, outside the graph)."""

    ids: torch.Tensor  # [S] int32: the gate stage's copy of the set's ids, which the reads take after it
    parts_g: torch.Tensor  # the gate stage's words
    parts13: torch.Tensor
    parts2: torch.Tensor
    y: torch.Tensor  # [M·k, K] bf16, the k-sum's input
    out: torch.Tensor  # [M, K] bf16


def chain(rs: ReadSets, cfg: Config, c: Chain, sms: int, gate_io: list) -> Variant:
    """gate_io[i]: (x [M, K], k) of set i (the k-sum's shapes)."""
    p, dev = rs.parts, rs.slabs.device
    first = dict(pdl=c.pdl, wait=int(c.pdl), signal=(1 if c.early else 2) if c.pdl else 0)
    second = dict(pdl=c.pdl, wait=(2 if c.down_wait_last else 1) if c.pdl else 0, signal=2 if c.pdl else 0)
    g_plan = GATE_READ.plan(0, rs.gate.shape[1], 1, sms, signal=2 if c.pdl else 0)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    plans, bufs = [], []
    for i, t in enumerate(rs.touched):
        x, top_k = gate_io[i]
        a = cfg.plan(0, p.words13 + p.words2 if c.whole else p.words13, t, sms, **first)
        plans.append((a, cfg.plan(p.words13, p.words2, t, sms, **second)))
        i32 = dict(dtype=torch.int32, device=dev)
        bufs.append(ChainBuffers(rs.ids[i].clone(), torch.zeros(g_plan.programs, **i32),
                                 torch.zeros(a.programs, **i32), torch.zeros(plans[-1][1].programs, **i32),
                                 torch.zeros(x.shape[0] * top_k, x.shape[1], dtype=torch.bfloat16, device=dev),
                                 torch.zeros_like(x)))

    def run(i: int) -> None:
        b, (a, d) = bufs[i], plans[i]
        ids = rs.ids[i]
        if c.gate:
            bk.launch_read(rs.gate, zero, g_plan, b.parts_g, copy=(rs.ids[i], b.ids))
            ids = b.ids
        bk.launch_read(rs.slabs, ids, a, b.parts13)
        if not c.whole:
            bk.launch_read(rs.slabs, ids, d, b.parts2, dep=b.parts13)
        if c.ksum:
            bk.launch_ksum(b.y, b.out, b.parts2, gate_io[i][1], wait=c.pdl, pdl=c.pdl)

    def check() -> str:
        b, (a, d) = bufs[0], plans[0]
        ok = fold(b.parts13) == xor_of(rs, 0, 0, a.words)
        if not c.whole:
            dep = b.parts13.cpu().numpy()
            seen = int(np.bitwise_xor.reduce(dep[np.arange(d.programs) % len(dep)]))  # the words each program read
            want = xor_of(rs, 0, p.words13, p.words2) ^ seen
            ok = ok and fold(b.parts2) == want
        if c.gate:
            ok = ok and fold(b.parts_g) == fold(rs.gate) and bool(torch.equal(b.ids, rs.ids[0]))
        if c.ksum:
            ok = ok and bool(torch.equal(b.out, bk.ksum_torch(b.y, gate_io[0][1], b.parts2)))
        return "PASS" if ok else "FAIL (chain words, ids or k-sum differ)"

    return Variant(c.name, "chain", [lambda i=i: run(i) for i in range(len(plans))], check)


def torch_peers(rs: ReadSets) -> list[Variant]:
    """torch's own reads of the same number of expert rows (one contiguous run a set): ``.sum()`` and a copy (which
    also writes them: twice the traffic, for reference)."""
    words = rs.parts.words13 + rs.parts.words2
    view = rs.slabs.view(torch.bfloat16)  # [rows, 2W]: the sum reads bytes, whatever they encode
    dst = torch.empty(max(rs.touched), 2 * words, dtype=torch.bfloat16, device=rs.slabs.device)
    sums = [lambda s=s, t=t: view[s:s + t].sum(dtype=torch.float32) for s, t in rs.runs]
    copies = [lambda s=s, t=t: dst[:t].copy_(view[s:s + t]) for s, t in rs.runs]
    return [Variant("torch .sum()", "torch", sums, lambda: "PASS"), Variant("torch copy (2x bytes)", "torch", copies,
                                                                             lambda: "PASS")]


QUEUED, ANALYZE_WAY, BENCH_WAY = 0, 1, 2
WAYS = {QUEUED: "", ANALYZE_WAY: " [analyze's way]", BENCH_WAY: " [bench's way]"}


class GraphTimer:
    """``fns`` captured once in a CUDA graph and replayed; ``sample()`` gives µs per call.
    - QUEUED: every fn in the graph, REPLAYS_S worth of replays back to back between two events (the GPU never waits
      for the host: the calls' own cost, as a decode step's graph of many layers sees it);
    - ANALYZE_WAY: fns[0] alone, one replay between two events on an idle GPU, as ``moekit.bench.timing`` times the
      layer's graph for ``moekit analyze --measure`` (issue 13 item 4's number): the graph's launch latency included;
    - BENCH_WAY: every fn in the graph, one replay on an idle GPU, as ``moekit bench`` times a cell (issues 15, 16,
      19): the launch latency shared by the sets."""

    REPLAYS_S = 2e-3

    def __init__(self, fns: list, per_graph: int = QUEUED):
        fns = fns[:1] if per_graph == ANALYZE_WAY else fns
        self.calls = len(fns)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for fn in fns:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for fn in fns:
                fn()
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        once = self._time(1, queued=False)
        self.replays = 1 if per_graph != QUEUED else max(1, min(200, int(self.REPLAYS_S / max(once, 1e-7))))

    def _time(self, replays: int, queued: bool) -> float:
        """Seconds a replay; queued: one untimed replay first, so the timed ones start with work ahead of them."""
        torch.cuda.synchronize()
        if queued:
            self.graph.replay()
        self.start.record()
        for _ in range(replays):
            self.graph.replay()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3 / replays

    def sample(self) -> float:
        if self.replays == 1:
            return float(np.median([self._time(1, queued=False) for _ in range(15)])) * 1e6 / self.calls
        return self._time(self.replays, queued=True) * 1e6 / self.calls
