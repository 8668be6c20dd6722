"""A pack held in memory: what `ask` would read from the written pack, without writing it.

A live question is answered from the stream's memory at its moment; writing that memory as a pack
and reading it back cost 0.3-2.5 s a question at minutes of stream. `MemoryPack` gives `ask` what
a `PackReader` of the written pack would: the header through the JSON the writer stores, the block
table the writer makes (times rounded as stored), the spans' own tensors (a pack stored as computed
gives back exactly these), the representatives in the KV's dtype. A quantized memory has no such
shortcut (its values are what decoding makes): it is still written and read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.access.writer import checked_shapes, stacked_embeddings, table_layout
from mmkv_cli.pack.integrity.verdicts import LaterVerdicts
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import FORMAT_VERSION, Span
from mmkv_cli.pack.schema.header import PackHeader, read_header
from mmkv_cli.pack.schema.table import BlockTable


class MemoryPack:
    """The pack `write_pack(header, prefix, blocks, suffix, reps_space=...)` would write, stored
    as computed, as `ask` reads it (the PackReader members `ask` uses). label: its name in errors.
    Nothing is copied: callers must not change the spans while it is in use."""

    def __init__(
        self,
        header: PackHeader,
        prefix: Span,
        blocks: Sequence[Span],
        suffix: Span,
        reps_space: str = "pre_rope",
        label: str = "the live memory",
    ):
        self.path = label
        self.format_version = FORMAT_VERSION
        stored = json.loads(json.dumps(header.sections(), sort_keys=True))
        self.header = read_header(stored, FORMAT_VERSION, header.kv, label)
        layout = table_layout(checked_shapes(blocks), QuantSpec())
        kinds, table, times, _, reps, _, embeds = layout
        count = len(blocks)
        self.blocks = BlockTable(
            kinds,
            np.asarray(table, dtype=np.int64).reshape(count, -1),
            np.asarray(times, dtype=np.float64).reshape(count, 2),
            np.zeros((count, 32), dtype=np.uint8),  # nothing stored: nothing to check
        )
        self._spans = {"prefix": prefix, "suffix": suffix}
        self._blocks = list(blocks)
        self._reps = None
        if reps and all(r is not None for r in reps):  # stored in the KV's own dtype
            dtype = prefix.keys[0].dtype if prefix.keys else torch.float32
            self._reps = torch.stack([r.reshape(-1, r.shape[-1]) for r in reps]).to(dtype)
        self.rotated_representatives = reps_space != "pre_rope"
        self._embeds = stacked_embeddings(embeds)
        self.bytes_read = 0  # nothing is read from a file
        self.fetched = None  # nor from object storage

    def representatives(self) -> torch.Tensor | None:
        """[blocks, layers, dim] retrieval keys, or None; callers must not write into them."""
        return self._reps

    def embeddings(self) -> torch.Tensor | None:
        """[tokens, dim] the blocks' tokens as taken in, float16 unit rows, or None (v13)."""
        return self._embeds

    def span(self, name: str, keep: bool = True, dtype: torch.dtype | None = None) -> Span:
        """A span as the reader loads it: a block's granularity, steps and time from the table."""
        if name in self._spans:
            return self._spans[name]
        index = self._index(name)
        row = self.blocks[index]
        steps, time = row["steps"], row["time"]
        return replace(
            self._blocks[index],
            granularity=row["granularity"],
            steps=tuple(steps) if steps else None,
            time=tuple(time) if time else None,
        )

    def gather(
        self,
        names: list[str],
        per_layer: list[list[str]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        later: LaterVerdicts | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Blocks `names` joined per layer in that order, as PackReader.gather gives them (for a
        pack stored as computed: the KV on the host, device and dtype unused; later unused too:
        the encoder's own KV, nothing decoded, leaves no verdict)."""
        return joined_spans(
            {name: self._blocks[self._index(name)] for name in names}, names, per_layer
        )

    def _index(self, name: str) -> int:
        index = self.blocks.index_of(name)
        if index is None:  # as the reader says it
            raise PackError(f"{self.path} has no block {name}")
        return index


def joined_spans(
    spans: dict[str, Span],
    names: list[str],
    per_layer: list[list[str]] | None,
    pinned: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Spans `names` joined per layer in that order, as PackReader.gather gives them (per_layer:
    for every layer the names it takes instead): (keys, values, int64 positions) where the spans
    are; pinned: K/V joined into pinned host memory, for a copy to the device without a wait."""
    if not names:
        return [], [], []
    first = spans[names[0]]
    layers = len(first.keys)
    chosen = per_layer if per_layer is not None else [names] * layers
    out: tuple[list, list, list] = ([], [], [])
    for layer, taken in enumerate(chosen):
        for part, joined in enumerate(out):
            pieces = [_parts(spans[name])[part][layer] for name in taken]
            empty = _parts(first)[part][layer][:, :0]
            if not pieces:
                joined.append(empty.clone())
            elif pinned and part < 2:
                joined.append(torch.cat(pieces, dim=1, out=_pinned_like(pieces)))
            else:
                joined.append(torch.cat(pieces, dim=1))
    out[2][:] = [p.to(torch.int64) for p in out[2]]  # as read: int64 positions
    return out


def _pinned_like(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Pinned host memory for `pieces` joined on dim 1."""
    shape = list(pieces[0].shape)
    shape[1] = sum(int(p.shape[1]) for p in pieces)
    return torch.empty(shape, dtype=pieces[0].dtype, pin_memory=True)


def _parts(span: Span) -> tuple[list, list, list]:
    return span.keys, span.values, span.positions
