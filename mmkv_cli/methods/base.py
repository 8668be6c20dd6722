"""The two-policy seam. A memory policy decides at encode (question unknown) which KV enters the pack and
in which blocks; a context policy decides at ask (question known) which stored blocks enter the context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from mmkv_cli.pack.format import Segment, block_name
from mmkv_cli.pack.table import BlockTable, eligible_before


@dataclass
class StreamState:
    """The running encode cache as a memory policy sees it.

    The cache holds, per layer, [prefix | front | kept visual tokens]; `kept[l]` names those visual tokens by
    their index in the whole visual stream, in cache order, so policies can evict per layer. `front[l]`
    tokens sit between the prompt and the visual tokens, outside the stream (HERMES' summary token).
    """

    cache: DynamicCache
    prefix_len: int
    positions: (
        torch.Tensor
    )  # [P, total] position every visual token was placed at (layout - shift at the time)
    token_step: torch.Tensor  # [total] temporal step of every visual token
    kept: list[torch.Tensor]
    seen: int  # visual tokens streamed so far
    total: int  # visual tokens the whole media will give
    layout_positions: torch.Tensor | None = (
        None  # [P, total + 1] the layout's positions, then the suffix's first
    )
    shift: int = 0  # subtracted from layout positions of tokens still to come (a policy that compacts sets it)
    position_limit: int = 1 << 30  # the model's max_position_embeddings
    rope: tuple[torch.Tensor, torch.Tensor] | None = (
        None  # (inv_freq, axes) for delta-rotating cached keys
    )
    # text -> per layer [cached visual tokens]: the attention that text's rows pay them (mean over heads, rows)
    attend: Callable[[str], list[torch.Tensor]] | None = field(default=None, repr=False)
    front: list[int] = field(
        default_factory=list
    )  # per layer, tokens between the prompt and the visual part

    @property
    def layers(self) -> int:
        return len(self.kept)

    def visual_start(self, layer: int) -> int:
        """Where this layer's visual tokens begin in its cache."""
        return self.prefix_len + (self.front[layer] if self.front else 0)

    def set_front(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Put one token ([H_kv, 1, D]) right after the prompt of this layer, replacing the one there."""
        if not self.front:
            self.front = [0] * self.layers
        entry = self.cache.layers[layer]
        cut = self.prefix_len
        key, value = key.to(entry.keys).unsqueeze(0), value.to(entry.values).unsqueeze(0)
        rest = self.visual_start(layer)
        entry.keys = torch.cat([entry.keys[:, :, :cut], key, entry.keys[:, :, rest:]], dim=2)
        entry.values = torch.cat(
            [entry.values[:, :, :cut], value, entry.values[:, :, rest:]], dim=2
        )
        self.front[layer] = 1

    def visual_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cached visual K, V as [H_kv, n, D]."""
        entry = self.cache.layers[layer]
        start = self.visual_start(layer)
        end = start + len(self.kept[layer])
        return entry.keys[0, :, start:end], entry.values[0, :, start:end]

    def retain(self, layer: int, local: torch.Tensor) -> None:
        """Keep only the visual entries at `local` (indices into this layer's visual part, ascending)."""
        entry = self.cache.layers[layer]
        cut = self.visual_start(layer)
        local = local.to(entry.keys.device)
        entry.keys = torch.cat([entry.keys[:, :, :cut], entry.keys[:, :, cut:][:, :, local]], dim=2)
        entry.values = torch.cat(
            [entry.values[:, :, :cut], entry.values[:, :, cut:][:, :, local]], dim=2
        )
        self.kept[layer] = self.kept[layer][local.cpu()]

    def replace_visual(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite this layer's cached visual K, V ([H_kv, n, D], n = its kept count), e.g. after merging."""
        entry = self.cache.layers[layer]
        cut = self.visual_start(layer)
        end = cut + len(self.kept[layer])
        keys, values = keys.to(entry.keys), values.to(entry.values)
        entry.keys = torch.cat(
            [entry.keys[:, :, :cut], keys.unsqueeze(0), entry.keys[:, :, end:]], dim=2
        )
        entry.values = torch.cat(
            [entry.values[:, :, :cut], values.unsqueeze(0), entry.values[:, :, end:]], dim=2
        )

    def kv_bytes(self) -> int:
        return sum(
            e.keys.numel() * e.keys.element_size() * 2
            for e in self.cache.layers
            if e.keys is not None
        )


class MemoryPolicy:
    """Default behaviour: keep everything, one block per temporal step."""

    name = "base"
    granularity = "frame"
    keeps_all = False  # True: the budget does not apply (the policy stores every token)

    def __init__(self, budget: float, params: dict[str, Any]):
        self.budget = budget
        self.params = params

    def recorder(self, state: StreamState):
        """An attention.Recorder to run while each chunk is prefilled (None: nothing to record)."""
        return None

    def observe(self, state: StreamState, recorder) -> None:
        """Called after each chunk with the recorder returned by recorder()."""

    def after_chunk(self, state: StreamState) -> None:
        """Called after every streamed chunk; may evict from the running cache."""

    def finish(self, state: StreamState) -> None:
        """Called once after the last chunk, before the suffix is prefilled."""

    def positions_of(self, state: StreamState, layer: int) -> torch.Tensor:
        """[P, kept] positions of this layer's cached visual tokens (a policy that re-indexes overrides it)."""
        return state.positions[:, state.kept[layer]]

    def make_blocks(
        self, state: StreamState, step_times: list[tuple[float, float]]
    ) -> list[Segment]:
        """Group what the cache kept into one block per temporal step."""
        per_layer = [state.visual_kv(layer) for layer in range(state.layers)]
        placed = [self.positions_of(state, layer) for layer in range(state.layers)]
        blocks = []
        for step, time in enumerate(step_times):
            keys, values, positions = [], [], []
            for layer, (k, v) in enumerate(per_layer):
                mask = state.token_step[state.kept[layer]] == step
                local = mask.nonzero().squeeze(1)
                keys.append(k[:, local.to(k.device)].cpu())
                values.append(v[:, local.to(v.device)].cpu())
                positions.append(placed[layer][:, local])
            if not any(k.shape[1] for k in keys):
                continue  # evicted from every layer
            blocks.append(
                Segment(
                    name=block_name(len(blocks)),
                    keys=keys,
                    values=values,
                    positions=positions,
                    granularity=self.granularity,
                    steps=(step, step + 1),
                    time=time,
                    representative=mean_key(keys[-1]),
                )
            )
        return blocks


def mean_key(keys: torch.Tensor) -> torch.Tensor | None:
    """A block's retrieval key: the mean of its kept last-layer keys, heads concatenated (H_kv * D)."""
    if keys.shape[1] == 0:
        return None
    return keys.float().mean(dim=1).reshape(-1)


@dataclass
class Selection:
    names: list[str]  # blocks entering the context, in context order
    explain: list[dict]  # per retrieved block: why it was chosen (empty when nothing was scored)
    asked_after: str | None = None  # with a question's moment: the last block shown by then


def last_shown(blocks: BlockTable, eligible: torch.Tensor, before: float | None) -> str | None:
    """The last block (in time order) shown by the question's moment; None without a moment or before any."""
    return blocks.name(int(eligible[-1])) if before is not None and len(eligible) else None


class ContextPolicy:
    """Default: every stored block, in time order, at its original positions."""

    name = "all"

    def __init__(self, params: dict[str, Any]):
        self.params = params
        self.position_mode = params.get("positions", "keep")

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: Callable[[str], torch.Tensor],
        before: float | None = None,
    ) -> Selection:
        """Blocks for the context. reps() loads the representatives and question_vector(mode) runs the
        question; both are lazy so a policy that needs neither costs nothing."""
        eligible = eligible_before(blocks, before)
        return Selection(
            [blocks.name(i) for i in eligible.tolist()], [], last_shown(blocks, eligible, before)
        )
