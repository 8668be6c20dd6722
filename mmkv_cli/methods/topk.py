"""Shared by the score-then-cut methods (SnapKV, H2O, PyramidKV): the whole stream is prefilled,
then every layer keeps its own top-k visual tokens by a per-layer score, in temporal order; by a
per-head score ([H_kv, n]) each KV head keeps its own (equal budgets, or AdaKV's). Text is never
pruned."""

from __future__ import annotations

from mmkv_cli.core.lazy import torch
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import top_in_order, top_per_head


class TopKAtEnd(KeepAll):
    """Prefill everything, then cut each layer to its budget by `layer_scores` (subclasses
    score)."""

    def budgets(self, state: StreamState) -> list[int]:
        return [self.budget.tokens_of(state.total)] * state.layers

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        """Per layer [n] (every head keeps the same tokens) or [H_kv, n] (each its own)."""
        raise NotImplementedError

    def per_head(self, scores: torch.Tensor, keep: int) -> list[torch.Tensor]:
        """Each KV head's kept indices, `keep` a head on average (by default: each head its own
        `keep` best)."""
        return top_per_head(scores, keep)

    def finish(self, state: StreamState) -> None:
        budgets = self.budgets(state)
        if all(state.cache.count(layer) <= b for layer, b in enumerate(budgets)):
            return
        scores = self.layer_scores(state)
        for layer, keep in enumerate(budgets):
            if state.cache.count(layer) <= keep:
                continue
            if scores[layer].dim() == 2:
                state.cache.retain_heads(layer, self.per_head(scores[layer], keep))
            else:
                state.cache.retain(layer, top_in_order(scores[layer], keep))
