"""recency (StreamingLLM): the prompt as attention sinks plus the newest visual tokens.

Evicts while streaming, so later chunks attend only to the sinks and the window, as StreamingLLM does;
the running cache never holds more than budget * visual tokens (plus the chunk being prefilled).
"""

from __future__ import annotations

import math

import torch

from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy, StreamState


def newest(count_cached: int, keep: int) -> torch.Tensor:
    """Local indices of the `keep` most recent entries out of `count_cached` (in cache order)."""
    keep = max(0, min(keep, count_cached))
    return torch.arange(count_cached - keep, count_cached)


class RecencyMemory(MemoryPolicy):
    name = "recency"

    def capacity(self, state: StreamState) -> int:
        return math.floor(self.budget * state.total)

    def after_chunk(self, state: StreamState) -> None:
        cap = self.capacity(state)
        for layer in range(state.layers):
            if len(state.kept[layer]) > cap:
                state.retain(layer, newest(len(state.kept[layer]), cap))


MEMORY, CONTEXT = RecencyMemory, ContextPolicy
