"""Shared by the attention-score baselines (SnapKV, H2O, PyramidKV): the whole stream is prefilled, then every
layer keeps its own top-k visual tokens by a per-layer score, in temporal order. Text is never pruned."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmkv_cli.methods.base import MemoryPolicy, StreamState
from mmkv_cli.methods.mukv import top_in_order


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max-pool along the tokens (stride 1, same length): a kept token brings its neighbours' weight."""
    if kernel <= 1 or scores.numel() == 0:
        return scores
    return F.max_pool1d(scores.float()[None, None], kernel, stride=1, padding=kernel // 2)[
        0, 0, : scores.numel()
    ]


def uniform_budgets(layers: int, per_layer: int) -> list[int]:
    return [per_layer] * layers


def pyramid_budgets(
    layers: int, per_layer: int, beta: float, available: int | None = None
) -> list[int]:
    """Budgets falling linearly from the first layer to the last, averaging `per_layer` (PyramidKV):
    the last layer keeps per_layer / beta, the first 2 per_layer - that. When the first would need more
    than the `available` tokens, it keeps them all and the last layers get what is left of the average,
    as the authors' code does, so a budget near 1 keeps nearly everything instead of a truncated pyramid."""
    if layers == 1:
        return [per_layer]
    low = per_layer / beta
    high = 2 * per_layer - low
    if available is not None and high > available:
        high = available
        low = 2 * per_layer - high
    return [
        max(1, math.floor(high - (high - low) * layer / (layers - 1))) for layer in range(layers)
    ]


class PrunedAtEnd(MemoryPolicy):
    """Prefill everything, then cut each layer to its budget by `layer_scores` (subclasses score)."""

    def budgets(self, state: StreamState) -> list[int]:
        return uniform_budgets(state.layers, max(1, math.floor(self.budget * state.total)))

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        raise NotImplementedError

    def finish(self, state: StreamState) -> None:
        budgets = self.budgets(state)
        if all(len(state.kept[layer]) <= b for layer, b in enumerate(budgets)):
            return
        scores = self.layer_scores(state)
        for layer, keep in enumerate(budgets):
            if len(state.kept[layer]) > keep:
                state.retain(layer, top_in_order(scores[layer], keep))
