"""What a span becomes on disk (v7): K/V as computed or quantized, positions int32 and stored once
when every layer keeps the same tokens."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.errors import PackError
from mmkv_cli.lazy import torch
from mmkv_cli.pack.format import Span
from mmkv_cli.pack.quant import QuantSpec, quantize_keys, quantize_values

INT32_MAX = 2**31 - 1


@dataclass
class StoredSpan:
    """A span's stored tensors by part ("k", "v", "pos", and "kq", "vq" when quantized), token
    rows first."""

    parts: dict[str, torch.Tensor]
    shared_positions: bool  # one set of position rows serves every layer
    key_groups: int  # rows of "kq" (0 unless quantized)


def shares_positions(span: Span) -> bool:
    """Whether every layer keeps the same tokens at the same positions (most methods: all but the
    per-layer ones, PyramidKV, HERMES' layer depths, retrieval by layer)."""
    first = span.positions[0]
    return all(p.shape == first.shape and torch.equal(p, first) for p in span.positions[1:])


def stored_positions(span: Span) -> tuple[torch.Tensor, bool]:
    """[rows, P] int32 positions: one layer's when every layer agrees, else each layer's in turn."""
    shared = shares_positions(span)
    rows = span.positions[0].T if shared else span.part(2)
    if rows.numel() and int(rows.abs().max()) > INT32_MAX:
        raise PackError("a position does not fit 32 bits; this stream is too long to store")
    return rows.to(torch.int32).contiguous(), shared


def store(span: Span, quant: QuantSpec, full_precision: bool = False) -> StoredSpan:
    """The tensors `span` is written as. full_precision: K/V as computed even in a quantized pack
    (the prefix and suffix: a few dozen tokens, where the attention sink lives)."""
    positions, shared = stored_positions(span)
    keys, values = span.part(0), span.part(1)
    if not quant.quantized or full_precision:
        return StoredSpan({"k": keys, "v": values, "pos": positions}, shared, 0)
    heads, dim = keys.shape[1], keys.shape[2]
    key_codes, key_scales = quantize_keys(keys, span.layer_counts, quant.bits, quant.group)
    value_codes, value_scales = quantize_values(values, quant.bits, quant.value_group(heads, dim))
    return StoredSpan(
        {"k": key_codes, "v": value_codes, "pos": positions, "kq": key_scales, "vq": value_scales},
        shared,
        int(key_scales.shape[0]),
    )
