"""An encode's fixed inputs and its media cut into chunks of whole temporal steps, the next chunk's
frames read and prepared ahead on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.core.errors import MediaError
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
        """(first step, frames, frames done after it, the backbone's inputs made of them or None)
        of every chunk: whole multiples of `unit_steps` temporal steps, the last frame repeated to
        fill the last step. skip: chunks a resumed encode already has (their frames are not even
        read)."""
        per_step = self.backbone.frames_per_step
        unit = per_step * unit_steps
        size = max(unit, self.chunk_frames - self.chunk_frames % unit)
        firsts = range(skip * size, self.media.num_frames, size)
        for first, (frames, count, inputs) in zip(firsts, self._loaded(firsts, size)):
            yield first // per_step, frames, first + count, inputs

    def _loaded(self, firsts: range, size: int):
        """Each chunk's (frames, how many were read, inputs) in turn. On a GPU the next chunk is
        read and prepared by the backbone's processor (into pinned memory) on a thread of its own
        while the caller works on this one: the host would otherwise decode and prepare while the
        device waits (on a CPU the encode keeps every core busy). One chunk at a time: the media
        and the processor are never used from two threads at once."""
        if not (READ_AHEAD or self.backbone.device.type == "cuda"):
            for first in firsts:
                yield self._load(first, size, prepare=False)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="mmkv-frames") as reading:
            ahead = [reading.submit(self._load, first, size) for first in firsts[:1]]
            for i in range(1, len(firsts) + 1):
                loaded = ahead.pop().result()
                if i < len(firsts):
                    ahead.append(reading.submit(self._load, firsts[i], size))
                yield loaded

    def _load(self, first: int, size: int, prepare: bool = True) -> tuple:
        """(frames [first, first + size) padded to whole steps, how many were read, the
        backbone's inputs made of them, or None unless `prepare`)."""
        frames = self.media.read(first, first + size)
        count, frames = len(frames), padded(frames, self.backbone.frames_per_step)
        if not prepare:
            return frames, count, None
        inputs = self.backbone.prepare(frames, self.layout)
        if inputs is not None and self.backbone.device.type == "cuda":  # sent without a wait
            inputs = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in inputs.items()}
        return frames, count, inputs

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


def reducer_saved(stream: Stream) -> dict:
    """The reducer's state for a checkpoint, its names under reduce."""
    if stream.reducer is None:
        return {}
    return {f"reduce.{k}": v for k, v in stream.reducer.saved().items()}


def restore_reducer(stream: Stream, tensors: dict) -> None:
    """Take back what reducer_saved gave."""
    if stream.reducer is not None:
        stream.reducer.restore(named_under(tensors, "reduce."))


def named_under(tensors: dict, prefix: str) -> dict:
    """The checkpoint's tensors named `prefix`..., by the rest of their names."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def visual_tokens(
    backbone: Backbone,
    frames: np.ndarray,
    steps: list[tuple[float, float]],
    layout: StreamLayout,
    first_step: int,
    reducer: ChunkReducer | None,
    inputs: dict | None = None,
) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """A chunk's stream tokens, extra LM inputs, and which of them to prefill (None: all).
    inputs: the backbone's prepared for these frames (None: made now)."""
    if reducer is None:
        return (*backbone.visual_chunk(frames, steps, layout, inputs), None)
    return reducer.visual(backbone, frames, steps, layout, first_step, inputs)


def check_count(media: Media, seen: int, total: int) -> None:
    if seen != total:
        raise MediaError(
            f"{media.source}: expected {total} visual tokens, the backbone gave {seen}"
        )
