"""What training adds to ``EPMoE``: the aux loss of the whole group's batch (with ``dp_group`` set: of the global batch,
every EP group's data-parallel replicas' too), the group the bias update sums its counts over, and ``sync_grads``.

    [forward: this rank's tokens] -> aux loss: this rank's part (counts all_reduced) -> backward -> sync_grads
      -> optimizer step -> update_correction_bias_(counts summed by ``batch_total``)

A mixin of ``EPMoE`` (``moekit.parallel.layer``), which holds ``group``, ``world_size`` and ``config``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.losses import Across, configured_aux_loss
from moekit.parallel.grad_sync import GradSync, sync_grads
from moekit.routing.routed import RoutedTokens


class EPTraining:
    """``EPMoE``'s training pieces (see the module docstring)."""

    _dp_group: dist.ProcessGroup | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Data-parallel replicas of this EP group (EP x DP), set by the training loop (``ep.dp_group = dp``), None:
        none. With it the aux loss is the global batch's: its counts summed over the EP group, then over dp_group (two
        all_reduces of E + 2 values a forward), this rank's part scaled by W * D; pass the same group to sync_grads."""
        return self._dp_group

    @dp_group.setter
    def dp_group(self, group: dist.ProcessGroup | None) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):  # else met at the next forward's all_reduce
            raise TypeError(f"dp_group must be a torch.distributed ProcessGroup (the data-parallel replicas of this EP "
                            f"group) or None, got {group!r}")
        self._dp_group = group

    def sync_grads(self, dp_group: dist.ProcessGroup | None = None, agree: bool = True) -> GradSync:
        """After backward, before the optimizer step: every gradient of this layer averaged over the ranks (EPLB's
        replicas summed first), a single process's on every rank's batch, as DDP averages
        (``moekit.parallel.grad_sync``); ``moekit.parallel.sync_grads(model)`` does a whole model's, its layers and
        the parameters around them, in the same collectives. ``dp_group``: data-parallel replicas of this EP group;
        ``agree=False``: no host sync (see ``moekit.parallel.grad_sync.sync_grads``)."""
        return sync_grads(self, dp_group, agree)

    def batch_total(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` summed over the ranks whose tokens form the batch: the group, then ``dp_group`` where set
        (all_reduce, no autograd). Collective. ``update_correction_bias_`` sums a forward's counts with it, so every
        rank's bias moves as one layer's on all the tokens would (and stays equal on every rank); EPLB's loads too,
        so data-parallel replicas compute the same placement."""
        total = t.detach().clone()
        dist.all_reduce(total, group=self.group)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return total

    def _aux_loss(self, routed: RoutedTokens, seq_len: int) -> torch.Tensor | None:
        """This rank's part of the aux loss of every rank's tokens as one batch (the EP group's, times its DP replicas'
        with ``dp_group``): the mean over all those ranks is that loss (``moekit.losses.Across``: the counts
        all_reduced; the forward's agreement says it follows)."""
        replicas = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        return configured_aux_loss(self.config, routed.router_logits, routed.selected_ids, seq_len,
                                   across=Across(self.batch_total, self.world_size * replicas))
