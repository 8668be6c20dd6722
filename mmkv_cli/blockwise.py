"""media -> backbone -> blockwise memory policy: blocks prefilled on their own after the init
prompt.

Blocks of one granularity and length are independent given the init KV, so they run as one batch:
the init KV is shared along the batch axis and each row sees only init + its own block. The last
layer's attention column sums come from the recording attention function, a few query rows at a
time.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mmkv_cli.attention import Recorder, recording
from mmkv_cli.backbones import Backbone, StreamLayout
from mmkv_cli.methods.base import BlockPlan, BlockwiseMemory
from mmkv_cli.methods.scoring import mean_key
from mmkv_cli.pack import Span

GRANULARITY_ORDER = {"segment": 0, "frame": 1, "patch": 2}


def chunk_plans(
    policy: BlockwiseMemory, layout: StreamLayout, first_step: int, steps: int, frames_per_step: int
) -> list[BlockPlan]:
    """Plans for steps [first_step, first_step + steps), tokens indexed within the chunk."""
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
    return plans


def prefill_blocks(
    backbone: Backbone,
    policy: BlockwiseMemory,
    prefix: Span,
    embeds: torch.Tensor,
    extra: dict,
    positions: torch.Tensor,
    plans: list[BlockPlan],
    step_times,
) -> tuple[list[Span], int]:
    """Prefill and compress every planned block of one chunk; returns the blocks and the peak batch
    KV bytes."""
    groups: dict[tuple[str, int], list[BlockPlan]] = defaultdict(list)
    for plan in plans:
        groups[(plan.granularity, plan.tokens.numel())].append(plan)
    last = backbone.text_config.num_hidden_layers - 1
    init = prefix.layer_counts[0]
    blocks, peak = [], 0
    for (granularity, length), members in groups.items():
        # every row holds its own copy of the init KV
        per_batch = max(1, policy.batch_tokens // (init + length))
        for first in range(0, len(members), per_batch):
            batch = members[first : first + per_batch]
            index = torch.stack([plan.tokens for plan in batch])  # [B, N] within the chunk
            cache = backbone.cache_from_layers(prefix.keys, prefix.values, batch=len(batch))
            recorder = Recorder(layers={last}, column_sums=True)
            with recording(recorder):
                backbone.forward(
                    embeds[0, index.to(embeds.device)],
                    positions[:, index],
                    cache,
                    **backbone.select_extra(extra, index),
                )
            peak = max(peak, sum(e.keys.numel() * e.keys.element_size() * 2 for e in cache.layers))
            attention = recorder.column_sum[last][:, init:].cpu()
            for row, plan in enumerate(batch):
                keys = [e.keys[row, :, init:].cpu() for e in cache.layers]
                values = [e.values[row, :, init:].cpu() for e in cache.layers]
                keep = policy.choose(granularity, attention[row], keys[-1])
                kept_keys = [k[:, keep] for k in keys]
                blocks.append(
                    Span(
                        name="",
                        keys=kept_keys,
                        values=[v[:, keep] for v in values],
                        positions=[positions[:, plan.tokens[keep]].cpu()] * len(keys),
                        granularity=granularity,
                        steps=plan.steps,
                        time=(step_times[plan.steps[0]][0], step_times[plan.steps[1] - 1][1]),
                        representative=mean_key(kept_keys[-1]),
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
