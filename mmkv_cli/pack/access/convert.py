"""convert: re-store an existing pack's KV at other bits, or cut out a time range, without the
model. The header, table and representatives carry over; blocks stream one at a time."""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from mmkv_cli.core.errors import PackError, UsageError, flag
from mmkv_cli.core.lazy import torch
from mmkv_cli.core.options import kv_bits_value
from mmkv_cli.pack import PackHeader, PackReader, Span, check_writable
from mmkv_cli.pack.io.storage import is_url, local_path, staged_upload
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import OLD_TABLE_COLUMNS, SERIES, BlockShape, block_name


class _Blocks(Sequence):
    """The kept blocks of a pack, each loaded (and checked) when indexed, held by nobody: the writer
    reads each once, and never holds more than one."""

    def __init__(self, reader: PackReader, rows: np.ndarray, dtype):
        self.reader, self.rows, self.dtype = reader, rows, dtype
        self.reps = reader.representatives()
        self.embeds = reader.embeddings()
        self.embed_starts = reader.blocks.first_layer_starts()  # a row a first-layer token

    def embeddings(self, row: int):
        if self.embeds is None:
            return None
        return self.embeds[int(self.embed_starts[row]) : int(self.embed_starts[row + 1])]

    def shapes(self) -> list[BlockShape] | None:
        """The kept blocks' table entries from the source's table, where it says whether positions
        are shared (v7 on; before, the writer reads that off each block)."""
        table = self.reader.blocks
        if table.columns == OLD_TABLE_COLUMNS:
            return None
        shared = table.storage(self.rows)[1]
        shapes = []
        for row, shares in zip(self.rows.tolist(), shared.tolist()):
            entry = table[row]
            shapes.append(
                BlockShape(
                    entry["granularity"],
                    tuple(entry["steps"]) if entry["steps"] else None,
                    tuple(entry["time"]) if entry["time"] else None,
                    entry["layer_counts"],
                    bool(shares),
                    self.reps[row].to(self.dtype) if self.reps is not None else None,
                    self.embeddings(row),
                )
            )
        return shapes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Span:
        row = int(self.rows[i])
        loaded = self.reader.span(self.reader.blocks.name(row), keep=False, dtype=self.dtype)
        rep = self.reps[row].to(self.dtype) if self.reps is not None else None
        return replace(loaded, name=block_name(i), representative=rep,
                       embeddings=self.embeddings(row))  # fmt: skip


def convert_quant(kv_bits: float | None, kv_group: int | None) -> QuantSpec | None:
    """How a convert re-stores the KV: None keeps it as stored; a group needs bits too (the
    caller's words for both: --kv-bits on the command line, kv_bits in Python)."""
    if kv_bits is None:
        if kv_group is not None:
            bits = flag("kv_bits")
            raise UsageError(f"{flag('kv_group')} sets how {bits} quantizes: pass {bits} too")
        return None
    bits = kv_bits_value(kv_bits)
    return QuantSpec(bits) if kv_group is None else QuantSpec(bits, kv_group)


def kept_rows(reader: PackReader, start: float | None, stop: float | None) -> np.ndarray:
    """The blocks that show any of [start, stop] (every block when neither is given). A block
    with no time (HERMES' summary of everything it evicted) is dropped from a cut: it holds the
    whole stream's past, not the range's."""
    for name, value in (("--from", start), ("--to", stop)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise UsageError(f"{name} must be a finite number of seconds, 0 or more")
    if start is not None and stop is not None and stop < start:
        raise UsageError("--to must not come before --from")
    times = reader.blocks.times()
    if start is None and stop is None:
        return np.arange(len(reader.blocks))
    first, last = times[:, 0], times[:, 1]
    low = -math.inf if start is None else start
    high = math.inf if stop is None else stop
    keep = ~np.isnan(first) & (first <= high) & (last >= low)
    rows = np.flatnonzero(keep)
    if not len(rows):
        raise UsageError(f"no block of {reader.path} lies between {low:g} s and {high:g} s")
    return rows


def convert(
    source: str | Path,
    output: str | Path,
    quant: QuantSpec | None = None,
    start: float | None = None,
    stop: float | None = None,
    force: bool = False,
    params: Callable[[PackReader], dict] | None = None,
) -> dict:
    """Write `source`'s KV to `output` stored as `quant` says (None: as the source stores it), and
    only the blocks in [start, stop]. Refuses to raise the precision (the bits lost stay lost; the
    pack only grows) unless `force`, which also replaces an existing output. params: the method's
    parameters to write, from the source (api.convert checks them against the method's class; None:
    as stored). Returns what was written."""
    from mmkv_cli.pack import write_pack

    if is_url(output):  # written here, then published whole
        if str(output) == str(source):
            raise UsageError(f"{output} is the pack being converted: pick another output")
        with staged_upload(str(output), force) as local:
            done = convert(source, local, quant, start, stop, force, params)
        return {**done, "path": str(output)}
    output = local_path(output)
    reader = PackReader(source)
    if (
        reader.source.local and output.exists() and os.path.samefile(output, reader.path)
    ):  # a link to it counts too
        raise UsageError(f"{output} is the pack being converted: pick another output")
    check_writable(output, force)
    quant = quant or reader.quant or QuantSpec()
    had = reader.quant.bits if reader.quant else 16
    if quant.bits > had and not force:
        raise UsageError(
            f"{reader.path} stores {had}-bit KV: {quant.bits} bits cannot bring back what was lost "
            "and only makes the pack bigger (pass --force to do it anyway)"
        )
    prefix = reader.span("prefix")  # stored as computed: the KV's true width and dtype
    quant.check(int(prefix.keys[0].shape[0]), int(prefix.keys[0].shape[2]))
    rows = kept_rows(reader, start, stop)
    header = _converted_header(reader, params, prefix, int(len(rows)), [start, stop])
    # decode in float32 for a re-quantization (no rounding to the KV's dtype in between); keep the
    # KV's dtype when storing as computed
    dtype = torch.float32 if quant.quantized else prefix.keys[0].dtype
    blocks = _Blocks(reader, rows, dtype)
    size = write_pack(
        output,
        header,
        prefix,
        blocks,
        reader.span("suffix"),
        force,
        quant,
        "post_rope" if reader.rotated_representatives else "pre_rope",
        blocks.shapes(),
        _series(reader),
    )
    return {
        "path": str(output),
        "bytes": size,
        "source_bytes": reader.size,
        "blocks": len(blocks),
        "source_blocks": len(reader.blocks),
        "kv_bits": quant.bits,
        "kv_group": quant.group if quant.quantized else None,
        "source_kv_bits": had,
    }


def _converted_header(reader: PackReader, params, prefix: Span, kept: int, cut: list) -> PackHeader:
    """The source's header, its KV shape as the reader checked it against the stored tensors (the
    dtype the prefix decodes to), its method's parameters as `params` gives them, and a record of
    the conversion."""
    header = reader.header
    method = header.method
    if params is not None:
        method = replace(method, params=params(reader), params_exact=True)
    kv = replace(header.kv, dtype=str(prefix.keys[0].dtype).replace("torch.", ""))
    converted = {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source": str(reader.path),
        "source_format_version": header.format_version,
        "source_kv_bits": reader.quant.bits if reader.quant else 16,
        "range": None if cut == [None, None] else cut,
        "blocks_kept": kept,
        "blocks_source": len(reader.blocks),
    }
    return replace(header, kv=kv, method=method, converted=converted)


def _series(reader: PackReader) -> dict[str, list]:
    """The lists that grow with the video, as the source stores them (those it stores)."""
    out = {}
    for name in SERIES:
        try:
            out[name] = reader.series(name)
        except PackError:  # a pack that never stored it
            continue
    return out
