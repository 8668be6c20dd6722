"""recency (StreamingLLM): the prompt as attention sinks plus the newest visual tokens.

Evicts while streaming, so later chunks attend only to the sinks and the window, as StreamingLLM
does; the running cache never holds more than the budget (plus the chunk being prefilled).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState


@dataclass(frozen=True)
class RecencyParams(StreamParams):
    pass


def newest(count_cached: int, keep: int) -> torch.Tensor:
    """Local indices of the `keep` most recent entries out of `count_cached` (in cache order)."""
    keep = max(0, min(keep, count_cached))
    return torch.arange(count_cached - keep, count_cached)


class RecencyMemory(KeepAll):
    def after_chunk(self, state: StreamState) -> None:
        cap = self.budget.tokens_of(state.total)
        for layer in range(state.layers):
            if state.cache.count(layer) > cap:
                state.cache.retain(layer, newest(state.cache.count(layer), cap))


METHOD = Method(
    name="recency",
    label="Recency",
    description="keep the prompt (attention sinks) and the newest visual tokens",
    paper=Paper(
        "Efficient Streaming Language Models with Attention Sinks (StreamingLLM)",
        2024,
        "https://arxiv.org/abs/2309.17453",
    ),
    params=RecencyParams,
    budget=Budget(share=0.25),
    streaming=RecencyMemory,
)
