"""A memory decoupled from the newest frames (`Method.instant`: DSCache). The frames before the
newest N go through the method's streaming memory (its past cache); the newest N are prefilled
fresh, right after the prompt, attending to nothing before them (its instant cache); the pack
holds the prompt, the past's blocks, the instant's blocks, and a suffix prefilled after all of them
at the next place along (the question follows it). A live stream holds its newest frames and feeds
the past what leaves them, so its memory at T is this encode of the stream cut at T."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.encode.results import Encoded
from mmkv_cli.encode.window import newest_frames
from mmkv_cli.media import Media
from mmkv_cli.methods import EncodeContext
from mmkv_cli.methods.choice import MethodChoice
from mmkv_cli.methods.keep_all import KeepPrefilled
from mmkv_cli.pack import Span, block_name

Encode = Callable[..., Encoded]  # encoder.encode_media, passed in (it calls this module)


def past_frames(frames: int, instant: int, per_step: int) -> int:
    """How many of `frames` go to the past: all but the newest `instant`, in whole steps."""
    return max(0, (frames - instant) // per_step * per_step)


def past_choice(choice: MethodChoice) -> MethodChoice:
    """The method as the past cache runs it: its streaming memory, the instant left out."""
    return replace(choice, method=replace(choice.method, instant=None))


def instant_choice(choice: MethodChoice, frames: int) -> MethodChoice:
    """The instant cache: every frame's token as prefilled, in one forward."""
    method = replace(choice.method, instant=None, streaming=KeepPrefilled, budget=None)
    return replace(choice, method=method, params=replace(choice.params, chunk_frames=frames))


def first_frames(media: Media, count: int) -> Media:
    """The media as it was when its first `count` frames had come."""
    return Media(media.kind, media.source, media.digest, media.timestamps[:count],
                 lambda start, stop: media.read(start, min(stop, count)),
                 offered=media.frames_offered)  # fmt: skip


def encode_decoupled(
    encode: Encode,
    backbone: Backbone,
    media: Media,
    choice: MethodChoice,
    context: EncodeContext,
    progress=None,
    checkpoint=None,
    clip_frames: int | None = None,
) -> Encoded:
    """The past's encode of all but the newest frames, the instant's of those, joined."""
    cut = past_frames(media.num_frames, choice.method.instant(choice.params),
                      backbone.frames_per_step)  # fmt: skip
    past = None
    if cut:
        past = encode(backbone, first_frames(media, cut), past_choice(choice), context,
                      progress, checkpoint, clip_frames)  # fmt: skip
    fresh = newest_frames(media, media.num_frames - cut)
    instant = encode(backbone, fresh, instant_choice(choice, fresh.num_frames), context,
                     None, None, clip_frames)  # fmt: skip
    return join(backbone, past, instant)


def join(backbone: Backbone, past: Encoded | None, instant: Encoded) -> Encoded:
    """The prompt, the past's blocks, the instant's (numbered and stepped after them), and the
    suffix prefilled after all of them, one place after another."""
    past_steps = past.layout["steps"] if past is not None else 0
    blocks = list(past.blocks) if past is not None else []
    for block in instant.blocks:
        start, stop = block.steps
        blocks.append(replace(block, name=block_name(len(blocks)),
                              steps=(start + past_steps, stop + past_steps)))  # fmt: skip
    prefix = instant.prefix
    suffix, next_position = suffix_after(backbone, prefix, blocks, instant.suffix)
    spans = [prefix, *blocks, suffix]
    highest = max(int(p.max()) for span in spans for p in span.positions if p.numel())
    layout = dict(instant.layout)
    layout.update(
        next_position=next_position,
        position_limit=max(highest, next_position - 1) + 1,
        rope_deltas=0,  # the question follows the stored tokens, one place after another
        position_shift=0,
        steps=past_steps + instant.layout["steps"],
        step_lengths=(past.layout["step_lengths"] if past else []) + instant.layout["step_lengths"],
    )
    both = [e for e in (past, instant) if e is not None]
    stats = {
        "encode_s": sum(e.stats["encode_s"] for e in both),
        "peak_kv_bytes": max(e.stats["peak_kv_bytes"] for e in both),
        "visual_tokens_prefilled": sum(e.stats["visual_tokens_prefilled"] for e in both),
    }
    return Encoded(prefix=prefix, blocks=blocks, suffix=suffix, layout=layout,
                   visual_tokens_total=sum(e.visual_tokens_total for e in both), stats=stats,
                   representatives=instant.representatives)  # fmt: skip


def suffix_after(backbone: Backbone, prefix: Span, blocks: list[Span], like: Span):
    """(the suffix's span prefilled after the prompt and every block, the question's first
    place). Its places follow the stored tokens' count, as DSCache's `--continuous` places the
    question."""
    layers = len(prefix.keys)
    keys = [torch.cat([s.keys[i] for s in [prefix, *blocks]], dim=1) for i in range(layers)]
    values = [torch.cat([s.values[i] for s in [prefix, *blocks]], dim=1) for i in range(layers)]
    start = int(keys[0].shape[1])
    embeds = backbone.suffix_embeds()
    count = embeds.shape[1]
    if not count:
        return replace(like, keys=[k[:, :0] for k in keys], values=[v[:, :0] for v in values],
                       positions=[p[:, :0] for p in like.positions]), start  # fmt: skip
    cache = backbone.cache_from_layers(keys, values)
    positions = backbone.text_positions(start, count)
    backbone.forward(embeds, positions, cache)
    made = [(e.keys[0, :, start:].cpu(), e.values[0, :, start:].cpu()) for e in cache.layers]
    placed = positions.cpu()
    return Span("suffix", [k for k, _ in made], [v for _, v in made],
                [placed] * layers), start + count  # fmt: skip


class DecoupledLive:
    """A live stream's decoupled memory: its newest frames held, the frames leaving them fed to
    a live encode of the past (`past`, made by the caller: a LiveEncoder of past_choice)."""

    def __init__(self, backbone: Backbone, choice: MethodChoice, past, context, clip_frames):
        self.backbone, self.choice, self.past = backbone, choice, past
        self.context, self.clip_frames = context, clip_frames
        self.instant = choice.method.instant(choice.params)
        self.held: collections.deque = collections.deque()  # (time, frame) not yet in the past
        self.given = 0  # frames fed to the past

    def push(self, frame: np.ndarray, at: float, frames: int) -> None:
        """The stream's `frames`th frame; what now belongs to the past goes to it."""
        self.held.append((at, frame))
        due = past_frames(frames, self.instant, self.backbone.frames_per_step)
        while self.given < due:
            when, oldest = self.held.popleft()
            self.past.push(oldest, when)
            self.given += 1

    def end(self, times: list[float], encode: Encode, fork: bool) -> Encoded:
        past = None
        if self.given:
            past = self.past.memory() if fork else self.past.close()
        held, first = list(self.held), self.given

        def read(start: int, stop: int) -> np.ndarray:  # only the held frames are here
            return np.stack([frame for _, frame in held[start - first : stop - first]])

        media = newest_frames(Media("video", "live", "0" * 64, list(times), read), len(held))
        choice = instant_choice(self.choice, len(held))
        instant = encode(self.backbone, media, choice, self.context, None, None,
                         self.clip_frames)  # fmt: skip
        return join(self.backbone, past, instant)
