"""Question-aware pruning at ask (`mmkv ask PACK q --prune aircache --budget 0.1`).

The question is prefilled over the whole context (so the first token sees everything), its attention
rows score the context's visual tokens, and every layer drops what its method rejects before
decoding: the setting the AirCache and MEDA papers measure (faster decoding, less KV). Text KV is
never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmkv_cli.methods.base import AskPruner
from mmkv_cli.methods.choice import check_budget, check_pruning


@dataclass(frozen=True)
class AskPrune:
    method: str
    budget: float  # share of the context's visual KV kept
    params: Any  # the method's typed parameters
    keep: AskPruner


def ask_pruner(method: str, budget: float | None) -> AskPrune:
    """The pruner of `method` (or a preset over it) at `budget` (default: the method's own
    share)."""
    choice = check_pruning(method)
    share = check_budget(budget) if budget is not None else choice.budget.share_of(1)
    return AskPrune(method, share, choice.params, choice.method.prune_at_ask)


def prune_context(
    cache,
    rows: dict[int, torch.Tensor],
    prefix: list[int],
    visual: list[int],
    question: int,
    prune: AskPrune,
) -> list[int]:
    """Cut each layer's visual span [prefix, prefix + visual) of `cache` to what `prune` keeps.

    rows: layer -> [1, question, keys] the question's attention. Returns the KV tokens per layer
    after.
    """
    layers = len(cache.layers)
    lengths = [int(cache.layers[i].keys.shape[2]) for i in range(layers)]
    spans = [slice(prefix[i], prefix[i] + visual[i]) for i in range(layers)]
    asked = [slice(lengths[i] - question, lengths[i]) for i in range(layers)]
    keep = prune.keep(
        [rows[i][0].cpu() for i in range(layers)], spans, asked, prune.budget, prune.params
    )
    for layer, local in enumerate(keep):
        entry, span = cache.layers[layer], spans[layer]
        index = torch.cat(
            [torch.arange(span.start), span.start + local, torch.arange(span.stop, lengths[layer])]
        ).to(entry.keys.device)
        entry.keys, entry.values = entry.keys[:, :, index], entry.values[:, :, index]
    return [int(e.keys.shape[2]) for e in cache.layers]
