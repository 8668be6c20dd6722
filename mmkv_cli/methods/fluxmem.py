"""FluxMem (CVPR 2026, arXiv 2603.02096): a three-tier memory sized by thresholds of its own, not a
budget. Following the authors' code (YiwengXie/FluxMem, `FluxMem.process_memory_streaming` in
models/qwen2-5-vl/src/qwen2_5_vl_fluxmem/fluxmem.py):

- short term: the newest `short_term_frames` are kept whole;
- mid term: a frame leaving the short term keeps the tokens that differ from both neighbours, each
  token's distance to the other frame being 1 - its best cosine over the 3x3 places around its own,
  thresholded by Otsu's method per frame and side; a token more similar than 0.8 to the next frame
  goes whatever the thresholds say;
- long term: a frame leaving the mid term clusters what it kept (8-neighbour edges no longer than
  an Otsu threshold, joined into connected parts); each part of two or more keeps one anchor, the
  member nearest the part's mean, which becomes the mean.

The authors decide among the language model's input embeddings and prefill what stays. mmkv's memory
streams through the model, so it decides by the same embeddings (StreamState.chunk_grid) and evicts
the KV of what goes; an anchor's K and V become its part's means (docs/methods.md)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.tiers import (
    Frame,
    TieredMemory,
    best_neighbour_similarity,
    differs,
    long_term_merge,
)


@dataclass(frozen=True)
class FluxMemParams(StreamParams):
    short_term_frames: int = knob(
        8, "the newest frames, kept whole (short_frames)", low=1
    )  # fmt: skip
    mid_term_frames: int = knob(
        16, "frames after those that keep what differs from their neighbours, before they are "
        "merged (medium_frames: 16 in the streaming scripts, 512 in the offline ones)", low=0,
    )  # fmt: skip
    direct_drop_similarity: float = knob(
        0.8, "a mid-term token more similar than this to the next frame goes whatever the "
        "thresholds say", low=-1.0, high=1.0,
    )  # fmt: skip
    pair_similarity: float | None = knob(
        None, "one similarity threshold for the mid term instead of Otsu's per frame "
        "(pair_sim_threshold; null: Otsu's)", low=-1.0, high=1.0,
    )  # fmt: skip


def mid_term_keep(
    next_similarity: torch.Tensor,
    previous_distance: torch.Tensor | None,
    params: FluxMemParams,
) -> torch.Tensor:
    """[T] bool: what a frame leaving the short term keeps: tokens at least the threshold away from
    the next frame, or from the frame before (where it had one), less those nearer the next frame
    than the direct-drop similarity."""
    keep = differs(next_similarity, previous_distance, params.pair_similarity)
    return keep & ~(next_similarity > params.direct_drop_similarity)


class FluxMemMemory(TieredMemory):
    def mid_term(self, leaving: Frame, following: Frame, near: torch.Tensor) -> torch.Tensor:
        similar = best_neighbour_similarity(leaving.unit(), following.unit(), near)
        return mid_term_keep(similar, leaving.previous, self.params)

    def long_term(self, old: Frame, grid: tuple[int, int]) -> None:
        part, anchor, dropped = long_term_merge(old.x, old.keep, grid)
        old.merge, old.keep = (part, anchor, old.keep), old.keep & ~dropped


METHOD = Method(
    name="fluxmem",
    label="FluxMem",
    description="newest frames whole, then what differs from its neighbours, then merged regions",
    paper=Paper(
        "FluxMem: Adaptive Hierarchical Memory for Streaming Video Understanding",
        2026,
        "https://arxiv.org/abs/2603.02096",
    ),
    params=FluxMemParams,
    budget=None,  # its thresholds size it: --budget does not apply
    streaming=FluxMemMemory,
    adaptive=True,
)
