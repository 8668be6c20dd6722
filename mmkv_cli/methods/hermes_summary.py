"""HERMES's summary tokens: what a deep layer evicts, folded into one token at the slot one past
the layer's furthest kept position (or right after the prompt). The authors' code appends it to
the running cache as an ordinary token that later compressions score, may evict and fold again
(`summary_as: token`); `running_mean` keeps one apart, moved to its slot at every compression and
put first after the prompt. The pack holds a running-mean summary as a block of its own."""

from __future__ import annotations

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.rope import rotate_keys
from mmkv_cli.methods.base import Budget
from mmkv_cli.methods.hermes_scoring import fold_into_summary
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.pack import Span, block_name


class SummaryTokens:
    """The summary state of HERMES's memory and what it does with it (a mixin: the memory's
    params, the running cache's state)."""

    def __init__(self, params, budget: Budget, context):
        super().__init__(params, budget, context)
        self.summary: dict[int, tuple] = {}  # deep layer -> (key, value, count)
        self.summary_position: dict[int, torch.Tensor] = {}  # deep layer -> [P] its summary's slot
        # summary_as token: deep layer -> which of its visual entries are summaries (entries the
        # forward appended since the last compression are not)
        self.summary_mask: dict[int, torch.Tensor] = {}

    def saved(self) -> dict[str, torch.Tensor]:
        out = {f"summary_mask.{layer}": mask for layer, mask in self.summary_mask.items()}
        for layer, position in self.summary_position.items():
            out[f"position.{layer}"] = position
            if self.summary.get(layer) is not None:  # a slot with nothing folded in yet
                key, value, count = self.summary[layer]
                out |= {f"key.{layer}": key.cpu(), f"value.{layer}": value.cpu()}
                out[f"count.{layer}"] = torch.tensor(count)
        return out

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.summary_mask = {
            int(name.split(".")[1]): mask.to(torch.bool)
            for name, mask in saved.items()
            if name.startswith("summary_mask.")
        }
        layers = [int(name.split(".")[1]) for name in saved if name.startswith("position.")]
        self.summary_position = {n: saved[f"position.{n}"] for n in layers}
        self.summary = {
            n: (saved[f"key.{n}"], saved[f"value.{n}"], int(saved[f"count.{n}"]))
            if f"key.{n}" in saved
            else None
            for n in layers
        }

    def _summary_slot(self, state: StreamState, layer: int) -> torch.Tensor:
        """[P] where a deep layer's summary sits: one past the layer's furthest kept position on
        every axis (as text follows a video), or the stream's first visual position."""
        kept = state.cache.positions[layer]
        first = (
            state.layout_positions[:, 0] + state.cache.prompt_shift[layer]
        )  # as its prompt moved
        if self.params.summary_at == "after_prompt" or not kept.numel():
            return first.clone()
        return torch.full_like(first, int(kept.max()) + 1)

    def _summaries(self, state: StreamState, layer: int) -> torch.Tensor:
        """[n] which of the layer's visual entries are summary tokens."""
        mask = self.summary_mask.get(layer, torch.zeros(0, dtype=torch.bool))
        appended = state.cache.count(layer) - len(mask)  # streamed in since: not summaries
        return torch.cat([mask, torch.zeros(appended, dtype=torch.bool)])

    def _smoothing_ids(self, state: StreamState) -> tuple[list[torch.Tensor], int]:
        """(per layer the ids smoothing pairs entries by, how many ids there are): stream indices,
        but a summary token pairs with nothing (an id of its own past the stream's)."""
        ids, extra = [], state.total
        for layer in range(state.layers):
            index, summaries = state.cache.index[layer], self._summaries(state, layer)
            own = index.clone()
            count = int(summaries.sum())  # host bookkeeping: no wait
            own[summaries] = extra + torch.arange(count)
            ids.append(own)
            extra += count
        return ids, extra

    def _add_summary(self, state: StreamState, layer: int, gone: tuple) -> None:
        """Fold what the layer just evicted (old summary tokens among it, each with weight 1) into
        one new summary token at its slot. It goes by the newest streamed token's index, so it
        enters the pack in the step it was made at: a question at an earlier moment never sees it,
        one at a later moment does, as the memory then held it."""
        inv_freq, axes = state.rope
        target = self._summary_slot(state, layer)
        key, value, _ = fold_into_summary(*gone, target, inv_freq, axes)
        state.cache.add(layer, key, value, state.seen - 1, target)
        self.summary_mask[layer] = torch.cat(
            [self._summaries(state, layer)[:-1], torch.ones(1, dtype=torch.bool)]
        )

    def _fold(self, state: StreamState, layer: int, gone: tuple | None) -> None:
        """Move the layer's summary to its slot and fold what it just evicted into it."""
        inv_freq, axes = state.rope
        target = self._summary_slot(state, layer)
        previous = self.summary.get(layer)
        if previous is not None:
            key, value, count = previous
            delta = (target - self.summary_position[layer]).view(-1, 1)
            previous = (rotate_keys(key, delta, inv_freq, axes), value, count)
        if gone is not None:
            keys, values, positions = gone
            previous = fold_into_summary(keys, values, positions, target, inv_freq, axes, previous)
        self.summary[layer] = previous
        self.summary_position[layer] = target
        # The summary lives in the running cache (first after the prompt: cache order does not
        # matter, its position does), so what streams in later attends to it, as the paper writes
        # it back into the KV cache.
        key, value, _ = previous
        state.cache.insert_front(layer, key, value)

    def make_blocks(self, state: StreamState, step_times: list[tuple[float, float]]) -> list[Span]:
        blocks = super().make_blocks(state, step_times)
        if not self.summary:
            return blocks
        shape = state.cache.visual(0)[0]
        empty = torch.zeros(shape.shape[0], 0, shape.shape[2], dtype=shape.dtype)
        dims = state.layout_positions.shape[0]
        keys, values, positions = [], [], []
        for layer in range(state.layers):
            if layer in self.summary:
                k, v, _ = self.summary[layer]
                keys.append(k.to("cpu", shape.dtype))  # for the pack, once
                values.append(v.to("cpu", shape.dtype))
                positions.append(self.summary_position[layer].view(dims, 1).clone())
            else:
                keys.append(empty)
                values.append(empty.clone())
                positions.append(torch.zeros(dims, 0, dtype=torch.long))
        # After the kept tokens, the summary is the stream's last block (a question asked before the
        # end does not see it); after the prompt, its first.
        last = self.params.summary_at == "after_kept"
        step = len(step_times) if last else 0
        moment = step_times[-1][1] if last else step_times[0][0]
        summary = Span(
            name="summary",
            keys=keys,
            values=values,
            positions=positions,
            granularity="summary",
            steps=(step, step),
            time=(moment, moment),
            representative=None,
        )
        renamed = [*blocks, summary] if last else [summary, *blocks]
        for i, block in enumerate(renamed):
            block.name = block_name(i)
        return renamed
