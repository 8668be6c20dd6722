"""The blocks of a memory that keeps every token as prefilled (`full`, `rekv`, `streamingtom`),
made as each chunk goes in and handed to the pack's writer, which writes them while the next chunks
run (pack/access/early.py).

Every block's size is then known before the first frame: one block per temporal step, of that
step's tokens in every layer (of those a reducer lets through, where it keeps a fixed count a step,
as StreamingTOM's CTR does). So the pack's layout is planned up front. After each chunk its tokens,
the newest of every layer, are sent to pinned host memory on a side stream; the writer's thread
waits for them there (the encode never does), makes the blocks as `make_blocks` would at the end,
and writes them. What leaves attention (ReKV's window) is then in the pack already and is not
archived a second time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.core.lazy import torch
from mmkv_cli.encode.reducing import ChunkReducer
from mmkv_cli.encode.results import Encoded, layout_record
from mmkv_cli.kernels.host import HostCopies
from mmkv_cli.methods.base import StreamingMemory
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.pack import BlockShape, EarlyPack, Span, worth_writing_early

# Written early on a GPU only. On a CPU the encode keeps every core busy, so a write beside it has
# none to use (bench/results/early_write-cpu.json), and `full`'s blocks would be held twice: in the
# cache and as the writer's copies, where at the end they are views of the cache.
ON_CPU = False


class EarlyTarget(Protocol):
    """Where an encode's pack goes, when it may be written while the encode runs (record.py)."""

    def open(self, provisional: Encoded, shapes: list[BlockShape], first: Span) -> EarlyPack:
        """The pack opened, planned from a provisional encode: its sizes are the final ones."""


def open_sealing(early: EarlyTarget, backbone: Backbone, layout: StreamLayout, step_times,
                 policy: StreamingMemory, prefix: Span, frame_hw,
                 reducer: ChunkReducer | None) -> Sealing | None:  # fmt: skip
    """The pack opened for writing as the encode runs, planned from the layout (every token kept,
    a block per step, of the tokens a reducer lets through where it keeps a fixed count), and what
    hands it each chunk's blocks; None where that would not pay (a small pack, the CPU), or its
    blocks' sizes are known only as the stream is reduced."""
    if backbone.device.type == "cpu" and not ON_CPU:
        return None
    lengths = list(layout.step_lengths)
    if reducer is not None:
        kept = reducer.choice.reducer.kept
        if kept is None:
            return None
        grid = layout.grid[0] * layout.grid[1]  # a step's grid tokens; its markers always go on
        lengths = [n - grid + kept(reducer.choice.params, grid) for n in lengths]
    shapes, first = planned_blocks(policy, prefix, lengths, step_times, backbone.rope_tables())
    if not worth_writing_early(shapes, first):
        return None
    layers = len(prefix.keys)
    heads, _, dim = prefix.keys[0].shape
    zeros = [torch.zeros(heads, layout.suffix.shape[1], dim, dtype=prefix.keys[0].dtype)] * layers
    suffix = Span("suffix", zeros, zeros, [layout.suffix.cpu()] * layers)
    total = sum(layout.step_lengths)
    provisional = Encoded(
        prefix, [], suffix, layout_record(backbone, layout, 0, frame_hw), total,
        stats={"encode_s": 0.0, "peak_kv_bytes": 0, "visual_tokens_prefilled": sum(lengths)},
    )  # fmt: skip
    pack = early.open(provisional, shapes, first)
    return Sealing(pack, policy, step_times, backbone.device)


def planned_blocks(
    policy: StreamingMemory,
    prefix: Span,
    lengths: list[int],
    step_times: list[tuple[float, float]],
    rope: tuple,
) -> tuple[list[BlockShape], Span]:
    """Every block's shape, and a first block of their dtype and widths (zeros; its retrieval key
    made as the real ones are, for its size)."""
    layers = len(prefix.keys)
    heads, _, dim = prefix.keys[0].shape
    dims = prefix.positions[0].shape[0]
    zeros = [torch.zeros(heads, lengths[0], dim, dtype=prefix.keys[0].dtype)] * layers
    at = [torch.zeros(dims, lengths[0], dtype=torch.long)] * layers
    first = policy.step_block(0, 0, step_times[0], zeros, zeros, at, rope)
    shapes = [
        BlockShape(
            first.granularity, (step, step + 1), time, [n] * layers, True, first.representative
        )
        for step, (n, time) in enumerate(zip(lengths, step_times))
    ]
    return shapes, first


class Sealing:
    """Hands each chunk's blocks to `pack` as the chunk goes in (`chunk`, before the policy's
    after_chunk moves anything out of attention)."""

    def __init__(
        self,
        pack: EarlyPack,
        policy: StreamingMemory,
        step_times: list[tuple[float, float]],
        device,
    ) -> None:
        self.pack, self.policy, self.step_times = pack, policy, step_times
        self.copies = HostCopies(device)
        self.steps = 0  # temporal steps sealed so far
        self.blocks = 0  # blocks made of them (a step of no token has none)
        self.prefilled = 0  # tokens sealed so far

    def chunk(self, state: StreamState, steps: int) -> None:
        """The chunk just prefilled, `steps` whole temporal steps: the newest entries of every
        layer, sent to the host without a wait."""
        first, running = self.steps, state.cache
        n, self.prefilled = state.prefilled - self.prefilled, state.prefilled
        # each step's tokens, as prefilled: a plan that said otherwise is caught by the writer
        held = state.token_step[running.index[0][running.count(0) - n :]] - first
        counts = torch.bincount(held, minlength=steps).tolist()
        sent, chunk_keys = [], []
        for layer in range(state.layers):
            if running.count(layer) < n:
                raise RuntimeError("internal: a chunk's tokens left attention before their blocks")
            keys, values = running.visual(layer)
            start = running.count(layer) - n  # the newest n: the chunk's
            chunk_keys.append(keys[:, start:])
            sent.append(
                (
                    self.copies.host(keys[:, start:], own=True),
                    self.copies.host(values[:, start:], own=True),
                    running.positions[layer][:, start:].clone(),
                )
            )
        made = [step for step, count in enumerate(counts) if count]  # as make_blocks skips
        keyed = self._retrieval_keys(chunk_keys, [p for *_, p in sent], counts, made, state.rope)
        ready = self.copies.mark()
        self.steps += steps
        numbers = range(self.blocks, self.blocks + len(made))
        self.blocks += len(made)
        policy, times = self.policy, self.step_times

        def make() -> list[Span]:  # on the writer's thread
            if ready is not None:
                ready.synchronize()
            split = [[torch.split(part, counts, dim=1) for part in layer] for layer in sent]
            blocks = [
                policy.step_block(
                    number,
                    first + j,
                    times[first + j],
                    *([layer[i][j] for layer in split] for i in range(3)),
                    None,  # its retrieval key is made already
                )
                for number, j in zip(numbers, made)
            ]
            return [replace(b, representative=key) for b, key in zip(blocks, keyed)]

        self.pack.add(make)

    def _retrieval_keys(self, keys, positions, counts, made, rope) -> list:
        """Each made step's retrieval key (None without `rope`), made where the keys are and sent
        to the host with them: on the writer's thread, rotating every layer's keys back on the
        host, it fell behind the encode on an H100 (docs/benchmarks.md)."""
        if rope is None:
            return [None] * len(made)
        split = [torch.split(k, counts, dim=1) for k in keys]
        at = [torch.split(p, counts, dim=1) for p in positions]
        out = []
        for j in made:
            key = self.policy.representative([k[j] for k in split], [p[j] for p in at], rope)
            out.append(None if key is None else self.copies.host(key, own=True))
        return out
