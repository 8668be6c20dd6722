"""Shared by the score-then-cut methods (SnapKV, H2O, PyramidKV): the whole stream is prefilled,
then every layer keeps its own top-k visual tokens by a per-layer score, in temporal order. Text is
never pruned."""

from __future__ import annotations

from mmkv_cli.lazy import torch
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import top_in_order


class TopKAtEnd(KeepAll):
    """Prefill everything, then cut each layer to its budget by `layer_scores` (subclasses
    score)."""

    def budgets(self, state: StreamState) -> list[int]:
        return [self.budget.tokens_of(state.total)] * state.layers

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        raise NotImplementedError

    def finish(self, state: StreamState) -> None:
        budgets = self.budgets(state)
        if all(state.cache.count(layer) <= b for layer, b in enumerate(budgets)):
            return
        scores = self.layer_scores(state)
        for layer, keep in enumerate(budgets):
            if state.cache.count(layer) > keep:
                state.cache.retain(layer, top_in_order(scores[layer], keep))
