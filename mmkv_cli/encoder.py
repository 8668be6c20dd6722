"""media -> backbone -> memory policy: stream frames through one running cache, then cut it into segments."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from mmkv_cli.attention import Recorder, recording
from mmkv_cli.backbones import Backbone
from mmkv_cli.blockwise import chunk_plans, order_blocks, prefill_blocks
from mmkv_cli.errors import MediaError
from mmkv_cli.media import Media
from mmkv_cli.methods import MemoryPolicy, StreamState
from mmkv_cli.pack import Segment

Progress = Callable[[int, int], None]  # (frames done, visual tokens done)


@dataclass
class Encoded:
    prefix: Segment
    blocks: list[Segment]
    suffix: Segment
    layout: dict
    visual_tokens_total: int
    stats: dict = field(default_factory=dict)


def _segment(
    name: str, cache, starts: list[int], stop: int | None, positions: torch.Tensor
) -> Segment:
    """Cache entries [starts[layer], stop) of every layer (layers may hold different counts before them)."""
    keys = [e.keys[0, :, start:stop].cpu() for e, start in zip(cache.layers, starts)]
    values = [e.values[0, :, start:stop].cpu() for e, start in zip(cache.layers, starts)]
    return Segment(name=name, keys=keys, values=values, positions=[positions.cpu()] * len(keys))


def _step_times(media: Media, steps: int, per_step: int) -> list[tuple[float, float]]:
    times = media.timestamps
    return [
        (times[min(s * per_step, len(times) - 1)], times[min((s + 1) * per_step, len(times)) - 1])
        for s in range(steps)
    ]


def _padded(frames: np.ndarray, multiple: int) -> np.ndarray:
    """Repeat the last frame so a chunk fills whole temporal steps (as the HF video processors do)."""
    extra = (-len(frames)) % multiple
    return np.concatenate([frames, np.repeat(frames[-1:], extra, axis=0)]) if extra else frames


def encode_media(
    backbone: Backbone,
    media: Media,
    policy: MemoryPolicy,
    chunk_frames: int,
    progress: Progress | None = None,
) -> Encoded:
    if media.num_frames == 0:
        raise MediaError(f"no frames in {media.source}")
    start_time = time.perf_counter()
    per_step = backbone.frames_per_step
    steps = -(-media.num_frames // per_step)
    frame_hw = tuple(media.read(0, 1).shape[1:3])
    step_times = _step_times(media, steps, per_step)
    layout = backbone.stream_layout(frame_hw, step_times)
    total = sum(layout.step_lengths)

    cache = backbone.new_cache()
    prefix_ids = backbone.text_ids(backbone.prompt.prefix)
    backbone.forward(backbone.embed_ids(prefix_ids), layout.prefix, cache)
    prefix = _segment("prefix", cache, [0] * len(cache.layers), len(prefix_ids), layout.prefix)
    run = _encode_blockwise if getattr(policy, "blockwise", False) else _encode_stream
    blocks, cache, visual_end, peak_kv, shift = run(
        backbone, media, policy, chunk_frames, progress, layout, step_times, cache, prefix
    )
    suffix_embeds = backbone.suffix_embeds()
    suffix_positions = layout.suffix - shift  # a policy that compacted positions moved the rest up
    if suffix_embeds.shape[1]:
        backbone.forward(suffix_embeds, suffix_positions, cache)
    suffix = _segment("suffix", cache, visual_end, None, suffix_positions)
    return Encoded(
        prefix=prefix,
        blocks=blocks,
        suffix=suffix,
        visual_tokens_total=total,
        layout={
            "position_dims": backbone.position_dims,
            "next_position": layout.next_position - shift,
            "rope_deltas": layout.rope_delta - shift,
            "position_shift": shift,
            "frames_per_step": per_step,
            "steps": steps,
            "tokens_per_step": layout.grid[0] * layout.grid[1],
            "step_lengths": layout.step_lengths,
            "grid": list(layout.grid),
            "frame_size": list(frame_hw),
        },
        stats={"encode_s": time.perf_counter() - start_time, "peak_kv_bytes": peak_kv},
    )


def _chunk_size(chunk_frames: int, unit: int) -> int:
    return max(unit, chunk_frames - chunk_frames % unit)


def _encode_stream(
    backbone, media, policy, chunk_frames, progress, layout, step_times, cache, prefix
):
    """One running cache over the whole stream; the policy may evict after every chunk."""
    per_step = backbone.frames_per_step
    lengths = torch.tensor(layout.step_lengths)
    total = int(lengths.sum())
    after = (
        layout.suffix[:, :1]
        if layout.suffix.shape[1]
        else torch.full_like(layout.visual[:, :1], layout.next_position)
    )
    state = StreamState(
        cache=cache,
        prefix_len=prefix.layer_counts[0],
        positions=layout.visual.cpu().clone(),
        token_step=torch.repeat_interleave(torch.arange(len(step_times)), lengths),
        kept=[torch.empty(0, dtype=torch.long) for _ in cache.layers],
        seen=0,
        total=total,
        layout_positions=torch.cat([layout.visual, after], dim=1).cpu(),
        position_limit=int(getattr(backbone.text_config, "max_position_embeddings", 1 << 30)),
        rope=backbone.rope_tables(),
    )
    state.attend = lambda text, rows=False: text_attention(backbone, state, text, rows)
    chunk = _chunk_size(chunk_frames, per_step)
    peak_kv = 0
    for first in range(0, media.num_frames, chunk):
        frames = _padded(media.read(first, first + chunk), per_step)
        embeds, extra = backbone.visual_chunk(
            frames, step_times[first // per_step : (first + chunk) // per_step], layout
        )
        n = embeds.shape[1]
        placed = state.layout_positions[:, state.seen : state.seen + n] - state.shift
        state.positions[:, state.seen : state.seen + n] = placed
        recorder = policy.recorder(state)  # H2O, MEDA: what every query row of the chunk attends to
        with recording(recorder) if recorder else nullcontext():
            backbone.forward(embeds, placed, cache, **extra)
        new = torch.arange(state.seen, state.seen + n)
        state.kept = [torch.cat([k, new]) for k in state.kept]
        state.seen += n
        if recorder:
            policy.observe(state, recorder)
        peak_kv = max(peak_kv, state.kv_bytes())
        policy.after_chunk(state)
        if progress:
            progress(min(first + chunk, media.num_frames), state.seen)
    _check_count(media, state.seen, total)
    policy.finish(state)
    blocks = policy.make_blocks(state, step_times)
    visual_end = [state.visual_start(layer) + len(k) for layer, k in enumerate(state.kept)]
    return blocks, cache, visual_end, max(peak_kv, state.kv_bytes()), state.shift


def text_attention(backbone: Backbone, state: StreamState, text: str, rows: bool = False):
    """Per layer, the attention the rows of `text` (as a question turn after the stream so far) pay each cached
    visual token, mean over heads and rows; scored rows only, then the text is cut off the cache again.

    rows=True: per layer the text rows' attention over all keys [q, k], with the key columns of the cached
    visual tokens and of the text, as (rows, visual slices, text slices).
    """
    ids = backbone.question_ids(text)
    lengths = [int(e.keys.shape[2]) for e in state.cache.layers]
    last_step = state.token_step[: state.seen] == state.token_step[state.seen - 1]
    start = (
        int(state.positions[:, : state.seen][:, last_step].max()) + 1
    )  # right after the newest step
    recorder = Recorder(layers=set(range(state.layers)), column_sums=not rows, rows=rows)
    with recording(recorder):
        backbone.forward(
            backbone.embed_ids(ids), backbone.text_positions(start, len(ids)), state.cache
        )
    for entry, n in zip(state.cache.layers, lengths):
        entry.keys, entry.values = entry.keys[:, :, :n], entry.values[:, :, :n]
    if rows:
        return (
            [recorder.row[layer][0].cpu() for layer in range(state.layers)],
            [slice(state.visual_start(layer), n) for layer, n in enumerate(lengths)],
            [slice(n, n + len(ids)) for n in lengths],
        )
    return [
        recorder.column_sum[layer][0, state.visual_start(layer) : lengths[layer]].cpu() / len(ids)
        for layer in range(state.layers)
    ]


def _encode_blockwise(
    backbone, media, policy, chunk_frames, progress, layout, step_times, cache, prefix
):
    """Independent blocks after the init prompt, whole segments per chunk; the suffix follows the init prompt."""
    per_step = backbone.frames_per_step
    chunk = _chunk_size(chunk_frames, per_step * policy.segment_steps(per_step))
    blocks, seen, peak_kv = [], 0, 0
    for first in range(0, media.num_frames, chunk):
        frames = _padded(media.read(first, first + chunk), per_step)
        first_step = first // per_step
        times = step_times[first_step : first_step + len(frames) // per_step]
        embeds, extra = backbone.visual_chunk(frames, times, layout)
        n = embeds.shape[1]
        plans = chunk_plans(policy, layout, first_step, len(times), per_step)
        made, peak = prefill_blocks(
            backbone,
            policy,
            prefix,
            embeds,
            extra,
            layout.visual[:, seen : seen + n].cpu(),
            plans,
            step_times,
            int(policy.params.get("batch_tokens", 4096)),
        )
        blocks += made
        seen += n
        peak_kv = max(peak_kv, peak)
        if progress:
            progress(min(first + chunk, media.num_frames), seen)
    _check_count(media, seen, sum(layout.step_lengths))
    return order_blocks(blocks), cache, prefix.layer_counts, peak_kv, 0


def _check_count(media: Media, seen: int, total: int) -> None:
    if seen != total:
        raise MediaError(
            f"{media.source}: expected {total} visual tokens, the backbone gave {seen}"
        )
