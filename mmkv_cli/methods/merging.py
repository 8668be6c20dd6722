"""KV merged into the entries that stand for it, shared by several methods (CausalMem's frame
backgrounds, FluxMem's and SAVEMem's part anchors): no method imports another's."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch


@dataclass
class SlotMeans:
    """Entries folded into slots: gone [g] the joining entries' places in the cache, group_of [g]
    the group each joins, slots [f] each group's place, before [f] how many tokens the slot
    already averages (0: it takes the mean of what joins alone), counts [f] how many join.
    Indices stay on the host; each K or V goes to the device once, with no wait."""

    group_of: torch.Tensor
    gone: torch.Tensor
    slots: torch.Tensor
    before: torch.Tensor
    counts: torch.Tensor

    def __call__(self, held: torch.Tensor) -> torch.Tensor:
        """[H, n, D] with every slot the count-weighted mean of what it held and what joins it."""
        on = held.device
        joining = held[:, self.gone.to(on, non_blocking=True)].float()
        sums = torch.zeros(held.shape[0], len(self.counts), held.shape[2], device=on)
        sums.index_add_(1, self.group_of.to(on, non_blocking=True), joining)
        slots = self.slots.to(on, non_blocking=True)
        weight = self.before.to(on, non_blocking=True)[None, :, None].float()
        total = weight + self.counts.to(on, non_blocking=True)[None, :, None].float()
        kept = held[:, slots].float() * weight  # a fresh slot has weight 0
        out = held.clone()
        out[:, slots] = ((kept + sums) / total).to(held.dtype)
        return out
