"""SnapKV (Li et al., 2024), visual tokens only: an observation window of text rows scores the cached visual
tokens (attention mean over heads, summed over the window's rows, max-pooled), each layer keeps its top-k.
At encode no question exists yet, so the window is the preset's generic guidance prompt."""

from __future__ import annotations

import math

import torch

from mmkv_cli.methods.base import ContextPolicy, StreamState
from mmkv_cli.methods.mukv import top_in_order
from mmkv_cli.methods.pruning import PrunedAtEnd, pooled


def window_scores(state: StreamState, params: dict) -> list[torch.Tensor]:
    attention = state.attend(str(params["guidance_prompt"]))
    return [pooled(a, int(params["pool_kernel"])) for a in attention]


def question_scores(
    rows: list[torch.Tensor], visual: list[slice], params: dict
) -> list[torch.Tensor]:
    """At ask the window is the question: its rows' attention summed over each layer's visual columns."""
    return [pooled(r[:, v].sum(dim=0), int(params["pool_kernel"])) for r, v in zip(rows, visual)]


def prune_at_ask(
    rows: list[torch.Tensor],
    visual: list[slice],
    question: list[slice],
    budget: float,
    params: dict,
) -> list[torch.Tensor]:
    scores = question_scores(rows, visual, params)
    return [top_in_order(s, max(1, math.floor(budget * s.numel()))) for s in scores]


class SnapKVMemory(PrunedAtEnd):
    name = "snapkv"

    def layer_scores(self, state: StreamState) -> list[torch.Tensor]:
        return window_scores(state, self.params)


MEMORY, CONTEXT = SnapKVMemory, ContextPolicy
