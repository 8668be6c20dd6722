"""H2O (Zhang et al., 2023), visual tokens only: heavy hitters by the attention every query of the prefill
paid each token (column sums accumulated chunk by chunk while streaming), each layer keeps its top-k."""

from __future__ import annotations

import torch

from mmkv_cli.attention import Recorder
from mmkv_cli.methods.base import ContextPolicy, StreamState
from mmkv_cli.methods.pruning import PrunedAtEnd


def accumulate(total: torch.Tensor, sums: torch.Tensor, kept: torch.Tensor) -> None:
    """Add a chunk's column sums over this layer's cached visual tokens (cache order) to their stream slots."""
    total.index_add_(0, kept, sums.float())


class H2OMemory(PrunedAtEnd):
    name = "h2o"

    def __init__(self, budget: float, params: dict):
        super().__init__(budget, params)
        self.cumulative: list[torch.Tensor] = []

    def recorder(self, state: StreamState) -> Recorder:
        return Recorder(layers=set(range(state.layers)), column_sums=True)

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        if not self.cumulative:
            self.cumulative = [torch.zeros(state.total) for _ in range(state.layers)]
        for layer in range(state.layers):
            sums = recorder.column_sum[layer]
            start = state.visual_start(layer)
            visual = sums[0, start : start + len(state.kept[layer])].cpu()
            accumulate(self.cumulative[layer], visual, state.kept[layer])

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        return [self.cumulative[layer][state.kept[layer]] for layer in range(state.layers)]


MEMORY, CONTEXT = H2OMemory, ContextPolicy
