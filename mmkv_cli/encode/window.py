"""A memory of the newest frames alone (`Method.window`: SimpleStream): which frames, and how
many visual tokens the whole stream gave, which its pack records as what it was cut from."""

from __future__ import annotations

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.encode.stream import step_times_of
from mmkv_cli.media import Media


def newest_frames(media: Media, count: int) -> Media:
    """The media's newest `count` frames (all of them where it has fewer), at their own times."""
    first = max(0, media.num_frames - count)
    if not first:
        return media
    times = media.timestamps[first:]
    return Media(media.kind, media.source, media.digest, times,
                 lambda start, stop: media.read(first + start, first + stop),
                 offered=media.frames_offered)  # fmt: skip


def stream_tokens(
    backbone: Backbone, media: Media, frame_hw: tuple[int, int], clip_frames: int | None
) -> int:
    """The visual tokens the whole media gives (its layout only: no frame is read)."""
    per_step = backbone.frames_per_step
    steps = step_times_of(media, -(-media.num_frames // per_step), per_step)
    return sum(backbone.stream_layout(frame_hw, steps, clip_frames).step_lengths)
