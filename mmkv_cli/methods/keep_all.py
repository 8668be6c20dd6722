"""The streaming memory that keeps every token (`full`'s), and the base of the evicting policies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkv_cli.core.lazy import torch
from mmkv_cli.methods.base import Budget, EncodeContext
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import retrieval_key
from mmkv_cli.pack import Span, block_name

if TYPE_CHECKING:
    from mmkv_cli.kernels.recorder import Recorder


def slide_window(state: StreamState, window: int | None) -> None:
    """Keep encode's attention on the newest `window` visual tokens of every layer: older entries
    move to host memory and still go into the pack (ReKV's and StreamingTOM's sliding window)."""
    for layer in range(state.layers if window else 0):
        if state.cache.count(layer) > window:
            state.cache.offload(layer, state.cache.count(layer) - window)


class KeepAll:
    """The streaming memory that keeps every token: one block per temporal step. Policies that evict
    subclass it and override the hooks they need."""

    granularity = "frame"
    # every token it holds stays as prefilled, one block per temporal step: its blocks can be made,
    # and written, as each chunk goes in (a policy that evicts or rewrites entries: False)
    seals_as_prefilled = False
    reads_embeddings = False  # chooses by attention or place, not by the tokens' embeddings
    keeps_embeddings = False  # its blocks carry no tokens as taken in (Span.embeddings)

    def __init__(self, params, budget: Budget, context: EncodeContext):
        self.params = params
        self.budget = budget
        self.context = context

    def recorder(self, state: StreamState) -> Recorder | None:
        return None

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        pass

    def after_chunk(self, state: StreamState) -> None:
        pass

    def saved(self) -> dict[str, torch.Tensor]:
        return {}  # keeping everything needs no memory of its own

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        pass

    def finish(self, state: StreamState) -> None:
        pass

    def representative(
        self, keys: list[torch.Tensor], positions: list[torch.Tensor], rope: tuple
    ) -> torch.Tensor | None:
        """A block's retrieval key from its per-layer keys and positions: by default the last
        layer's, before RoPE ([1, H_kv * D])."""
        return retrieval_key(keys[-1:], positions[-1:], rope)

    def make_blocks(self, state: StreamState, step_times: list[tuple[float, float]]) -> list[Span]:
        """Group what each layer kept by temporal step: one block per step still held by some
        layer."""
        steps = len(step_times)
        # held per head, the blocks' layers are (layer, KV head) pairs; retrieval keys are per layer
        whole_layers = not state.cache.per_head
        per_layer = []
        for keys, values, positions, index in state.cache.take_all_held():
            step = state.token_step[index]
            if not bool((step[1:] >= step[:-1]).all()):  # in stream order already: no copy
                order = torch.argsort(step, stable=True)
                keys, values, positions = keys[:, order], values[:, order], positions[:, order]
            counts = torch.bincount(step, minlength=steps).tolist()
            per_layer.append(
                (
                    torch.split(keys, counts, dim=1),
                    torch.split(values, counts, dim=1),
                    torch.split(positions, counts, dim=1),
                    counts,
                )
            )
        blocks = []
        for step, time in enumerate(step_times):
            if not any(counts[step] for *_, counts in per_layer):
                continue  # evicted from every layer
            parts = ([part[step] for part in layer[:3]] for layer in per_layer)
            keys, values, positions = (list(each) for each in zip(*parts))
            rope = state.rope if whole_layers else None
            blocks.append(self.step_block(len(blocks), step, time, keys, values, positions, rope))
        return blocks

    def step_block(self, number, step, time, keys, values, positions, rope) -> Span:
        """Temporal step `step`'s block, the pack's `number`th, from what each layer holds of it;
        its retrieval key made with `rope` (None: none, as for a pack held per head)."""
        return Span(
            name=block_name(number),
            keys=keys,
            values=values,
            positions=positions,
            granularity=self.granularity,
            steps=(step, step + 1),
            time=time,
            representative=None if rope is None else self.representative(keys, positions, rope),
        )


class KeepPrefilled(KeepAll):
    """Every token as prefilled, nothing evicted or rewritten: each step's block is whole as soon
    as its chunk is in (full; SimpleStream's window)."""

    seals_as_prefilled = True
