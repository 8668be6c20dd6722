"""What a span becomes on disk (v7): positions int32 and stored once when every layer keeps the
same tokens."""

from __future__ import annotations

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.schema.format import BlockShape, Span

INT32_MAX = 2**31 - 1


def shares_positions(span: Span) -> bool:
    """Whether every layer keeps the same tokens at the same positions (most methods: all but the
    per-layer ones, PyramidKV, HERMES' layer depths, retrieval by layer)."""
    first = span.positions[0]
    return all(p.shape == first.shape and torch.equal(p, first) for p in span.positions[1:])


def block_shape(block: Span) -> BlockShape:
    """What the table holds of `block`, read off its tensors."""
    return BlockShape(
        block.granularity,
        block.steps,
        block.time,
        block.layer_counts,
        shares_positions(block),
        block.representative,
        block.embeddings,
    )


def stored_positions(span: Span) -> tuple[torch.Tensor, bool]:
    """[rows, P] int32 positions: one layer's when every layer agrees, else each layer's in turn."""
    shared = shares_positions(span)
    rows = span.positions[0].T if shared else span.part(2)
    if rows.numel() and not -INT32_MAX - 1 <= int(rows.min()) <= int(rows.max()) <= INT32_MAX:
        raise PackError("a position does not fit 32 bits; this stream is too long to store")
    return rows.to(torch.int32).contiguous(), shared


def store(span: Span) -> tuple[dict[str, torch.Tensor], bool]:
    """The prefix's or suffix's stored tensors by part ("k", "v", "pos") and whether its positions
    are stored once: K/V stay as computed even in a quantized pack (a few dozen prompt tokens,
    where the attention sink lives). Blocks are stored by the writer, one pass per tensor."""
    positions, shared = stored_positions(span)
    return {"k": span.part(0), "v": span.part(1), "pos": positions}, shared
