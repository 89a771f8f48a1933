"""``triton_fast.JointCall`` (``moekit.layer_fast``: the gate + router launch in the experts' one C call) without a
GPU: the C module of ``moekit.batch_launch`` pointed at the recording stand-in driver of ``test_batch_launch``. The
lead launch goes first with the call's x in its x slots and its kept pointers as recorded, then the sequence's
launches as the sequence alone passes them; a new sequence object is joined again; an unbatched one hands back."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import torch

import moekit.batch_launch as bl
import moekit.experts.triton_lean as lean
from moekit.experts.triton_fast import JointCall, KeptCall
from moekit.triton_bind import LEAD_AUX, LEAD_X
from test_batch_launch import PDL, Driver, _template, mod  # noqa: F401  (mod: the fixture)


def _lead(function: int):
    """A stand-in BoundLaunch already compiled to a raw launch: grid (4, 1, 1), 4 warps, tail (scalar 7, fp32 2.5)."""
    raw = SimpleNamespace(grid=(4, 1, 1), desc_positions=(), function=function, cooperative=False, pdl=False,
                          metadata=(4, 1, 0), c_launch=None, hooks=None)
    return SimpleNamespace(_raw=raw, tail=(7, 2.5))


def _sequence(function: int) -> lean.LaunchSequence:
    template = _template(function, (2, 1, 1), 8, 0, False, True, [lean._Slot(lean.X), lean._Slot(lean.OUT), 9])
    return lean.LaunchSequence([(None, template, ((13, lean.X), (14, lean.OUT)), True)], None, None, None, None)


class Kept:
    def __init__(self, sequence):
        self.seq, self.stream = sequence, 66

    def sequence(self, w13, w2, b13=None, b2=None):
        return self.seq


def test_lead_then_sequence_in_one_call(mod, monkeypatch):  # noqa: F811
    monkeypatch.setattr(bl, "module", lambda: mod)
    monkeypatch.setattr(lean, "BATCHED", True)
    bl.register(0x7000, "lead", ["*bf16", "*bf16", "*fp32", "i32", "fp32"], None)
    bl.register(0x8000, "gemm", ["*bf16", "*bf16", "i32"], None)
    weight, logits = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
    kept = Kept(_sequence(0x8000))
    joint = JointCall(kept, ((_lead(0x7000), (LEAD_X, weight, logits)),))
    driver = Driver({0x7000: [8, 8, 8, 4, 4, 8, 8], 0x8000: [8, 8, 4, 8, 8]})
    driver.install(mod)
    x, ids, weights = torch.ones(8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), torch.zeros(2)
    out = joint(x, None, None, ids, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    lead, gemm = driver.launches
    assert lead["function"] == 0x7000 and lead["grid"] == (4, 1, 1) and lead["block"] == (128, 1, 1)
    assert lead["stream"] == 66 == gemm["stream"] and lead["attrs"] == [] and gemm["attrs"] == [(PDL, 1)]
    assert lead["params"][:5] == [struct.pack("<Q", x.data_ptr()), struct.pack("<Q", weight.data_ptr()),
                                  struct.pack("<Q", logits.data_ptr()), struct.pack("<i", 7), struct.pack("<f", 2.5)]
    assert gemm["params"][:3] == [struct.pack("<Q", x.data_ptr()), struct.pack("<Q", out.data_ptr()),
                                  struct.pack("<i", 9)]
    kept.seq = _sequence(0x8000)  # re-recorded (a pool or weight change): joined again, the same launches
    driver.launches.clear()
    out2 = joint(x, None, None, ids, weights)
    assert [d["function"] for d in driver.launches] == [0x7000, 0x8000] and joint.sequence is kept.seq
    assert driver.launches[1]["params"][1] == struct.pack("<Q", out2.data_ptr())
    monkeypatch.setattr(lean, "BATCHED", False)
    kept.seq = _sequence(0x8000)  # not batched: the caller launches step by step
    assert kept.seq.batch is None and joint(x, None, None, ids, weights) is None
    kept.seq = None  # the kept call misses
    assert joint(x, None, None, ids, weights) is None


def test_two_leads_and_the_calls_aux_tensor(mod, monkeypatch):  # noqa: F811
    """``layer_hash_fast``'s join: two lead launches in order (the gate, then the hash router), the second reading
    the call's ``aux`` tensor (its token ids, ``LEAD_AUX``) at its position, a new aux per call; then the sequence."""
    monkeypatch.setattr(bl, "module", lambda: mod)
    monkeypatch.setattr(lean, "BATCHED", True)
    bl.register(0x7000, "gate", ["*bf16", "*bf16", "*fp32", "i32", "fp32"], None)
    bl.register(0x7100, "route", ["*fp32", "*i64", "*i32", "i32", "fp32"], None)
    bl.register(0x8000, "gemm", ["*bf16", "*bf16", "i32"], None)
    weight, logits, table = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    kept = Kept(_sequence(0x8000))
    joint = KeptCall(None, None, 66).joined(_lead(0x7000), (LEAD_X, weight, logits),
                                            ((_lead(0x7100), (logits, LEAD_AUX, table)),))
    joint.kept = kept  # the stand-in's sequence (a KeptCall's is its memo's)
    driver = Driver({0x7000: [8, 8, 8, 4, 4, 8, 8], 0x7100: [8, 8, 8, 4, 4, 8, 8], 0x8000: [8, 8, 4, 8, 8]})
    driver.install(mod)
    x, ids, weights = torch.ones(8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), torch.zeros(2)
    for step in range(2):
        token_ids = torch.arange(2 + step)  # a new tensor each call
        driver.launches.clear()
        out = joint(x, None, None, ids, weights, aux=token_ids)
        gate, route, gemm = driver.launches
        assert [gate["function"], route["function"], gemm["function"]] == [0x7000, 0x7100, 0x8000]
        assert gate["params"][0] == struct.pack("<Q", x.data_ptr())
        assert route["params"][:3] == [struct.pack("<Q", logits.data_ptr()), struct.pack("<Q", token_ids.data_ptr()),
                                       struct.pack("<Q", table.data_ptr())]
        assert gemm["params"][1] == struct.pack("<Q", out.data_ptr())
