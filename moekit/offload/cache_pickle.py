"""An ``ExpertCache`` through pickle, so ``torch.save(model)`` / ``torch.load(..., weights_only=False)`` of a whole
model holding ``OffloadedMoE`` layers (and ``copy.deepcopy``) round-trip.

    saved:  slots, device, policy name, each layer's host blocks [E, B_g] uint8, the layout, tensor-free templates
    loaded: a new cache of the same slots, device and policy, every layer registered again from its blocks, in order

The host store travels as its byte blocks alone: the parts are typed views over them, and ``torch.save`` refuses
one storage viewed as several dtypes ("Cannot save multiple tensors or storages that view the same data as
different types"). Nothing device-side travels: the slots, the copy stream and the events are made again, so the
loaded cache holds no expert (the first forward fetches, as a new cache's) and host blocks are pinned again where
the device is CUDA. The running ``stats`` carry over.
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.offload.parts import ExpertWeights
from moekit.quant import QuantizedWeight


class PicklableCache:
    """``ExpertCache``'s pickled state (the module docstring)."""

    def __getstate__(self) -> dict:
        host = self._layers[0] if self._layers else None
        templates = None if host is None else ExpertWeights({}, _meta(host.w13_template), _meta(host.w2_template))
        return {"cache_experts": self.cache_experts, "device": self.device, "policy": self.policy.name,
                "layout": self._layout, "host_blocks": self._host_blocks, "templates": templates,
                "stats": self.stats}

    def __setstate__(self, state: dict) -> None:
        fresh = type(self)(state["cache_experts"], device=state["device"], policy=state["policy"])
        for blocks in state["host_blocks"]:  # layer ids in the order they were registered
            fresh.register(*state["templates"].rebuild(state["layout"].typed(blocks)))
        fresh.stats = state["stats"]
        self.__dict__.update(fresh.__dict__)


def _meta(template: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """A weight with its tensors on the meta device: its scheme, options, shapes and dtypes, no data (``rebuild``
    takes the tensors from the parts)."""
    if isinstance(template, QuantizedWeight):
        return dataclasses.replace(template, **{k: t.to("meta") for k, t in template.tensors().items()})
    return template.to("meta")
