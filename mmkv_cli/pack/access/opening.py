"""A pack's open-time checks: the stored header parsed and checked against its schema, the index
digest over the directory and the small tensors, the spans' counts, the KV shape, and the block
table with every tensor's dtype and shape checked against it. Nothing here reads a block."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack.integrity.checks import check_header, check_spans, index_digest, parse_header
from mmkv_cli.pack.integrity.shapes import check_tensors, kv_shape_of
from mmkv_cli.pack.integrity.tensors import StoredTensors
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import (
    BLOCKS,
    EMBEDS,
    OLD_TABLE_COLUMNS,
    PARTS,
    TABLE_COLUMNS,
    digest_name,
)
from mmkv_cli.pack.schema.header import KVShape, stored_kv
from mmkv_cli.pack.schema.table import BlockTable


@dataclass
class Opened:
    """What opening a pack found, every field checked."""

    stored: dict  # the header's JSON, as stored
    format_version: int
    digest: str  # the hash of its checksums, and their fields' name
    token_major: bool  # v2/v3 stored K/V head-major, positions [P, tokens]
    columns: int  # the block table's columns before the layer counts
    quant: QuantSpec | None
    spans_meta: dict  # the prefix's and suffix's header entries
    kv: KVShape
    blocks: BlockTable


def open_pack(tensors: StoredTensors, where: str) -> Opened:
    """The pack behind `tensors` (a file opened, its directory read) checked as it opens."""
    stored = parse_header(tensors.metadata, where)
    version = stored["format_version"]
    digest = digest_name(version)
    entries = tensors.entries
    if version >= 4:  # remote: every small tensor in one request (not the blocks nor reps)
        large = {f"{BLOCKS}.{part}" for part in PARTS} | {"reps", EMBEDS}
        tensors.source.ensure([tensors.tensor_range(n) for n in entries if n not in large])
    check_header(stored, version, where)
    kv = stored_kv(stored.get("kv"))  # what the spans hold: per head, a layer a head
    quant = QuantSpec.from_header(stored.get("quant"), kv, where)
    # v2-v4 called the prefix and suffix "segments"
    spans_meta = stored.get("spans" if version >= 5 else "segments") or {}
    if not isinstance(spans_meta, dict) or not {"prefix", "suffix"} <= set(spans_meta):
        raise PackError(f"{where} is corrupted (no prefix or suffix)")
    prefix = spans_meta["prefix"]
    counts = prefix.get("layer_counts") if isinstance(prefix, dict) else None
    layers = len(counts) if isinstance(counts, list) else 0
    if version >= 3:  # v2's spans are checked as they are read
        check_spans(spans_meta, kv["layers"] if version >= 7 else layers, version, where)
    if version >= 7:
        _check_index(tensors, stored, digest, where)
    token_major = version >= 4
    shape = kv_shape_of(stored, entries, layers, token_major, where)
    columns = TABLE_COLUMNS if version >= 7 else OLD_TABLE_COLUMNS
    try:
        blocks = (
            BlockTable.from_dicts(stored["blocks"])
            if version == 2
            else _block_table(tensors, stored, digest, columns, len(counts or []))
        )
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise PackError(f"{where} is corrupted (block table: {err})") from None
    if version >= 3:  # every tensor's dtype and shape against the header and the table
        check_tensors(stored, entries, spans_meta, blocks, quant, shape.stored, version, where)
    return Opened(stored, version, digest, token_major, columns, quant, spans_meta, shape, blocks)


def _check_index(tensors: StoredTensors, stored: dict, digest: str, where: str) -> None:
    """The header's digest of the directory and the small tensors no other checksum covers."""

    def read(name: str) -> np.ndarray:
        tensors.small[name] = tensors.raw(name)  # kept: the table is read from these bytes
        return tensors.small[name]

    if index_digest(tensors.entries, read, digest) != stored["integrity"]["index"]:
        raise PackError(f"{where} is corrupted (index digest mismatch)")


def _block_table(
    tensors: StoredTensors, stored: dict, digest: str, columns: int, layers: int
) -> BlockTable:
    """The block table (v3 on): three small tensors, read whole (a few dozen bytes per block)."""
    meta = stored["blocks"]
    if not meta["count"]:
        return BlockTable(
            meta["granularities"],
            np.zeros((0, columns + layers), dtype=np.int64),
            np.zeros((0, 2), dtype=np.float64),
            np.zeros((0, 1, 32), dtype=np.uint8),
            columns=columns,
        )
    return BlockTable(
        meta["granularities"],
        tensors.array(f"{BLOCKS}.table").astype(np.int64),  # v8 may store it int32
        tensors.array(f"{BLOCKS}.time"),
        tensors.array(f"{BLOCKS}.{digest}"),
        columns=columns,
    )
