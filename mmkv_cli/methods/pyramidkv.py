"""PyramidKV (Cai et al., 2024), visual tokens only: SnapKV's scores, budgets falling linearly with
depth (more in shallow layers, where attention is spread; fewer in deep ones, where it is
concentrated). As KVCache-Factory's code does, each KV head keeps its own tokens, the layer's
budget each (`selection: per_layer`: one set a layer by the heads' mean).

The schedule is the paper's arithmetic sequence (last layer budget / beta, first 2 budget - that),
with what the authors' KVCache-Factory code does when a budget is more than half the tokens: every
layer keeps the same (`large_budget: uniform`). mmkv's earlier reading clamps the first layer to
what exists and keeps the pyramid below it (`large_budget: clamp`). Their code also sets the
observation window apart from the budget, which is not done here (the window is the guidance prompt
or the question, never stored visual KV); kvpress falls back to uniform budgets at small budgets
too (docs/methods.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, GuidedParams, Method, Paper, selection_knob
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import question_window_scores, top_in_order, window_scores
from mmkv_cli.methods.topk import TopKAtEnd


@dataclass(frozen=True)
class PyramidKVParams(GuidedParams):
    pool_kernel: int = knob(7, "1-D max-pool width over neighbouring tokens' scores", low=1)
    selection: Literal["per_head", "per_layer"] = selection_knob()
    beta: float = knob(
        20.0, "the last layer keeps budget / beta, the first 2 x budget - that", low=1
    )
    large_budget: Literal["uniform", "clamp"] = knob(
        "uniform",
        "a budget over half the tokens: every layer the same (the authors' KVCache-Factory) or "
        "the first layer clamped to what exists, the pyramid below it",
    )


def pyramid_budgets(
    layers: int,
    per_layer: int,
    beta: float,
    available: int | None = None,
    large_budget: str = "uniform",
) -> list[int]:
    """Budgets falling linearly from the first layer to the last, averaging `per_layer`: the last
    layer keeps per_layer / beta, the first 2 per_layer - that. A budget over half the `available`
    tokens: with `uniform` every layer keeps per_layer, as KVCache-Factory's code does (it checks
    this before its clamp, which then never acts); with `clamp` the first keeps them all and the
    last layers get what is left of the average, a pyramid to the end."""
    if layers == 1:
        return [per_layer]
    if available is not None and 2 * per_layer > available and large_budget == "uniform":
        return [per_layer] * layers
    low = per_layer / beta
    high = 2 * per_layer - low
    if available is not None and high > available:
        high = available
        low = 2 * per_layer - high
    return [
        max(1, math.floor(high - (high - low) * layer / (layers - 1))) for layer in range(layers)
    ]


def prune_at_ask(rows, visual, question, budget: float, params: PyramidKVParams):
    scores = question_window_scores(rows, visual, params.pool_kernel)
    mean = sum(s.numel() for s in scores) / len(scores)
    budgets = pyramid_budgets(
        len(scores),
        max(1, math.floor(budget * mean)),
        params.beta,
        available=min(s.numel() for s in scores),
        large_budget=params.large_budget,
    )
    return [top_in_order(s, min(s.numel(), b)) for s, b in zip(scores, budgets)]


class PyramidKVMemory(TopKAtEnd):
    def budgets(self, state: StreamState) -> list[int]:
        per_layer = self.budget.tokens_of(state.total)
        p = self.params
        return pyramid_budgets(state.layers, per_layer, p.beta, state.total, p.large_budget)

    def layer_scores(self, state: StreamState):
        per_head = self.params.selection == "per_head"
        guidance = self.context.guidance(self.params.guidance_prompt)
        return window_scores(state.attend(guidance, per_head=per_head), self.params.pool_kernel)


METHOD = Method(
    name="pyramidkv",
    label="PyramidKV",
    description="SnapKV scores, budgets falling from shallow to deep layers",
    paper=Paper(
        "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
        2024,
        "https://arxiv.org/abs/2406.02069",
    ),
    params=PyramidKVParams,
    budget=Budget(share=0.25),
    streaming=PyramidKVMemory,
    prune_at_ask=prune_at_ask,
)
