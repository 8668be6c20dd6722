"""StreamMem (arXiv 2508.15717): a fixed memory, no question. After every chunk the model's chat
template is run after the stream with nothing in the question's place (the end of a user turn and
the start of the assistant's: the paper's proxy query); the attention its rows pay each cached
visual token scores it, and each layer keeps its budget's best. Every frame also leaves a prototype:
the mean of its keys and values weighted by that attention (frame-wise KV merging), always kept
beside the budget. No code was released; this follows the paper (docs/methods.md says where
mmkv had to choose)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState


@dataclass(frozen=True)
class StreamMemParams(StreamParams):
    proxy: str = knob(
        "",
        "text put in the chat template's question slot to score the cache with ('': the "
        "template's own tokens, the paper's proxy query)",
    )
    prototypes: bool = knob(
        True, "each frame keeps one attention-weighted mean K/V beside the budget"
    )


def prototype(
    keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame's keys, values [H, n, D] merged into one entry [H, D] each, weighted by the
    attention each got (uniform when it got none)."""
    w = weights.float().clamp_min(0)
    w = w / w.sum() if float(w.sum()) > 0 else torch.full_like(w, 1 / len(w))
    w = w.to(keys.device, non_blocking=w.device.type == "cpu")[None, :, None]
    return (keys.float() * w).sum(dim=1).to(keys.dtype), (values.float() * w).sum(dim=1).to(
        values.dtype
    )


def kept_entries(scores: torch.Tensor, protected: torch.Tensor, budget: int) -> torch.Tensor:
    """Local indices (ascending) a layer keeps: every protected entry (the prototypes), and the
    `budget` best scored of the rest (ties to the earlier)."""
    rest = (~protected).nonzero()[:, 0]
    order = torch.sort(-scores[rest].float(), stable=True).indices[:budget]
    return torch.sort(torch.cat([protected.nonzero()[:, 0], rest[order]])).values


class StreamMemMemory(KeepAll):
    def __init__(self, params: StreamMemParams, budget: Budget, context):
        super().__init__(params, budget, context)
        self.merged = 0  # visual tokens whose frames have their prototypes
        self.prototypes: list[torch.Tensor] = []  # per layer: the stream indices holding one

    def saved(self) -> dict[str, torch.Tensor]:
        out = {f"prototypes.{i}": p for i, p in enumerate(self.prototypes)}
        return out | {"merged": torch.tensor(self.merged)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.merged = int(saved["merged"])
        self.prototypes = [saved[f"prototypes.{i}"] for i in range(len(saved) - 1)]

    def after_chunk(self, state: StreamState) -> None:
        if not self.prototypes:
            self.prototypes = [torch.empty(0, dtype=torch.long) for _ in range(state.layers)]
        scores = state.attend(self.params.proxy)
        cap = self.budget.tokens_of(state.total)
        for layer in range(state.layers):
            if self.params.prototypes:
                self._merge_frames(state, layer, scores[layer])
            protected = torch.isin(state.cache.index[layer], self.prototypes[layer])
            kept = kept_entries(scores[layer], protected, cap)
            if len(kept) < state.cache.count(layer):
                state.cache.retain(layer, kept)
                self.prototypes[layer] = state.cache.index[layer][protected[kept]]
        self.merged = state.seen

    def _merge_frames(self, state: StreamState, layer: int, scores: torch.Tensor) -> None:
        """Each frame that came in this chunk: its prototype written over its least salient
        entry, which then holds it (every entry has a stream index and a place in the cache)."""
        index = state.cache.index[layer]
        fresh = index >= self.merged
        if not bool(fresh.any()):
            return
        keys, values = state.cache.visual(layer)
        keys, values = keys.clone(), values.clone()
        steps = state.token_step[index]
        slots = []
        for step in torch.unique(steps[fresh]).tolist():  # host bookkeeping, as are the scores
            members = (fresh & (steps == step)).nonzero()[:, 0]
            at = members.to(keys.device, non_blocking=True)  # indexing would send it and wait
            key, value = prototype(keys[:, at], values[:, at], scores[members])
            slot = int(members[torch.argmin(scores[members])])
            keys[:, slot], values[:, slot] = key, value
            slots.append(slot)
        state.cache.replace(layer, keys, values)
        held = torch.cat([self.prototypes[layer], index[torch.tensor(slots)]])
        self.prototypes[layer] = held


METHOD = Method(
    name="streammem",
    label="StreamMem",
    description="a fixed memory scored by the chat template's attention, one prototype a frame",
    paper=Paper(
        "StreamMem: Query-Agnostic KV Cache Memory for Streaming Video Understanding",
        2025,
        "https://arxiv.org/abs/2508.15717",
    ),
    params=StreamMemParams,
    budget=Budget(tokens=4096),  # a fixed memory a layer; --budget-tokens sets yours
    streaming=StreamMemMemory,
)
