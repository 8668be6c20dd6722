"""Write a pack atomically: a temporary file beside the target, fsync, then rename into place."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.core.errors import PackError, output_exists
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.access.block_writing import KeyScales, write_blocks
from mmkv_cli.pack.integrity.checks import index_digest
from mmkv_cli.pack.integrity.hashing import REPS_CHUNK, chunk_count, chunk_digests, tensors_digest
from mmkv_cli.pack.io.atomic import TEMP_SUFFIX, check_writable, sweep_stale
from mmkv_cli.pack.quantized.quant import (
    QuantSpec,
)
from mmkv_cli.pack.schema.format import (
    BLOCKS,
    EMBEDS,
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
)
from mmkv_cli.pack.schema.header import PackHeader
from mmkv_cli.pack.schema.stored import block_shape, store

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
    """(granularity names, table rows, times, rows of blocks.k, .pos, .kq, representatives,
    layer totals, embeddings) for the blocks of `shapes`, in one pass. Key groups span the blocks
    (v9): the table's key-group column is 0, and each layer's run over every block has
    ceil(tokens / group) of them."""
    kinds, table, times, reps, embeds = [], [], [], [], []
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
        embeds.append(block.embeddings)
        if block.embeddings is not None and block.embeddings.shape[0] != counts[0]:
            raise PackError("internal: a block's embeddings are not one a token of its first layer")
        offset += sum(counts)
        positions += counts[0] if shared else sum(counts)
    groups = sum(-(-n // quant.group) for n in totals) if quant.quantized else 0
    return kinds, table, times, [offset, positions, groups], reps, totals, embeds


def stacked_embeddings(embeds: list) -> torch.Tensor | None:
    """The blocks' embeddings as stored ("embeds" [tokens, dim] float16, v13), or None unless every
    block has them."""
    if not embeds or any(e is None for e in embeds):
        return None
    return torch.cat([e.reshape(-1, e.shape[-1]).cpu() for e in embeds]).to(torch.float16)


def _block_tensors(first: Span, quant: QuantSpec, rows: list[int]) -> dict:
    """name -> (safetensors dtype, shape) of the shared block tensors, from the first block."""
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


@dataclass
class PackPlan:
    """Everything about a pack but its blocks' bytes: the small tensors (written whole), the shared
    block tensors' dtypes and shapes, the directory, and the header as stored. Its `head` is the
    file's first bytes, made again once the quantized keys' scales exist."""

    small: dict[str, torch.Tensor]
    streamed: dict[str, tuple[str, list[int]]]
    entries: dict
    stored: dict
    totals: list[int]
    quant: QuantSpec
    digest_layers: int  # stored layers each of a block's digests covers

    def key_scales(self) -> KeyScales | None:
        """The spanning key groups to fill while the blocks are written (a quantized pack)."""
        if not self.quant.quantized or not self.streamed:
            return None
        heads, dim = self.streamed[f"{BLOCKS}.kq"][1][2:]
        return KeyScales(self.quant, self.totals, heads, dim)

    def head(self, scales: torch.Tensor | None, room: int = 0) -> bytes:
        """The file's first bytes, padded with spaces (JSON whitespace) to `room` bytes of
        directory where it is shorter."""
        if scales is not None:
            digests = chunk_digests(raw_bytes(scales), REPS_CHUNK, DIGEST)
            self.stored["integrity"]["key_scales"][DIGEST] = digests
        return _safetensors_head(self.stored, self.entries, room)


def plan_pack(
    header: PackHeader,
    prefix: Span,
    shapes: Sequence[BlockShape],
    first: Span | None,
    suffix: Span,
    quant: QuantSpec | None = None,
    reps_space: str = "pre_rope",
    series: dict[str, list] | None = None,
) -> PackPlan:
    """The plan of the pack write_pack writes; first: the first block (its dtype and widths are
    every block's)."""
    quant = quant or QuantSpec()
    small, spans_meta = _span_tensors(prefix, suffix)
    small.update(series_tensors(series or {}))
    # All blocks share a few tensors (a handful of safetensors entries, whatever the video
    # length); each block is a contiguous row range of each of them.
    kinds, table, times, rows, reps, totals, embeds = table_layout(shapes, quant)
    streamed: dict[str, tuple[str, list[int]]] = {}
    if first is not None:
        streamed = _block_tensors(first, quant, rows)
        small[f"{BLOCKS}.table"] = narrowed(torch.tensor(table, dtype=torch.int64))
        small[f"{BLOCKS}.time"] = torch.tensor(times, dtype=torch.float64)
    if reps and all(r is not None for r in reps):
        # in the KV's own dtype: retrieval keys need no more precision than the keys they average
        dtype = prefix.keys[0].dtype if prefix.keys else torch.float32
        small["reps"] = torch.stack([r.reshape(-1, r.shape[-1]) for r in reps]).to(dtype)
    stacked = stacked_embeddings(embeds)
    if stacked is not None:
        small[EMBEDS] = stacked
    layers = len(first.layer_counts) if first is not None else len(prefix.layer_counts)
    digest_layers = layers_per_digest(layers, small.get("reps"))
    entries = _directory(small, streamed, len(table), layers // digest_layers)
    stored = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header.sections(),
        "spans": spans_meta,
        "blocks": {"count": len(table), "granularities": kinds, "digest_layers": digest_layers},
        "quant": quant.as_header(),
        "representatives": _representatives(small.get("reps"), reps_space),
        "integrity": _integrity(entries, small),
    }
    if stacked is not None:  # v13: only a pack that keeps them says so
        stored["embeddings"] = {"dim": int(stacked.shape[1])}
    if quant.quantized and streamed:  # their digests once they are made: the same length
        chunks = chunk_count(math.prod(streamed[f"{BLOCKS}.kq"][1]) * 2, REPS_CHUNK)
        stored["integrity"]["key_scales"] = {"chunk": REPS_CHUNK, DIGEST: ["0" * 64] * chunks}
    return PackPlan(small, streamed, entries, stored, totals, quant, digest_layers)


def layers_per_digest(layers: int, reps: torch.Tensor | None) -> int:
    """How many stored layers each digest of a block covers (v12): one model layer's where the
    pack keeps retrieval keys per layer (a retrieval reads a layer's rows of the blocks it picks,
    and checks only those), else the whole block (a reader takes every layer: fewer, larger
    digests hash faster)."""
    if reps is None or reps.shape[1] < 2 or layers % reps.shape[1]:
        return max(1, layers)
    return layers // reps.shape[1]


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
    first = blocks[0] if blocks else None
    shapes = checked_shapes(blocks) if shapes is None else shapes
    plan = plan_pack(header, prefix, shapes, first, suffix, quant, reps_space, series)
    sweep_stale(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:  # mode: 0666 less the umask, as any new file
            data_start = len(plan.head(None))
            keys = plan.key_scales()
            starts = block_starts(plan, data_start)
            ends, digests = write_blocks(fh, blocks, starts, keys, DIGEST, plan.digest_layers)
            finish_file(fh, path, plan, data_start, 0, ends, digests, keys)
        publish(tmp, path, force)
    except OSError as err:
        raise write_failed(path, err) from err
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def temp_path(path: Path) -> Path:
    """The temporary file beside `path` a pack is written to before it is renamed into place."""
    return path.parent / f".{path.name}.{os.getpid()}{TEMP_SUFFIX}"


def block_starts(plan: PackPlan, data_start: int) -> list[int]:
    """Where each shared block tensor begins in the file, in file order (the keys' scales last)."""
    return [data_start + plan.entries[name]["data_offsets"][0] for name in plan.streamed]


def finish_file(fh, path, plan: PackPlan, data_start: int, room: int, ends, digests, keys) -> None:
    """What follows the blocks' bytes: the small tensors, the blocks' digests, the head (with the
    keys' scales' digests, padded to `room`), then fsync. ends: where each block tensor's writes
    ended; digests: each block's, in table order."""
    want = [data_start + plan.entries[name]["data_offsets"][1] for name in plan.streamed]
    if ends != want:
        raise PackError(f"internal: the blocks of {path} did not fill their tensors")
    fh.seek(data_start)
    for tensor in plan.small.values():
        fh.write(raw_bytes(tensor))
    if plan.streamed:
        fh.seek(data_start + plan.entries[f"{BLOCKS}.{DIGEST}"]["data_offsets"][0])
        fh.write(b"".join(digests))
    head = plan.head(keys.ranges.scales if keys else None, room)
    if len(head) != data_start:
        raise PackError(f"internal: the head of {path} changed length")
    fh.seek(0)
    fh.write(head)
    fh.flush()
    os.fsync(fh.fileno())


def write_failed(path: Path, err: OSError) -> PackError:
    """The one line a pack that could not be written is refused with (a full disk, say)."""
    return PackError(f"cannot write {path}: {err.strerror or err}")


def publish(tmp: Path, path: Path, force: bool) -> None:
    """The written temporary file renamed into place, unless a pack appeared there meanwhile."""
    if path.exists() and not force:  # appeared while we were encoding
        raise output_exists(path)
    os.replace(tmp, path)


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


def _directory(small: dict, streamed: dict, blocks: int, digests: int) -> dict:
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
    if blocks:  # each block's digests, one per digest_layers stored layers
        place(f"{BLOCKS}.{DIGEST}", "U8", [blocks, digests, 32], 32 * blocks * digests)
    return entries


def _representatives(reps: torch.Tensor | None, space: str) -> dict | None:
    if reps is None:
        return None
    return {"dim": int(reps.shape[2]), "layers": int(reps.shape[1]), "space": space}


def _integrity(entries: dict, small: dict) -> dict:
    """The header's digests: the directory and the small tensors no other checksum covers, and
    the representatives and the embeddings a chunk at a time."""
    integrity: dict = {"index": index_digest(entries, lambda name: raw_bytes(small[name]), DIGEST)}
    for name in ("reps", EMBEDS):
        if name in small:
            digests = chunk_digests(raw_bytes(small[name]), REPS_CHUNK, DIGEST)
            integrity[name] = {"chunk": REPS_CHUNK, DIGEST: digests}
    return integrity


def _safetensors_head(stored: dict, entries: dict, room: int = 0) -> bytes:
    """The file's first bytes: the directory's length, then the directory with the header (and
    its checksum) as metadata, padded to 8 bytes as safetensors does (or to `room`)."""
    text = json.dumps(stored, sort_keys=True)
    metadata = {META_HEADER: text, META_HEADER_SHA: hashlib.sha256(text.encode()).hexdigest()}
    head = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    head += b" " * max(room - len(head), -len(head) % 8)
    return struct.pack("<Q", len(head)) + head
