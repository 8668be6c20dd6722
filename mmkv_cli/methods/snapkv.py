"""SnapKV (Li et al., 2024), visual tokens only: an observation window of text rows scores the
cached visual tokens (attention summed over the window's rows, max-pooled) and the top-k are kept.
As KVCache-Factory's and kvpress's code do, each KV head keeps its own by its own attention (the
mean over its query heads: the authors' per query head selection would store a KV row once per
query head of its group); `selection: per_layer` keeps one set a layer by the heads' mean. At
encode no question exists yet, so the window is a generic guidance prompt; pruning at ask keeps
one set a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, GuidedParams, Method, Paper, selection_knob
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import keep_share, question_window_scores, window_scores
from mmkv_cli.methods.topk import TopKAtEnd


@dataclass(frozen=True)
class SnapKVParams(GuidedParams):
    pool_kernel: int = knob(7, "1-D max-pool width over neighbouring tokens' scores", low=1)
    selection: Literal["per_head", "per_layer"] = selection_knob()


def prune_at_ask(rows, visual, question, budget: float, params: SnapKVParams):
    return keep_share(question_window_scores(rows, visual, params.pool_kernel), budget)


class SnapKVMemory(TopKAtEnd):
    def layer_scores(self, state: StreamState):
        per_head = self.params.selection == "per_head"
        guidance = self.context.guidance(self.params.guidance_prompt)
        return window_scores(state.attend(guidance, per_head=per_head), self.params.pool_kernel)


METHOD = Method(
    name="snapkv",
    label="SnapKV",
    description="top visual tokens per KV head by a guidance prompt's attention (pooled)",
    paper=Paper(
        "SnapKV: LLM Knows What You are Looking for Before Generation",
        2024,
        "https://arxiv.org/abs/2404.14469",
    ),
    params=SnapKVParams,
    budget=Budget(share=0.25),
    streaming=SnapKVMemory,
    prune_at_ask=prune_at_ask,
)
