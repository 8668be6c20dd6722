"""A stream's layout grown by its new steps alone, where the family allows it.

Where positions are a left-to-right scan (each text run and each step's grid placed after where the
one before ended: 1-D RoPE, and Qwen3-VL's frames each behind their own timestamp), the positions of
steps k.. of a stream are those of a stream of just those steps, moved by where step k starts: the
layout of the first k steps is kept and only the new steps are laid out. Elsewhere (Qwen2-VL and
Qwen2.5-VL give the whole video one grid, its temporal index spanning every step) it is laid out
whole, vectorized. A live stream's every chunk asks for its layout: laid out whole, an hour of
Qwen3-VL frames took 0.4 s a chunk, and grew with the stream.
"""

from __future__ import annotations

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.core.lazy import torch


def extend_layout(
    backbone: Backbone,
    base: StreamLayout | None,
    frame_hw: tuple[int, int],
    step_times: list[tuple[float, float]],
    clip_frames: int | None,
) -> StreamLayout:
    """The layout of `step_times`; base: that of its first steps, which never move (None: none).
    clip_frames must be pinned (a live stream's): steps are sized alike however many there are."""
    placed = len(base.step_lengths) if base is not None else 0
    if base is None or not backbone.positions_scan or clip_frames is None or placed == 0:
        return backbone.stream_layout(frame_hw, step_times, clip_frames)
    if placed == len(step_times):  # no new step: the same steps, the same layout
        return base
    window = backbone.stream_layout(frame_hw, step_times[placed:], clip_frames)
    # where step `placed` starts: the first position after the base's steps (its suffix's first)
    start = int(base.suffix[0, 0]) if base.suffix.shape[1] else base.next_position
    shift = start - int(window.visual[0, 0])  # the window's first step starts after its prefix
    lengths = [*base.step_lengths, *window.step_lengths]
    next_position = window.next_position + shift
    physical = base.prefix.shape[1] + sum(lengths) + window.suffix.shape[1]
    return StreamLayout(
        prefix=base.prefix,
        visual=torch.cat([base.visual, window.visual + shift], dim=1),
        suffix=window.suffix + shift,
        next_position=next_position,
        rope_delta=next_position - physical,
        step_lengths=lengths,
        grid=window.grid,
        resize_to=window.resize_to,
        grid_offsets=None if base.grid_offsets is None else [*base.offsets(), *window.offsets()],
    )
