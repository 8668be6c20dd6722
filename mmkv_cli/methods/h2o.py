"""H2O (Zhang et al., 2023), visual tokens only: heavy hitters by the attention every query of the
prefill paid each token (column sums accumulated chunk by chunk while streaming), each layer keeps
its top-k."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.kernels.host import host_all
from mmkv_cli.kernels.recorder import Recorder
from mmkv_cli.lazy import torch
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams, score_every_knob
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import accumulate
from mmkv_cli.methods.topk import TopKAtEnd


@dataclass(frozen=True)
class H2OParams(StreamParams):
    score_every: int = score_every_knob()


class H2OMemory(TopKAtEnd):
    def __init__(self, params, budget, context):
        super().__init__(params, budget, context)
        self.cumulative: list[torch.Tensor] = []

    def recorder(self, state: StreamState) -> Recorder:
        return Recorder(
            layers=set(range(state.layers)), column_sums=True, row_stride=self.params.score_every
        )

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        if not self.cumulative:
            self.cumulative = [torch.zeros(state.total) for _ in range(state.layers)]
        sums = host_all(  # every layer's in one copy: one wait a chunk
            [
                recorder.column_sum[layer][0, start : start + state.cache.count(layer)]
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
        return [self.cumulative[layer][state.cache.index[layer]] for layer in range(state.layers)]


METHOD = Method(
    name="h2o",
    label="H2O",
    description="top visual tokens per layer by the attention all prefill queries paid them",
    paper=Paper(
        "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
        2023,
        "https://arxiv.org/abs/2306.14048",
    ),
    params=H2OParams,
    budget=Budget(share=0.25),
    streaming=H2OMemory,
)
