"""media -> backbone -> blockwise memory policy: blocks prefilled on their own after the init
prompt.

Blocks of one granularity and length are independent given the init KV, so they run as one batch:
the init KV is shared along the batch axis and each row sees only init + its own block. As in the
authors' code, every block is prefilled right after the init prompt (positions init_len + 0..g-1,
compacted), whatever its place in the stream: its keys, its compression and its retrieval key do not
depend on where it sits in the video. The kept keys are then rotated to their stream positions for
the pack, whose keys always carry RoPE at their stored positions. The last layer's attention column
sums come from the recording attention function, a few query rows at a time.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.encode.checkpoint import Checkpointing
from mmkv_cli.encode.results import Streamed
from mmkv_cli.encode.saved_state import block_rows, blocks_from, blocks_tensors
from mmkv_cli.encode.stream import (
    Stream,
    check_count,
    reducer_saved,
    restore_reducer,
    visual_tokens,
)
from mmkv_cli.kernels.attention import Recorder, recording
from mmkv_cli.kernels.host import HostCopies
from mmkv_cli.kernels.rope import compact_positions, rotate_keys
from mmkv_cli.methods.base import BlockPlan, BlockwiseMemory
from mmkv_cli.methods.scoring import retrieval_key
from mmkv_cli.pack import Span

GRANULARITY_ORDER = {"segment": 0, "frame": 1, "patch": 2}


def chunk_plans(
    policy: BlockwiseMemory,
    layout: StreamLayout,
    first_step: int,
    steps: int,
    frames_per_step: int,
    prefilled: torch.Tensor | None = None,
) -> list[BlockPlan]:
    """Plans for steps [first_step, first_step + steps), tokens indexed within the chunk.
    prefilled [chunk tokens] bool: what a token reducer let through; a block then holds only
    those, and keeps no more than it holds (its budget is still a share of the stream's block)."""
    lengths = layout.step_lengths[first_step : first_step + steps]
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0).tolist()
    plans = policy.plan(
        starts,
        lengths,
        layout.offsets()[first_step : first_step + steps],
        layout.grid,
        frames_per_step,
    )
    for plan in plans:
        plan.steps = (plan.steps[0] + first_step, plan.steps[1] + first_step)
        if prefilled is not None:
            plan.tokens = plan.tokens[prefilled[plan.tokens]]
            if plan.keep is not None:
                plan.keep = min(plan.keep, plan.tokens.numel())
    return plans


def block_positions(stream: torch.Tensor, origins: torch.Tensor, first_step: int) -> torch.Tensor:
    """Where a block is prefilled: its stream positions [P, N] moved as if its first step were the
    stream's first, right after the init prompt (each step's first token is its origin on every
    axis, so M-RoPE grids keep their shape and Qwen3-VL's stamped frames their layout). On 1-D RoPE
    the block is then packed to init_len + 0..g-1, as the authors prefill it."""
    moved = stream - (origins[:, first_step] - origins[:, 0]).view(-1, 1)
    return compact_positions(moved, int(origins[0, 0])) if stream.shape[0] == 1 else moved


def prefill_blocks(
    backbone: Backbone,
    policy: BlockwiseMemory,
    prefix: Span,
    embeds: torch.Tensor,
    extra: dict,
    positions: torch.Tensor,
    plans: list[BlockPlan],
    step_times,
    origins: torch.Tensor,
    copies: HostCopies,
) -> tuple[list[Span], int]:
    """Prefill and compress every planned block of one chunk; returns the blocks and the peak batch
    KV bytes. origins [P, steps]: the stream position of every step's first token. The blocks'
    tensors are sent to the host through `copies`: read them after `copies.settle()`."""
    groups: dict[tuple[str, int], list[BlockPlan]] = defaultdict(list)
    for plan in plans:
        if plan.keep != 0:  # a block its budget leaves empty is neither prefilled nor stored
            groups[(plan.granularity, plan.tokens.numel())].append(plan)
    last = backbone.text_config.num_hidden_layers - 1
    init = prefix.layer_counts[0]
    rope = backbone.rope_tables()
    every_layer = policy.retrieval_layers == "each"
    blocks, peak = [], 0
    for (granularity, length), members in groups.items():
        # every row holds its own copy of the init KV
        per_batch = max(1, policy.batch_tokens // (init + length))
        for first in range(0, len(members), per_batch):
            batch = members[first : first + per_batch]
            index = torch.stack([plan.tokens for plan in batch])  # [B, N] within the chunk
            stream = positions[:, index]  # [P, B, N] where the tokens sit in the stream
            placed = torch.stack(
                [
                    block_positions(stream[:, b], origins, plan.steps[0])
                    for b, plan in enumerate(batch)
                ],
                dim=1,
            )
            cache = backbone.cache_from_layers(prefix.keys, prefix.values, batch=len(batch))
            recorder = Recorder(layers={last}, column_sums=True)
            with recording(recorder):
                backbone.forward(
                    embeds[0, index.to(embeds.device, non_blocking=True)],
                    placed,
                    cache,
                    **backbone.select_extra(extra, index),
                )
            peak = max(peak, sum(e.keys.numel() * e.keys.element_size() * 2 for e in cache.layers))
            # chosen, gathered, re-rotated and keyed on the device; what the pack keeps leaves it
            # through `copies` (no wait here: the host reads it once the encode settles them)
            attention = recorder.column_sum[last][:, init:]
            placed_on, stream_on = (
                t.to(attention.device, non_blocking=True) for t in (placed, stream)
            )
            for row, plan in enumerate(batch):
                keep = policy.choose(plan, attention[row], cache.layers[last].keys[row, :, init:])
                kept_placed, kept_stream = placed_on[:, row, keep], stream_on[:, row, keep]
                keys = [e.keys[row, :, init:][:, keep] for e in cache.layers]
                key = retrieval_key(
                    keys if every_layer else keys[-1:],
                    [kept_placed] * len(keys),
                    rope,
                    policy.retrieval_space,
                )
                kept_positions = copies.host(kept_stream)
                blocks.append(
                    Span(
                        name="",
                        # stored at their stream positions (keys re-rotated from the prefill's)
                        keys=[
                            copies.host(rotate_keys(k, kept_stream - kept_placed, *rope))
                            for k in keys
                        ],
                        values=[
                            copies.host(e.values[row, :, init:][:, keep]) for e in cache.layers
                        ],
                        positions=[kept_positions] * len(keys),
                        granularity=granularity,
                        steps=plan.steps,
                        time=(step_times[plan.steps[0]][0], step_times[plan.steps[1] - 1][1]),
                        representative=None if key is None else copies.host(key),
                        extra={"first": int(plan.tokens[0])},
                    )
                )
    return blocks, peak


def order_blocks(blocks: list[Span]) -> list[Span]:
    """Time order, coarse before fine at the same start; names b0, b1, ... in that order."""
    blocks.sort(
        key=lambda b: (b.steps[0], GRANULARITY_ORDER.get(b.granularity, 3), b.extra.get("first", 0))
    )
    for i, block in enumerate(blocks):
        block.name = f"b{i}"
    return blocks


def encode_blockwise(
    stream: Stream,
    policy: BlockwiseMemory,
    prefix: Span,
    cache,
    checkpoint: Checkpointing | None = None,
) -> Streamed:
    """Independent blocks after the init prompt, whole segments per chunk; the suffix follows the
    init prompt. With `checkpoint`, the blocks made so far are saved every N chunks."""
    backbone, layout = stream.backbone, stream.layout
    per_step = backbone.frames_per_step
    total = sum(layout.step_lengths)
    policy.begin(total)
    starts = torch.cumsum(torch.tensor([0, *layout.step_lengths[:-1]]), 0)
    origins = layout.visual[:, starts].cpu()  # every step's first token: where it is placed from
    blocks, seen, peak_kv, skip, prefilled = [], 0, 0, 0, 0
    if checkpoint and checkpoint.restored:
        restored = checkpoint.take_restored()  # tensors popped as used: none outlives its use
        progress, blocks = restored.progress, blocks_from(restored.tensors, restored.rows)
        seen, peak_kv, skip = progress["seen"], progress["peak_kv"], progress["chunks"]
        prefilled = progress.get("prefilled", seen)
        restore_reducer(stream, restored.tensors)
    saved = len(blocks)  # blocks before it are in the checkpoint already
    # every block so far as a checkpoint seals it, grown by the new ones at each save: listing an
    # hour's blocks again at every save costs more than the save (docs/measurements.md)
    sealed = blocks_tensors(blocks) if checkpoint else {}
    unit = policy.segment_steps(per_step)
    copies = HostCopies(backbone.device)  # blocks leave the device while the next chunk runs
    chunks = stream.chunks(unit, skip)
    for number, (first_step, frames, done, inputs) in enumerate(chunks, start=skip + 1):
        times = stream.step_times[first_step : first_step + len(frames) // per_step]
        embeds, extra, keep = visual_tokens(
            backbone, frames, times, layout, first_step, stream.reducer, inputs
        )
        n = embeds.shape[1]
        plans = chunk_plans(policy, layout, first_step, len(times), per_step, keep)
        prefilled += n if keep is None else int(keep.sum())
        positions = layout.visual[:, seen : seen + n].cpu()
        timing = stream.step_times
        made, peak = prefill_blocks(
            backbone, policy, prefix, embeds, extra, positions, plans, timing, origins, copies
        )
        blocks += made
        seen += n
        peak_kv = max(peak_kv, peak)
        stream.report(done, seen)
        if checkpoint and checkpoint.due(number) and seen < total:
            progress = {"chunks": number, "seen": seen, "peak_kv": peak_kv, "prefilled": prefilled}
            copies.settle()  # the blocks are read to be saved
            sealed |= blocks_tensors(blocks[saved:], saved)
            checkpoint.save(progress, reducer_saved(stream), sealed, block_rows(blocks[saved:]))
            saved = len(blocks)
    check_count(stream.media, seen, total)
    copies.settle()  # one wait for every block's KV sent to the host
    return Streamed(
        order_blocks(blocks),
        cache,
        prefix.layer_counts,
        peak_kv,
        representatives=policy.retrieval_space,
        prefilled=prefilled,
    )
