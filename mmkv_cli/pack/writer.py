"""Write a pack atomically: a temporary file beside the target, fsync, then rename into place."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from mmkv_cli.errors import PackError, output_exists
from mmkv_cli.lazy import torch
from mmkv_cli.pack import vidkv
from mmkv_cli.pack.atomic import TEMP_SUFFIX, check_writable, sweep_stale
from mmkv_cli.pack.format import (
    BLOCKS,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_HEADER,
    META_HEADER_SHA,
    SERIES,
    BlockShape,
    Span,
    block_name,
    digest_name,
    raw_bytes,
    tensors_digest,
)
from mmkv_cli.pack.hashing import REPS_CHUNK, chunk_count, chunk_digests, new_digest
from mmkv_cli.pack.header import PackHeader
from mmkv_cli.pack.integrity import index_digest
from mmkv_cli.pack.quant import (
    QuantSpec,
    SpanningKeyRanges,
    quantize_keys_with,
    quantize_values,
    spanning_groups,
)
from mmkv_cli.pack.stored import block_shape, store, stored_positions

DIGEST = digest_name(FORMAT_VERSION)  # the hash of every checksum written, and their fields' name


def series_tensors(series: dict[str, list]) -> dict[str, torch.Tensor]:
    """The lists that grow with the video (timestamps, tokens per step) as the tensors they are
    stored as."""
    out = {}
    for name, values in series.items():
        if name not in SERIES:
            raise PackError(f"internal: '{name}' is not a pack series ({', '.join(SERIES)})")
        out[name] = narrowed(torch.tensor(values, dtype=getattr(torch, SERIES[name])).reshape(-1))
    return out


def narrowed(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor as int32 when every value fits (v8): at one layer, the table and the steps'
    lengths were a percent of an hour's pack. Readers widen them again before any arithmetic."""
    if t.dtype != torch.int64 or not t.numel():
        return t
    info = torch.iinfo(torch.int32)
    return t.to(torch.int32) if info.min <= int(t.min()) and int(t.max()) <= info.max else t


# torch dtype name -> safetensors dtype code
SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}
ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1}


def _dtype_code(t: torch.Tensor) -> str:
    return SAFETENSORS_DTYPES[str(t.dtype).replace("torch.", "")]


def checked_shapes(blocks: Sequence[Span]):
    """Each block's table entry read off its tensors, checking it is named by its row."""
    for index, block in enumerate(blocks):
        if block.name != block_name(index):  # readers name blocks by their row in the table
            raise PackError(
                f"internal: block {index} is named '{block.name}', not '{block_name(index)}'"
            )
        yield block_shape(block)


def table_layout(shapes, quant: QuantSpec):
    """(granularity names, table rows, times, rows of blocks.k, .pos, .kq, representatives) for
    the blocks of `shapes`, in one pass. Key groups span the blocks (v9): the table's key-group
    column is 0, and each layer's run over every block has ceil(tokens / group) of them."""
    kinds, table, times, reps = [], [], [], []
    offset = positions = 0
    totals: list[int] = []
    for block in shapes:
        if block.granularity not in kinds:
            kinds.append(block.granularity)
        counts, shared = list(block.layer_counts), block.shared_positions
        steps = list(block.steps) if block.steps else [-1, -1]
        # the key-group column (v7/v8) stays 0: v9's groups follow each layer's run
        table.append(
            [kinds.index(block.granularity), *steps, offset, positions, int(shared), 0, *counts]
        )
        totals = [a + b for a, b in zip(totals, counts)] if totals else list(counts)
        times.append([round(float(t), 4) for t in block.time] if block.time else [float("nan")] * 2)
        reps.append(block.representative)
        offset += sum(counts)
        positions += counts[0] if shared else sum(counts)
    groups = sum(-(-n // quant.group) for n in totals) if quant.quantized else 0
    return kinds, table, times, [offset, positions, groups], reps, totals


class _KeyScales:
    """Spanning key groups in one pass over the blocks: a block's key codes are made as soon as
    every group its tokens fall in is closed (a small block waits for the next few, never more
    than a group's tokens of them), and the scales are complete after the last block."""

    def __init__(self, quant: QuantSpec, totals: list[int], heads: int, dim: int):
        self.quant = quant
        self.ranges = SpanningKeyRanges(totals, quant.group, quant.bits, heads, dim)
        self.before = [0] * len(totals)
        self.waiting: list[tuple[Span, list[int]]] = []

    def feed(self, block: Span) -> list[tuple[Span, list]]:
        """Take in the next block; the blocks (in order) whose codes can now be made."""
        values = block.part(1) if self.quant.mixed else None
        self.ranges.add(block.part(0), block.layer_counts, values)
        self.waiting.append((block, self.before))
        self.before = [a + b for a, b in zip(self.before, block.layer_counts)]
        ready = 0
        while ready < len(self.waiting) and self._closed(*self.waiting[ready]):
            ready += 1
        return self._codes(ready)

    def finish(self) -> list[tuple[Span, list]]:
        self.ranges.finish()
        return self._codes(len(self.waiting))

    def _closed(self, block: Span, before: list[int]) -> bool:
        group, closed = self.quant.group, self.ranges.closed
        return all(
            n == 0 or (start + n - 1) // group < done
            for start, n, done in zip(before, block.layer_counts, closed)
        )

    def _codes(self, ready: int) -> list[tuple[Span, list]]:
        """(block, its stored parts) for the first `ready` waiting blocks."""
        out, quant = [], self.quant
        for block, before in self.waiting[:ready]:
            rows = spanning_groups(before, block.layer_counts, quant.group, self.ranges.firsts)
            keys = quantize_keys_with(block.part(0), self.ranges.scales, rows, quant.bits)
            positions = stored_positions(block)[0]
            if quant.mixed:  # values per channel, against the same groups' fourth plane
                planes = self.ranges.scales.index_select(0, rows)
                out.append((block, [keys, vidkv.encode_values(block.part(1), planes), positions]))
                continue
            heads, dim = block.keys[0].shape[0], block.keys[0].shape[2]
            group = quant.value_group(heads, dim)
            values, value_scales = quantize_values(block.part(1), quant.bits, group)
            out.append((block, [keys, values, positions, value_scales]))
        del self.waiting[:ready]
        return out


def _write_blocks(fh, blocks: Sequence[Span], starts: list[int], keys: _KeyScales | None):
    """Write every block's stored tensors where they go (starts: where each streamed part's
    tensor begins in the file), each block made (and quantized) once, then (quantized) the keys'
    scales. Returns where each part's writes ended and the blocks' digests.
    The file keeps all blocks' K, then all V, ...: each part is a run of writes in block order."""
    at, digests = list(starts), []

    def write(block: Span, stored: list | None) -> None:
        digest = new_digest(DIGEST)
        if stored is None:  # as computed
            stored = [block.part(0), block.part(1), stored_positions(block)[0]]
        for part, data in enumerate(stored):
            raw = raw_bytes(data)
            digest.update(raw)
            fh.seek(at[part])
            fh.write(raw)
            at[part] += raw.nbytes
        digests.append(digest.digest())

    for block in blocks:
        for made in keys.feed(block) if keys else [(block, None)]:
            write(*made)
    if keys:
        for made in keys.finish():
            write(*made)
        raw = raw_bytes(keys.ranges.scales)
        fh.seek(at[-1])
        fh.write(raw)
        at[-1] += raw.nbytes
    return at, digests


def _block_tensors(blocks: list[Span], quant: QuantSpec, rows: list[int]) -> dict:
    """name -> (safetensors dtype, shape) of the shared block tensors, from the first block."""
    first = blocks[0]
    heads, dim = first.keys[0].shape[0], first.keys[0].shape[2]
    kv_code = "U8" if quant.quantized else _dtype_code(first.keys[0])
    key_width = quant.key_width(dim) if quant.quantized else dim
    value_width = quant.value_width(dim) if quant.quantized else dim
    out = {
        f"{BLOCKS}.k": (kv_code, [rows[0], heads, key_width]),
        f"{BLOCKS}.v": (kv_code, [rows[0], heads, value_width]),
        f"{BLOCKS}.pos": ("I32", [rows[1], first.positions[0].shape[0]]),
    }
    if quant.quantized and not quant.mixed:
        groups = heads * dim // quant.value_group(heads, dim)
        out[f"{BLOCKS}.vq"] = ("F16", [rows[0], groups, 2])
    if quant.quantized:  # the keys' scales last: they are complete once the last block is made
        out[f"{BLOCKS}.kq"] = ("F16", [rows[2], quant.key_planes, heads, dim])
    return out


def write_pack(
    path: Path,
    header: PackHeader,
    prefix: Span,
    blocks: Sequence[Span],
    suffix: Span,
    force: bool = False,
    quant: QuantSpec | None = None,
    reps_space: str = "pre_rope",
    shapes: Sequence[BlockShape] | None = None,
    series: dict[str, list] | None = None,
) -> int:
    """Write header + spans to `path` atomically; returns the file size in bytes. quant: how the
    blocks' K/V are stored (None: as computed); the prefix and suffix always are as computed.
    reps_space: what the representatives are means of: keys before RoPE ("pre_rope") or after it
    ("post_rope": MuKV's code, as each block was prefilled; or a pack before v6, converted).
    shapes: what the table holds of each block, where the caller knows it without loading them
    (default: read off the blocks). series: "media.timestamps" and "layout.step_lengths".

    The file is a safetensors file written here directly: the directory first, then every tensor's
    bytes, the blocks streamed one at a time, each part at its place (a pack of an hour of video is
    many GB: it is never assembled in memory, only each block's stored copy while it is written and
    hashed). `blocks` may be a lazy sequence that loads a block when indexed (convert): it is read
    once to be written, and once more for the table unless `shapes` are given.
    """
    check_writable(path, force)
    quant = quant or QuantSpec()
    small, spans_meta = _span_tensors(prefix, suffix)
    small.update(series_tensors(series or {}))
    # All blocks share a few tensors (a handful of safetensors entries, whatever the video
    # length); each block is a contiguous row range of each of them.
    layout = table_layout(checked_shapes(blocks) if shapes is None else shapes, quant)
    kinds, table, times, rows, reps, totals = layout
    streamed: dict[str, tuple[str, list[int]]] = {}
    keys = None
    if blocks:
        streamed = _block_tensors(blocks, quant, rows)
        if quant.quantized:
            heads, dim = streamed[f"{BLOCKS}.kq"][1][2:]
            keys = _KeyScales(quant, totals, heads, dim)
        small[f"{BLOCKS}.table"] = narrowed(torch.tensor(table, dtype=torch.int64))
        small[f"{BLOCKS}.time"] = torch.tensor(times, dtype=torch.float64)
    if reps and all(r is not None for r in reps):
        # in the KV's own dtype: retrieval keys need no more precision than the keys they average
        dtype = prefix.keys[0].dtype if prefix.keys else torch.float32
        small["reps"] = torch.stack([r.reshape(-1, r.shape[-1]) for r in reps]).to(dtype)
    entries = _directory(small, streamed, len(blocks))
    stored = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header.sections(),
        "spans": spans_meta,
        "blocks": {"count": len(blocks), "granularities": kinds},
        "quant": quant.as_header(),
        "representatives": _representatives(small.get("reps"), reps_space),
        "integrity": _integrity(entries, small),
    }
    if keys:  # their digests once they are made: the same length, so the head's stays
        chunks = chunk_count(math.prod(streamed[f"{BLOCKS}.kq"][1]) * 2, REPS_CHUNK)
        stored["integrity"]["key_scales"] = {"chunk": REPS_CHUNK, DIGEST: ["0" * 64] * chunks}

    def head(scales: torch.Tensor | None) -> bytes:
        if scales is not None:
            digests = chunk_digests(raw_bytes(scales), REPS_CHUNK, DIGEST)
            stored["integrity"]["key_scales"][DIGEST] = digests
        return _safetensors_head(stored, entries)

    return _write_file(path, head, small, blocks, keys, entries, streamed, force)


def _span_tensors(prefix: Span, suffix: Span) -> tuple[dict[str, torch.Tensor], dict]:
    """The prefix's and suffix's stored tensors by name, and their header entries."""
    small: dict[str, torch.Tensor] = {}
    spans_meta = {}
    for seg in (prefix, suffix):
        parts, shared = store(seg)
        small.update({f"{seg.name}.{part}": t for part, t in parts.items()})
        spans_meta[seg.name] = {
            "layer_counts": seg.layer_counts,
            "shared_positions": shared,
            DIGEST: tensors_digest(list(parts.values()), DIGEST),
        }
    return small, spans_meta


def _directory(small: dict, streamed: dict, blocks: int) -> dict:
    """The safetensors directory: each tensor's dtype, shape and byte range, in writing order."""
    entries: dict = {}
    at = 0

    def place(name: str, code: str, shape: list[int], nbytes: int) -> None:
        nonlocal at
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes

    for name, tensor in small.items():
        place(name, _dtype_code(tensor), list(tensor.shape), tensor.numel() * tensor.element_size())
    for name, (code, shape) in streamed.items():
        place(name, code, shape, math.prod(shape) * ELEMENT_BYTES[code])
    if blocks:
        place(f"{BLOCKS}.{DIGEST}", "U8", [blocks, 32], 32 * blocks)
    return entries


def _representatives(reps: torch.Tensor | None, space: str) -> dict | None:
    if reps is None:
        return None
    return {"dim": int(reps.shape[2]), "layers": int(reps.shape[1]), "space": space}


def _integrity(entries: dict, small: dict) -> dict:
    """The header's digests: the directory and the small tensors no other checksum covers, and
    the representatives a chunk at a time."""
    integrity: dict = {"index": index_digest(entries, lambda name: raw_bytes(small[name]), DIGEST)}
    if "reps" in small:
        digests = chunk_digests(raw_bytes(small["reps"]), REPS_CHUNK, DIGEST)
        integrity["reps"] = {"chunk": REPS_CHUNK, DIGEST: digests}
    return integrity


def _safetensors_head(stored: dict, entries: dict) -> bytes:
    """The file's first bytes: the directory's length, then the directory with the header (and
    its checksum) as metadata, padded to 8 bytes as safetensors does."""
    text = json.dumps(stored, sort_keys=True)
    metadata = {META_HEADER: text, META_HEADER_SHA: hashlib.sha256(text.encode()).hexdigest()}
    head = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def _write_file(path, head, small, blocks, keys, entries, streamed, force) -> int:
    """Every byte to a temporary file beside `path`, fsync'd, then renamed into place. head(key
    scales): the file's first bytes, made again with the key scales' digests once they exist."""
    sweep_stale(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as fh:  # mode: 0666 less the umask, as any new file
            first = head(None)
            fh.write(first)
            for tensor in small.values():
                fh.write(raw_bytes(tensor))
            data_start = len(first)
            parts = list(streamed)  # the blocks' parts in file order, the keys' scales last
            starts = [data_start + entries[name]["data_offsets"][0] for name in parts]
            ends, digests = _write_blocks(fh, blocks, starts, keys)
            if ends != [data_start + entries[name]["data_offsets"][1] for name in parts]:
                raise PackError(f"internal: the blocks of {path} did not fill their tensors")
            if blocks:
                fh.seek(data_start + entries[f"{BLOCKS}.{DIGEST}"]["data_offsets"][0])
                fh.write(b"".join(digests))
            if keys:
                final = head(keys.ranges.scales)
                if len(final) != len(first):
                    raise PackError(f"internal: the head of {path} changed length")
                fh.seek(0)
                fh.write(final)
            fh.flush()
            os.fsync(fh.fileno())
        if path.exists() and not force:  # appeared while we were encoding
            raise output_exists(path)
        os.replace(tmp, path)
    except OSError as err:
        raise PackError(f"cannot write {path}: {err.strerror or err}") from err
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size
