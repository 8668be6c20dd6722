"""PyramidKV (Cai et al., 2024), visual tokens only: SnapKV's scores, budgets falling linearly with depth
(more in shallow layers, where attention is spread; fewer in deep ones, where it is concentrated)."""

from __future__ import annotations

import math

from mmkv_cli.methods.base import ContextPolicy, StreamState
from mmkv_cli.methods.mukv import top_in_order
from mmkv_cli.methods.pruning import PrunedAtEnd, pyramid_budgets
from mmkv_cli.methods.snapkv import question_scores, window_scores


def prune_at_ask(rows, visual: list[slice], question: list[slice], budget: float, params: dict):
    scores = question_scores(rows, visual, params)
    mean = sum(s.numel() for s in scores) / len(scores)
    budgets = pyramid_budgets(
        len(scores),
        max(1, math.floor(budget * mean)),
        float(params["beta"]),
        available=min(s.numel() for s in scores),
    )
    return [top_in_order(s, min(s.numel(), b)) for s, b in zip(scores, budgets)]


class PyramidKVMemory(PrunedAtEnd):
    name = "pyramidkv"

    def budgets(self, state: StreamState) -> list[int]:
        per_layer = max(1, math.floor(self.budget * state.total))
        return pyramid_budgets(
            state.layers, per_layer, float(self.params["beta"]), available=state.total
        )

    def layer_scores(self, state: StreamState):
        return window_scores(state, self.params)


MEMORY, CONTEXT = PyramidKVMemory, ContextPolicy
