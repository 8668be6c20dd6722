"""media -> backbone -> memory policy: stream frames through one running cache (or, for a blockwise
policy, prefill blocks on their own), then cut what is kept into the pack's spans."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch

from mmkv_cli.backbones import reuse_families, tower_families
from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.core.errors import MediaError
from mmkv_cli.encode.blockwise import encode_blockwise
from mmkv_cli.encode.checkpoint import Checkpointing
from mmkv_cli.encode.decoupled import encode_decoupled
from mmkv_cli.encode.reducing import ChunkReducer, grid_index
from mmkv_cli.encode.results import Encoded, Streamed, layout_record
from mmkv_cli.encode.saved_state import (
    restore_running_cache,
    running_cache_tensors,
)
from mmkv_cli.encode.sealing import EarlyTarget, Sealing, open_sealing
from mmkv_cli.encode.stream import (
    Progress,
    Stream,
    check_count,
    named_under,
    reducer_saved,
    restore_reducer,
    step_times_of,
    visual_tokens,
)
from mmkv_cli.encode.text_attention import text_attention
from mmkv_cli.encode.window import newest_frames, stream_tokens
from mmkv_cli.kernels.attention import masking, recording
from mmkv_cli.kernels.host import host_all
from mmkv_cli.media import Media
from mmkv_cli.methods import Budget, EncodeContext
from mmkv_cli.methods.base import StreamingMemory
from mmkv_cli.methods.choice import MethodChoice
from mmkv_cli.methods.running_cache import RunningCache, StreamState
from mmkv_cli.pack import Span
from mmkv_cli.reduce.choice import check_reducer


def _span(
    name: str,
    cache,
    starts: list[int],
    stop: int | None,
    positions: torch.Tensor,
    shifts: list[int] | None = None,
) -> Span:
    """Cache entries [starts[layer], stop) of every layer (layers may hold different counts
    before), at `positions` moved by shifts[layer] in each (a layer a policy moved as a whole)."""
    keys = [e.keys[0, :, start:stop] for e, start in zip(cache.layers, starts)]
    values = [e.values[0, :, start:stop] for e, start in zip(cache.layers, starts)]
    held = host_all(keys + values)  # one wait for every layer's, not one each
    layers = len(keys)
    positions = positions.cpu()
    placed = [positions + shift if shift else positions for shift in (shifts or [0] * layers)]
    return Span(name, held[:layers], held[layers:], placed)


def encode_media(
    backbone: Backbone,
    media: Media,
    choice: MethodChoice,
    context: EncodeContext | None = None,
    progress: Progress | None = None,
    checkpoint: Checkpointing | None = None,
    clip_frames: int | None = None,
    early: EarlyTarget | None = None,
) -> Encoded:
    """clip_frames: the clip length frames are sized for (Backbone.stream_layout; None: the
    media's own): a live stream's memory at T is this encode of the media cut at T, at the size the
    stream pins. early: where the pack goes, to write it while encoding where the method keeps
    every token as prefilled (encode/sealing.py says when); the result's `early` then holds it,
    for record.write_encoded to finish."""
    if media.num_frames == 0:
        raise MediaError(f"no frames in {media.source}")
    if choice.method.instant is not None:  # the newest frames apart from the memory (DSCache)
        context = context or EncodeContext(media.kind)
        return encode_decoupled(encode_media, backbone, media, choice, context, progress,
                                checkpoint, clip_frames)  # fmt: skip
    whole = media
    if choice.method.window is not None:  # the newest frames alone (SimpleStream)
        media = newest_frames(media, choice.method.window(choice.params))
    check_reducer(choice.reduce, media.kind, backbone.family, tower_families(), reuse_families())
    started = time.perf_counter()
    per_step = backbone.frames_per_step
    steps = -(-media.num_frames // per_step)
    frame_hw = tuple(media.read(0, 1).shape[1:3])
    step_times = step_times_of(media, steps, per_step)
    layout = backbone.stream_layout(frame_hw, step_times, clip_frames)
    cache = backbone.new_cache()
    prefix_ids = backbone.text_ids(backbone.prompt.prefix)
    backbone.forward(backbone.embed_ids(prefix_ids), layout.prefix, cache)
    prefix = _span("prefix", cache, [0] * len(cache.layers), len(prefix_ids), layout.prefix)
    reducer = ChunkReducer(choice.reduce) if choice.reduce is not None else None
    stream = Stream(
        backbone, media, layout, step_times, choice.params.chunk_frames, progress, reducer
    )
    budget = choice.budget or Budget(share=1.0)
    method = choice.method
    if method.blockwise is not None:
        memory = method.blockwise(choice.params, budget)
        done = encode_blockwise(stream, memory, prefix, cache, checkpoint)
    else:
        policy = method.streaming(choice.params, budget, context or EncodeContext(media.kind))
        saving = checkpoint is not None and (checkpoint.every or checkpoint.restored)
        sealing = None
        if early is not None and policy.seals_as_prefilled and not saving:
            sealing = open_sealing(
                early, backbone, layout, step_times, policy, prefix, frame_hw, reducer
            )
        try:
            done = encode_streaming(
                stream, policy, cache, prefix.layer_counts[0], checkpoint, sealing
            )
            # read back: a policy may have merged evicted tokens into the prompt's KV (MEDA)
            prefix = _span(
                "prefix",
                done.cache,
                [0] * len(cache.layers),
                len(prefix_ids),
                layout.prefix,
                done.prompt_shift,
            )
            encoded = finished(backbone, layout, prefix, done, frame_hw, started)
            if whole is not media:  # its pack records what the stream gave, not the window's
                total = stream_tokens(backbone, whole, frame_hw, clip_frames)
                encoded = replace(encoded, visual_tokens_total=total)
        except BaseException:
            if sealing is not None:
                sealing.pack.abandon()
            raise
        return replace(encoded, early=sealing.pack if sealing else None)
    return finished(backbone, layout, prefix, done, frame_hw, started)


def finished(
    backbone: Backbone,
    layout: StreamLayout,
    prefix: Span,
    done: Streamed,
    frame_hw: tuple[int, int],
    started: float,
) -> Encoded:
    """What a runner left, as the pack's spans: the suffix prefilled after it."""
    suffix_positions = layout.suffix - done.shift  # a policy that compacted moved the rest up
    suffix_embeds = backbone.suffix_embeds()
    if suffix_embeds.shape[1]:  # each head attends to what it holds
        with masking(done.head_masks):
            backbone.forward(suffix_embeds, suffix_positions, done.cache)
    suffix = _span("suffix", done.cache, done.visual_end, None, suffix_positions)
    per_head = bool(done.head_masks)
    if per_head:  # the blocks are stored per (layer, KV head): so are the prefix and suffix
        prefix, suffix = prefix.by_head(), suffix.by_head()
    total = sum(layout.step_lengths)
    return Encoded(
        prefix=prefix,
        blocks=done.blocks,
        suffix=suffix,
        visual_tokens_total=total,
        representatives=done.representatives,
        per_head=per_head,
        layout=layout_record(backbone, layout, done.shift, frame_hw),
        stats={
            "encode_s": time.perf_counter() - started,
            "peak_kv_bytes": done.peak_kv_bytes,
            "visual_tokens_prefilled": total if done.prefilled is None else done.prefilled,
        },
    )


def encode_streaming(
    stream: Stream,
    policy: StreamingMemory,
    cache,
    prompt_len: int,
    checkpoint: Checkpointing | None = None,
    sealing: Sealing | None = None,
) -> Streamed:
    """One running cache over the whole stream; the policy may evict after every chunk. With
    `checkpoint`, the state is saved every N chunks, and a resume starts where it was saved. With
    `sealing`, each chunk's blocks go to the pack's writer as the chunk goes in, and none are made
    at the end."""
    backbone, layout = stream.backbone, stream.layout
    lengths = torch.tensor(layout.step_lengths)
    total = int(lengths.sum())
    after = (
        layout.suffix[:, :1]
        if layout.suffix.shape[1]
        else torch.full_like(layout.visual[:, :1], layout.next_position)
    )
    running = RunningCache(cache, prompt_len, backbone.position_dims)
    running.archive_offloaded = sealing is None  # sealed: what leaves attention is in the pack
    state = StreamState(
        cache=running,
        token_step=torch.repeat_interleave(torch.arange(len(stream.step_times)), lengths),
        layout_positions=torch.cat([layout.visual, after], dim=1).cpu(),
        total=total,
        position_limit=int(backbone.text_config.max_position_embeddings),
        rope=backbone.rope_tables(),
        family=backbone.family,
        frames_per_step=backbone.frames_per_step,
    )
    state.attend = lambda text, **how: text_attention(backbone, state, text, **how)
    state.embed_text = lambda text: backbone.embed_ids(backbone.text_ids(text))[0].detach()
    peak_kv, skip, cuts = 0, 0, []  # cuts: where each save cut the stream (saved_state.py)
    if checkpoint and checkpoint.restored:
        restored = checkpoint.take_restored()  # tensors popped as used: none outlives its use
        progress, tensors = restored.progress, restored.tensors
        cuts = restore_running_cache(running, tensors)
        policy.restore(named_under(tensors, "policy."))
        restore_reducer(stream, tensors)
        state.seen, state.shift = progress["seen"], progress["shift"]
        state.prefilled = progress.get("prefilled", state.seen)
        peak_kv, skip = progress["peak_kv"], progress["chunks"]
    chunks = stream.chunks(1, skip)
    for number, (first_step, frames, done, inputs) in enumerate(chunks, start=skip + 1):
        steps = stream.step_times[first_step : first_step + len(frames) // backbone.frames_per_step]
        stream_chunk(backbone, state, policy, frames, steps, layout, stream.reducer, inputs)
        peak_kv = max(peak_kv, running.kv_bytes())
        if sealing is not None:  # before after_chunk moves anything out of attention
            sealing.chunk(state, len(steps))
        policy.after_chunk(state)
        stream.report(done, state.seen)
        if checkpoint and checkpoint.due(number) and state.seen < total:
            progress = {"chunks": number, "seen": state.seen, "shift": state.shift}
            progress["prefilled"] = state.prefilled
            saved = {f"policy.{k}": v for k, v in policy.saved().items()} | reducer_saved(stream)
            cuts.append(running.streamed)
            live, sealed = running_cache_tensors(running, cuts)
            checkpoint.save({**progress, "peak_kv": peak_kv}, live | saved, sealed)
    check_count(stream.media, state.seen, total)
    policy.finish(state)
    blocks = [] if sealing is not None else policy.make_blocks(state, stream.step_times)
    state.attend = None  # it closes over the state: without this the cache waits for the cycle GC
    visual_end = [
        running.visual_start(layer) + running.count(layer) for layer in range(state.layers)
    ]
    peak = max(peak_kv, running.kv_bytes())
    return Streamed(
        blocks,
        cache,
        visual_end,
        peak,
        state.shift,
        prefilled=state.prefilled,
        head_masks=running.head_masks(),
        prompt_shift=list(running.prompt_shift),
    )


def stream_chunk(
    backbone: Backbone,
    state: StreamState,
    policy: StreamingMemory,
    frames: np.ndarray,
    steps: list[tuple[float, float]],
    layout: StreamLayout,
    reducer: ChunkReducer | None = None,
    inputs: dict | None = None,
) -> None:
    """One chunk through the running cache, placed where the layout puts it, the policy
    recording what it scores by (H2O, MEDA: what every query row attends to). Eviction is the
    caller's: `policy.after_chunk` (a live stream runs it once the next step is known). A token the
    reducer drops is never prefilled: to the policy it is a token evicted as it arrived."""
    first_step = int(state.token_step[state.seen])
    state.grid = layout.grid
    embeds, extra, keep = visual_tokens(
        backbone, frames, steps, layout, first_step, reducer, inputs
    )
    n = embeds.shape[1]
    index = torch.arange(state.seen, state.seen + n)
    if policy.reads_embeddings:  # before the reducer's drops: a step is compared whole
        where = grid_index(layout, first_step, len(steps))
        flat = where.flatten().to(embeds.device, non_blocking=True)
        state.chunk_grid = embeds[0, flat].view(*where.shape, -1)
        state.chunk_index = where + state.seen
    placed = state.placed(state.seen, state.seen + n)
    if keep is not None:
        at = keep.nonzero()[:, 0]
        embeds, placed, index = (
            embeds[:, at.to(embeds.device, non_blocking=True)],
            placed[:, at],
            index[at],
        )
        extra = backbone.select_extra(extra, at[None]) if extra else extra
    state.prefilled += len(index)
    recorder = policy.recorder(state) if len(index) else None  # all dropped: nothing to run
    if len(index):  # over a cache held per head, each head attends to what it holds
        with recording(recorder) if recorder else nullcontext(), masking(state.cache.head_masks()):
            backbone.forward(embeds, placed, state.cache.cache, **extra)
        state.cache.appended(index, placed)
    state.seen += n
    state.cache.passed(state.seen)
    if recorder:
        policy.observe(state, recorder)
