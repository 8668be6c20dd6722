"""The token-reducer seam: between the vision tower and the language model's prefill, a reducer sees
one chunk's visual tokens step by step (a temporal step's grid of tokens, the step before it, and
the tower's attention where it reads it) and says which tokens go on, with what embeddings. Kept
tokens keep their stream index, grid place and time, so RoPE / M-RoPE positions, retrieval and the
pack's layout keep their meaning; a dropped token is, to a memory policy, a token evicted as it
arrived.

A reducer is a `Reducer` record: its typed parameters (the authors' defaults) and a pure function
over tensors. The scoring they share (each token against its place in the step before) is here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import Paper


@dataclass
class StepTokens:
    """What a reducer sees of one chunk, grid tokens only (markers between steps always go on)."""

    # [S, T, H]: the chunk's S steps, T tokens each in raster order, as embedded
    grid: torch.Tensor
    # [T, H]: the step before the chunk, whole (None: the stream's first)
    previous: torch.Tensor | None
    # [S, T]: the attention each token got in the vision tower (None: not read)
    importance: torch.Tensor | None
    # what the reducer carried from the chunks before (empty: the stream's first)
    carried: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Reduced:
    keep: torch.Tensor  # [S, T] bool: the tokens prefilled
    grid: torch.Tensor  # [S, T, H]: their embeddings (a merging reducer rewrote the kept ones)
    # what it carries to the next chunk (new tensors: a live stream's copy shares the old ones)
    carried: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Reducer:
    """A token reducer as the registry knows it."""

    name: str
    description: str
    paper: Paper
    params: type  # the typed parameter class (defaults in code, presets override)
    reduce: Callable[[Any, StepTokens], Reduced]  # (params, tokens) -> what goes on
    temporal: bool  # compares a step with the one before: video only
    tower_attention: bool  # reads the vision tower's attention: only families that expose it
    # (params, T) -> the grid tokens every step of T keeps, where that is fixed (None: it depends
    # on the tokens): a pack's layout is then known before the encode (encode/sealing.py)
    kept: Callable[[Any, int], int] | None = None
    # params -> whether it reuses the vision tower's layers from frame to frame (STC's cacher):
    # only families whose adapter offers it (Family.tower_reuse); None: never
    tower_reuse: Callable[[Any], bool] | None = None


def similarity_to_previous(grid: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """[S, T] cosine similarity of every token with the same place in the step before, the step
    before taken whole (what was dropped of it included); the stream's first step gets -inf.
    Clamped to [-1, 1]: an unchanged token is 1 exactly, so a threshold of 1 drops nothing."""
    steps = grid.float()
    first = steps[:1] if previous is None else previous.float()[None]
    before = torch.cat([first, steps[:-1]])
    similarity = torch.nn.functional.cosine_similarity(steps, before, dim=-1).clamp(-1.0, 1.0)
    if previous is None:
        similarity[0] = float("-inf")
    return similarity


def step_by_step(
    tokens: StepTokens, reduce_step: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
) -> Reduced:
    """A reducer that takes each step on its own: reduce_step(s) -> (keep [T], grid [T, H])."""
    keeps, grids = zip(*(reduce_step(s) for s in range(len(tokens.grid))))
    return Reduced(keep=torch.stack(keeps), grid=torch.stack(grids))


def top_in_order(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores, ascending (ties to the earlier index)."""
    count = max(0, min(count, scores.numel()))
    order = torch.sort(-scores.float(), stable=True).indices[:count]
    return torch.sort(order).values


def first_where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices (ascending) of the `count` True entries of `mask`, `count` known to the caller:
    no wait for the device to say how many there are, as `nonzero` makes."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]
