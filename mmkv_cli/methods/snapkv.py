"""SnapKV (Li et al., 2024), visual tokens only: an observation window of text rows scores the cached visual
tokens (attention mean over heads, summed over the window's rows, max-pooled), each layer keeps its top-k.
At encode no question exists yet, so the window is the preset's generic guidance prompt."""

from __future__ import annotations

import torch

from mmkv_cli.methods.base import ContextPolicy, StreamState
from mmkv_cli.methods.pruning import PrunedAtEnd, pooled


def window_scores(state: StreamState, params: dict) -> list[torch.Tensor]:
    attention = state.attend(str(params["guidance_prompt"]))
    return [pooled(a, int(params["pool_kernel"])) for a in attention]


class SnapKVMemory(PrunedAtEnd):
    name = "snapkv"

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        return window_scores(state, self.params)


MEMORY, CONTEXT = SnapKVMemory, ContextPolicy
