"""What an encode leaves: the pack's spans and layout (`Encoded`), and what a runner hands back
before the suffix is prefilled (`Streamed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.pack import EarlyPack, Span


@dataclass
class Encoded:
    prefix: Span
    blocks: list[Span]
    suffix: Span
    layout: dict
    visual_tokens_total: int
    stats: dict = field(default_factory=dict)
    representatives: str = (
        "pre_rope"  # what block representatives are means of (pack/schema/format.py)
    )
    per_head: bool = False  # every span stored per (layer, KV head): the KV heads keep their own
    # the pack written while encoding (its blocks are there, not in `blocks`): finished by
    # record.write_encoded
    early: EarlyPack | None = None


@dataclass
class Streamed:
    """What a runner leaves: the blocks, the cache the suffix follows, and where each layer's visual
    part ends in it."""

    blocks: list[Span]
    cache: object  # the model cache the suffix is prefilled after
    visual_end: list[int]  # per layer
    peak_kv_bytes: int
    shift: int = 0  # how far a policy that compacted positions moved the rest of the stream up
    representatives: str = "pre_rope"  # pre_rope, or post_rope: keys as a block was prefilled
    prefilled: int | None = None  # visual tokens prefilled (None: every one the stream gave)
    # per layer whose KV heads hold different tokens: which entries each sees (RunningCache)
    head_masks: dict = field(default_factory=dict)
    # per layer, how far its prompt was moved from the layout's positions (RunningCache); empty:
    # none was
    prompt_shift: list[int] = field(default_factory=list)


def layout_record(backbone: Backbone, layout: StreamLayout, shift: int, frame_hw) -> dict:
    """The pack header's layout of an encode (its step lengths become a series)."""
    parts = [p for p in (layout.prefix, layout.visual, layout.suffix) if p.numel()]
    highest = max([layout.next_position - 1, *(int(p.max()) for p in parts)])
    return {
        "position_dims": backbone.position_dims,
        "next_position": layout.next_position - shift,
        # a compaction (shift > 0) only lowers positions; summaries placed among the tokens
        # (shift < 0: HERMES) raise the later ones by as much
        "position_limit": highest + 1 - min(shift, 0),
        "rope_deltas": layout.rope_delta - shift,
        "position_shift": shift,
        "frames_per_step": backbone.frames_per_step,
        "steps": len(layout.step_lengths),
        "tokens_per_step": layout.grid[0] * layout.grid[1],
        "step_lengths": layout.step_lengths,
        "grid": list(layout.grid),
        "frame_size": list(frame_hw),
    }
