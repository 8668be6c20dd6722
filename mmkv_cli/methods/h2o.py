"""H2O (Zhang et al., 2023), visual tokens only: heavy hitters by the attention every query of the
prefill paid each token (column sums accumulated chunk by chunk while streaming). As the authors'
code does, each KV head keeps its own top-k by its own attention (`selection: per_layer`: one set a
layer by the heads' mean); `head_budgets: adaptive` lets the heads' budgets differ as AdaKV's do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.kernels.host import host_all
from mmkv_cli.kernels.recorder import Recorder
from mmkv_cli.methods.base import (
    Budget,
    Method,
    Paper,
    StreamParams,
    score_every_knob,
    selection_knob,
)
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import accumulate, adaptive_per_head, top_per_head
from mmkv_cli.methods.topk import TopKAtEnd


@dataclass(frozen=True)
class H2OParams(StreamParams):
    score_every: int = score_every_knob()
    selection: Literal["per_head", "per_layer"] = selection_knob()
    head_budgets: Literal["equal", "adaptive"] = knob(
        "equal",
        "per head: equal, every head the layer's budget (the code); adaptive, AdaKV's: a floor "
        "each, the rest to the best scores over all heads",
    )
    head_floor: float = knob(
        0.2, "adaptive head budgets: the share of its budget each head keeps first", low=0, high=1
    )


class H2OMemory(TopKAtEnd):
    def __init__(self, params, budget, context):
        super().__init__(params, budget, context)
        self.cumulative: list[torch.Tensor] = []

    def recorder(self, state: StreamState) -> Recorder:
        return Recorder(
            layers=set(range(state.layers)),
            column_sums=True,
            row_stride=self.params.score_every,
            per_head=self.params.selection == "per_head",
        )

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        if not self.cumulative:
            heads = (state.cache.visual(0)[0].shape[0],) if recorder.per_head else ()
            self.cumulative = [torch.zeros(*heads, state.total) for _ in range(state.layers)]
        sums = host_all(  # every layer's in one copy: one wait a chunk
            [
                recorder.column_sum[layer][0, ..., start : start + state.cache.count(layer)]
                for layer, start in enumerate(map(state.cache.visual_start, range(state.layers)))
            ]
        )
        for layer in range(state.layers):
            self.cumulative[layer] = accumulate(
                self.cumulative[layer], sums[layer], state.cache.index[layer]
            )

    def saved(self) -> dict[str, torch.Tensor]:
        return {f"cumulative.{i}": c for i, c in enumerate(self.cumulative)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.cumulative = [saved[f"cumulative.{i}"] for i in range(len(saved))]

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        return [
            self.cumulative[layer][..., state.cache.index[layer]] for layer in range(state.layers)
        ]

    def per_head(self, scores: torch.Tensor, keep: int) -> list[torch.Tensor]:
        if self.params.head_budgets == "adaptive":
            return adaptive_per_head(scores, keep, self.params.head_floor)
        return top_per_head(scores, keep)


METHOD = Method(
    name="h2o",
    label="H2O",
    description="top visual tokens per KV head by the attention all prefill queries paid them",
    paper=Paper(
        "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
        2023,
        "https://arxiv.org/abs/2306.14048",
    ),
    params=H2OParams,
    budget=Budget(share=0.25),
    streaming=H2OMemory,
)
