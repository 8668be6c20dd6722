"""A stream still arriving: frames pushed as they come, the running cache fed a chunk at a time,
and at any moment the memory as it is then, as a pack holds it.

The memory at moment T is, by construction, what an encode of the media cut at T holds: the same
chunks through the same chunk step (encoder.stream_chunk), and the end of the stream (the frames
after the last whole chunk, the last eviction, `finish`, the suffix) played on a copy of the state,
so the stream goes on untouched. Two things a file's encode knows ahead, a live one learns late:
- the stream's length, so a method that evicts while streaming needs its budget as a token count,
  not a share of a length nobody knows yet;
- where the next step sits, which a chunk's eviction uses to place what follows (HERMES's
  re-indexing): a chunk's `after_chunk` runs once the next step's first frame is in.
A blockwise method (MuKV) keeps no running state: its blocks are made as whole segments come in,
the segment still arriving is made on the spot for a memory; its budget is a share of each block.
"""

from __future__ import annotations

import collections
import copy
import time
from dataclasses import replace

import numpy as np
import torch

from mmkv_cli.backbones import reuse_families, tower_families
from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.backbones.layouts import extend_layout
from mmkv_cli.core.errors import MediaError
from mmkv_cli.encode.blockwise import chunk_plans, order_blocks, prefill_blocks
from mmkv_cli.encode.decoupled import DecoupledLive, past_choice
from mmkv_cli.encode.encoder import (
    Encoded,
    Streamed,
    _span,
    encode_media,
    finished,
    stream_chunk,
)
from mmkv_cli.encode.reducing import ChunkReducer
from mmkv_cli.encode.stream import padded, visual_tokens
from mmkv_cli.encode.text_attention import text_attention
from mmkv_cli.kernels.host import HostCopies
from mmkv_cli.media.base import Media
from mmkv_cli.methods import Budget, EncodeContext
from mmkv_cli.methods.choice import MethodChoice, check_live
from mmkv_cli.methods.running_cache import RunningCache, StreamState
from mmkv_cli.pack import Span
from mmkv_cli.reduce.choice import check_reducer


class LiveEncoder:
    """The memory of one stream, fed frame by frame (times in seconds from its first)."""

    def __init__(self, backbone: Backbone, choice: MethodChoice, context: EncodeContext):
        self.backbone, self.choice = backbone, check_live(choice)
        check_reducer(choice.reduce, "video", backbone.family, tower_families(), reuse_families())
        self.context = context
        self.per_step = backbone.frames_per_step
        # the same reducer a file's encode runs, carried chunk to chunk (a memory copies it)
        self.reducer = ChunkReducer(choice.reduce) if choice.reduce is not None else None
        budget = choice.budget or Budget(share=1.0)
        # a memory of the newest frames alone (SimpleStream) holds those frames, and encodes them
        # when it is asked for, as a file's encode of the stream cut there does
        self.window = choice.method.window(choice.params) if choice.method.window else None
        self.recent: collections.deque = collections.deque(maxlen=self.window or 1)
        # a memory apart from its newest frames (DSCache) feeds a live past what leaves them
        self.decoupled = None
        if choice.method.instant is not None:
            past = LiveEncoder(backbone, past_choice(choice), context)
            clip = backbone.spec.max_frames
            self.decoupled = DecoupledLive(backbone, choice, past, context, clip)
        if choice.method.blockwise is not None:
            self.runner = BlockRunner(self, choice.method.blockwise(choice.params, budget))
            unit = self.per_step * self.runner.policy.segment_steps(self.per_step)
        else:
            self.runner = StreamRunner(
                self, choice.method.streaming(choice.params, budget, context)
            )
            unit = self.per_step
        frames = choice.params.chunk_frames
        self.chunk_size = max(unit, frames - frames % unit)  # whole steps (segments), as a file's
        self.times: list[float] = []  # every frame's time so far
        self.steps: list[tuple[float, float]] = []  # each whole step's first and last frame time
        self.placed: StreamLayout | None = None  # the layout of the whole steps, grown per chunk
        self.pending: list[np.ndarray] = []  # frames after the last whole chunk
        self.frame_hw: tuple[int, int] | None = None
        self.started = time.perf_counter()
        # frames are sized as for a clip of the model's most frames (a family that sizes them by
        # the clip's length cannot wait for a live stream's)
        self.clip_frames = backbone.spec.max_frames

    @property
    def moment(self) -> float | None:
        """The time of the newest frame in the memory (None before the first)."""
        return self.times[-1] if self.times else None

    def push(self, frame: np.ndarray, at: float) -> None:
        """One frame of the stream, at `at` seconds (after every earlier frame's)."""
        if self.frame_hw is None:  # a window encodes its frames when asked: no prompt to run now
            apart = self.window is not None or self.decoupled is not None
            self.frame_hw = tuple(frame.shape[:2]) if apart else self._begin(frame)
        elif tuple(frame.shape[:2]) != self.frame_hw:
            h, w = self.frame_hw
            raise MediaError(
                f"the stream changed resolution at {at:.2f} s ({w}x{h} -> "
                f"{frame.shape[1]}x{frame.shape[0]})"
            )
        if self.times and at <= self.times[-1]:
            raise MediaError(f"a frame at {at:.3f} s came after one at {self.times[-1]:.3f} s")
        self.times.append(float(at))
        if self.window is not None:
            self.recent.append((float(at), frame))
            return
        if self.decoupled is not None:
            self.decoupled.push(frame, float(at), len(self.times))
            return
        if len(self.times) % self.per_step == 0:  # a step is whole: its times never change
            self.steps.append((self.times[-self.per_step], self.times[-1]))
        self.pending.append(frame)
        if len(self.pending) == 1:
            self.runner.next_step()
        if len(self.pending) == self.chunk_size:
            frames, self.pending = np.stack(self.pending), []
            self.runner.chunk(frames, (len(self.times) - len(frames)) // self.per_step)

    def memory(self) -> Encoded:
        """The memory now, as the pack of the stream cut at its newest frame holds it; the stream
        goes on untouched."""
        return self._end(fork=True)

    def close(self) -> Encoded:
        """The stream has ended: its final memory (the running state is spent on it)."""
        return self._end(fork=False)

    # --- what both runners share ---

    def _begin(self, frame: np.ndarray) -> tuple[int, int]:
        """The prompt run and the runner begun on the first frame; its (height, width)."""
        backbone = self.backbone
        self.frame_hw = tuple(frame.shape[:2])
        layout = backbone.stream_layout(self.frame_hw, [(0.0, 0.0)], self.clip_frames)
        self.cache = backbone.new_cache()
        prefix_ids = backbone.text_ids(backbone.prompt.prefix)
        backbone.forward(backbone.embed_ids(prefix_ids), layout.prefix, self.cache)
        self.prompt_len, self.prefix_positions = len(prefix_ids), layout.prefix
        self.runner.begin()
        return self.frame_hw

    def step_times(self, frames: int) -> list[tuple[float, float]]:
        """Each temporal step's (first, last) frame time over the first `frames` frames (a step
        not yet whole is as the last step of a cut stream is: its last frame repeated)."""
        whole, per = frames // self.per_step, self.per_step
        if whole * per == frames:
            return self.steps[:whole]
        return [*self.steps[:whole], (self.times[whole * per], self.times[frames - 1])]

    def layout(self, frames: int) -> StreamLayout:
        """The layout of the first `frames` frames (what is placed never moves as more come):
        grown from the whole steps' layout by the new steps alone where the family allows it."""
        steps = self.step_times(frames)
        layout = extend_layout(self.backbone, self.placed, self.frame_hw, steps, self.clip_frames)
        if frames % self.per_step == 0 and frames == len(self.times):
            self.placed = layout
        return layout

    def prefix(self, cache, layers: int, shifts: list[int] | None = None) -> Span:
        return _span("prefix", cache, [0] * layers, self.prompt_len, self.prefix_positions, shifts)

    def _end(self, fork: bool) -> Encoded:
        if self.frame_hw is None:
            raise MediaError("the stream gave no frame yet")
        if self.window is not None:
            return self._window()
        if self.decoupled is not None:
            encoded = self.decoupled.end(self.times, encode_media, fork)
            return replace(encoded, stats={**encoded.stats, "live": True})
        frames = len(self.times)
        layout = self.layout(frames)
        pending = padded(np.stack(self.pending), self.per_step) if self.pending else None
        first = (frames - len(self.pending)) // self.per_step
        prefix, done = self.runner.end(fork, layout, pending, first)
        encoded = finished(self.backbone, layout, prefix, done, self.frame_hw, self.started)
        return replace(encoded, stats={**encoded.stats, "live": True})

    def _window(self) -> Encoded:
        """The newest frames, encoded now as the stream cut here would be (the stream's every
        time is given: the pack records how much of it there was)."""
        held, first = list(self.recent), len(self.times) - len(self.recent)

        def read(start: int, stop: int) -> np.ndarray:  # only the window's frames are held
            return np.stack([frame for _, frame in held[start - first : stop - first]])

        media = Media("video", "live", "0" * 64, list(self.times), read)
        encoded = encode_media(
            self.backbone, media, self.choice, self.context, clip_frames=self.clip_frames
        )
        return replace(encoded, stats={**encoded.stats, "live": True})


class StreamRunner:
    """A streaming memory policy over one running cache."""

    def __init__(self, owner: LiveEncoder, policy):
        self.owner, self.policy = owner, policy
        self.evict_due = False  # a chunk went in; its eviction waits for the next step's place
        self.peak_kv = 0

    def begin(self) -> None:
        owner, backbone = self.owner, self.owner.backbone
        running = RunningCache(owner.cache, owner.prompt_len, backbone.position_dims)
        self.state = StreamState(
            cache=running,
            token_step=torch.zeros(0, dtype=torch.long),
            layout_positions=torch.zeros(backbone.position_dims, 1, dtype=torch.long),
            total=0,
            position_limit=int(backbone.text_config.max_position_embeddings),
            rope=backbone.rope_tables(),
            family=backbone.family,
            frames_per_step=backbone.frames_per_step,
        )
        self._bind(self.state)

    def next_step(self) -> None:
        """The first frame after a chunk is in: the chunk's eviction knows where that step sits."""
        if self.evict_due:
            self._place(self.state, len(self.owner.times))
            self.policy.after_chunk(self.state)
            self.evict_due = False

    def chunk(self, frames: np.ndarray, first: int) -> None:
        done = len(self.owner.times)
        layout = self._place(self.state, done)
        steps = self.owner.step_times(done)[first:]
        backbone, reducer = self.owner.backbone, self.owner.reducer
        stream_chunk(backbone, self.state, self.policy, frames, steps, layout, reducer)
        self.peak_kv = max(self.peak_kv, self.state.cache.kv_bytes())
        self.evict_due = True

    def end(self, fork: bool, layout: StreamLayout, pending, first: int):
        state, policy, reducer = self.state, self.policy, self.owner.reducer
        if fork:  # the KV shared, never copied (RunningCache.fork); the policy's state copied
            state = replace(self.state, cache=self.state.cache.fork(), attend=None)
            policy = copy.deepcopy(self.policy)
            reducer = copy.copy(reducer)  # its tensors are replaced, never written in place
            self._bind(state)
        frames = len(self.owner.times)
        self._place(state, frames)
        if pending is not None:  # the stream's last chunk: what came after the last whole one
            steps = self.owner.step_times(frames)[first:]
            stream_chunk(self.owner.backbone, state, policy, pending, steps, layout, reducer)
        if pending is not None or self.evict_due:
            policy.after_chunk(state)  # seen == total: the last chunk's eviction
        peak = max(self.peak_kv, state.cache.kv_bytes())
        policy.finish(state)
        blocks = policy.make_blocks(state, self.owner.step_times(frames))
        state.attend = None
        running = state.cache
        visual_end = [running.visual_start(i) + running.count(i) for i in range(state.layers)]
        # MEDA may merge into it; HERMES may have moved a layer as a whole
        prefix = self.owner.prefix(running.cache, state.layers, running.prompt_shift)
        done = Streamed(
            blocks,
            running.cache,
            visual_end,
            peak,
            state.shift,
            prefilled=state.prefilled,
            head_masks=running.head_masks(),
            prompt_shift=list(running.prompt_shift),
        )
        return prefix, done

    def _bind(self, state: StreamState) -> None:
        backbone = self.owner.backbone
        state.attend = lambda text, **how: text_attention(backbone, state, text, **how)
        state.embed_text = lambda text: backbone.embed_ids(backbone.text_ids(text))[0].detach()

    def _place(self, state: StreamState, frames: int) -> StreamLayout:
        """The layout of the first `frames` frames, set on `state`: where its tokens go, and the
        position that follows them. What is already placed must not move; what follows it is
        laid out anew (a step not yet whole may still change), so the work is the new tokens'."""
        layout = self.owner.layout(frames)
        after = (
            layout.suffix[:, :1]
            if layout.suffix.shape[1]
            else torch.full_like(layout.visual[:, :1], layout.next_position)
        )
        seen = state.seen
        ends_placed = [0, seen - 1]  # a family laid out whole would move them all, if any
        if seen and not torch.equal(
            layout.visual[:, ends_placed].cpu(), state.layout_positions[:, ends_placed]
        ):
            raise MediaError("internal: a live stream's layout moved tokens already placed")
        ends = np.cumsum(layout.step_lengths)
        first = int(np.searchsorted(ends, seen, side="right"))  # the step token `seen` is in
        begun = int(ends[first - 1]) if first else 0
        counts = torch.tensor(layout.step_lengths[first:], dtype=torch.long)
        tail = torch.repeat_interleave(torch.arange(first, len(ends)), counts)[seen - begun :]
        state.layout_positions = torch.cat(
            [state.layout_positions[:, :seen], layout.visual[:, seen:].cpu(), after.cpu()], dim=1
        )
        state.token_step = torch.cat([state.token_step[:seen], tail])
        state.total = int(ends[-1]) if len(ends) else 0
        return layout


class BlockRunner:
    """A blockwise memory policy: blocks of whole segments, each prefilled after the init prompt."""

    def __init__(self, owner: LiveEncoder, policy):
        self.owner, self.policy = owner, policy
        self.blocks: list[Span] = []
        self.seen = 0  # visual tokens made into blocks
        self.prefilled = 0  # of those, the ones the reducer let through
        self.peak_kv = 0

    def begin(self) -> None:
        self.policy.begin(1)  # a share of each block: the stream's length does not enter it
        self.prefix_span = self.owner.prefix(self.owner.cache, len(self.owner.cache.layers))

    def next_step(self) -> None:
        pass  # blocks are independent: nothing waits for the next step

    def chunk(self, frames: np.ndarray, first: int) -> None:
        reducer = self.owner.reducer
        made, seen, peak, prefilled = self._made(frames, first, len(self.owner.times), reducer)
        self.seen, self.prefilled = self.seen + seen, self.prefilled + prefilled
        self.blocks += made
        self.peak_kv = max(self.peak_kv, peak)

    def end(self, fork: bool, layout: StreamLayout, pending, first: int):
        blocks, peak, prefilled = list(self.blocks), self.peak_kv, self.prefilled
        if pending is not None:  # the segment still arriving, made on the spot
            reducer = copy.copy(self.owner.reducer) if fork else self.owner.reducer
            made, _, more, extra = self._made(pending, first, len(self.owner.times), reducer)
            blocks, peak, prefilled = blocks + made, max(peak, more), prefilled + extra
        cache = copy.deepcopy(self.owner.cache) if fork else self.owner.cache  # the suffix follows
        counts = self.prefix_span.layer_counts
        space = self.policy.retrieval_space
        done = Streamed(order_blocks(blocks), cache, counts, peak, 0, space, prefilled)
        return self.prefix_span, done

    def _made(self, frames: np.ndarray, first: int, done: int, reducer):
        """The blocks of one chunk of whole segments (the last may be short): (blocks, tokens it
        gave, peak KV bytes, tokens prefilled)."""
        owner, backbone, seen = self.owner, self.owner.backbone, self.seen
        layout = owner.layout(done)
        steps = owner.step_times(done)[first:]
        embeds, extra, keep = visual_tokens(backbone, frames, steps, layout, first, reducer)
        n = embeds.shape[1]
        plans = chunk_plans(self.policy, layout, first, len(steps), owner.per_step, keep)
        starts = torch.cumsum(torch.tensor([0, *layout.step_lengths[:-1]]), 0)
        origins = layout.visual[:, starts].cpu()
        positions = layout.visual[:, seen : seen + n].cpu()
        made, peak = prefill_blocks(
            backbone,
            self.policy,
            self.prefix_span,
            embeds,
            extra,
            positions,
            plans,
            owner.step_times(done),
            origins,
            copies := HostCopies(backbone.device),
        )
        copies.settle()  # a live memory answers between chunks: its blocks are read now
        return made, n, peak, n if keep is None else int(keep.sum())
