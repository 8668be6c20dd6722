"""An encode's fixed inputs and its media cut into chunks of whole temporal steps, the next chunk's
frames read ahead on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.encode.reducing import ChunkReducer
from mmkv_cli.media import Media

Progress = Callable[[int, int], None]  # (frames done, visual tokens done)
READ_AHEAD = False  # frames read ahead on a CPU too (tests: the same pack either way)


@dataclass
class Stream:
    """One encode's fixed inputs, shared by both runners."""

    backbone: Backbone
    media: Media
    layout: StreamLayout
    step_times: list[tuple[float, float]]
    chunk_frames: int
    progress: Progress | None
    reducer: ChunkReducer | None = None  # tokens dropped or merged before the prefill

    def chunks(self, unit_steps: int, skip: int = 0):
        """(first step, frames, frames done after it) of every chunk: whole multiples of
        `unit_steps` temporal steps, the last frame repeated to fill the last step. skip: chunks
        a resumed encode already has (their frames are not even read)."""
        per_step = self.backbone.frames_per_step
        unit = per_step * unit_steps
        size = max(unit, self.chunk_frames - self.chunk_frames % unit)
        firsts = range(skip * size, self.media.num_frames, size)
        for first, frames in zip(firsts, self._frames(firsts, size)):
            yield first // per_step, padded(frames, per_step), first + len(frames)

    def _frames(self, firsts: range, size: int):
        """Each chunk's frames in turn. On a GPU the next is read on a thread of its own while the
        caller works on this one: the host would otherwise decode while the device waits (on a
        CPU the encode keeps every core busy). One read at a time: the media is never read from
        two threads at once."""
        if not (READ_AHEAD or self.backbone.device.type == "cuda"):
            for first in firsts:
                yield self.media.read(first, first + size)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="mmkv-frames") as reading:
            ahead = [reading.submit(self.media.read, first, first + size) for first in firsts[:1]]
            for i in range(1, len(firsts) + 1):
                frames = ahead.pop().result()
                if i < len(firsts):
                    ahead.append(reading.submit(self.media.read, firsts[i], firsts[i] + size))
                yield frames

    def report(self, frames: int, tokens: int) -> None:
        if self.progress:
            self.progress(frames, tokens)


def step_times_of(media: Media, steps: int, per_step: int) -> list[tuple[float, float]]:
    times = media.timestamps
    return [
        (times[min(s * per_step, len(times) - 1)], times[min((s + 1) * per_step, len(times)) - 1])
        for s in range(steps)
    ]


def padded(frames: np.ndarray, multiple: int) -> np.ndarray:
    """Repeat the last frame so a chunk fills whole temporal steps (as the HF video processors
    do)."""
    extra = (-len(frames)) % multiple
    return np.concatenate([frames, np.repeat(frames[-1:], extra, axis=0)]) if extra else frames
