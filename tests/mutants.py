"""Mutated packs, seeded, for the fuzz test and bench/fuzz.py: what an adversary or a bad disk makes
of a pack, and what asking from each one did."""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from dataclasses import dataclass

import numpy as np

from mmkv_cli.pack.integrity.checks import index_digest
from mmkv_cli.pack.integrity.hashing import chunk_digests, new_digest
from mmkv_cli.pack.schema.format import digest_name

# same element size, so a dtype edit keeps every byte range valid
STORED = {"I64": np.int64, "I32": np.int32, "F64": np.float64}  # the table's and times' dtypes
SAME_SIZE = {"F32": "I32", "I32": "F32", "F16": "BF16", "BF16": "F16", "I64": "F64", "F64": "I64"}
JUNK = [
    None,
    -1,
    0,
    2**27,
    2**63,
    1.5,
    float("nan"),
    "",
    "load",
    "{x}",
    "../../anywhere/x",
    [],
    {},
    [1, 2],
    {"a": 1},
    True,
]
# mutation kind -> whether its digests are recomputed (a crafted pack: self-consistent bytes)
KINDS = {
    "data": False,
    "header": False,
    "dtype": False,
    "truncate": False,
    "field": True,
    "table": True,
    "shape": True,
    "nonfinite": True,
    # issue 74: markup and escape codes in a header string, every stored position moved, the
    # KV shape forged against the model
    "text": True,
    "positions": True,
    "kvshape": True,
}
HOSTILE_TEXT = [
    "[/bold]",
    "[red]x[/red]",
    "[link=https://x.example]y[/link]",
    "\x1b]0;pwned\x07\x1b[2J",
    "a\u202eb",
    "\x00",
    "\r\nerror: a line of its own",
]
# a float's bytes as NaN, +Inf or -Inf, by safetensors dtype
NON_FINITE = {
    "F32": [struct.pack("<f", v) for v in (math.nan, math.inf, -math.inf)],
    "F16": [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"],
    "BF16": [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"],
}
FLOAT_TENSORS = ("blocks.k", "blocks.v", "blocks.kq", "blocks.vq", "prefix.k", "prefix.v")


@dataclass
class Parts:
    directory: dict
    data: bytearray

    @classmethod
    def of(cls, raw: bytes) -> Parts:
        (length,) = struct.unpack("<Q", raw[:8])
        return cls(json.loads(raw[8 : 8 + length]), bytearray(raw[8 + length :]))

    def header(self) -> dict:
        return json.loads(self.directory["__metadata__"]["mmkv"])

    def set_header(self, header: dict) -> None:
        text = json.dumps(header, sort_keys=True)
        self.directory["__metadata__"] = {
            "mmkv": text,
            "mmkv_sha256": hashlib.sha256(text.encode()).hexdigest(),
        }

    @classmethod
    def with_header(cls, path, edit) -> bytes:
        """The pack at `path` with its header edited by `edit(header)` and its checksum made
        again, as a forger would."""
        parts = cls.of(path.read_bytes())
        header = parts.header()
        edit(header)
        parts.set_header(header)
        return parts.bytes()

    def reseal(self) -> None:
        """Recompute the index digest and the header checksum, as a forger would."""
        entries = {k: v for k, v in self.directory.items() if k != "__metadata__"}

        def tensor(name: str) -> bytes:
            start, stop = entries[name]["data_offsets"]
            return bytes(self.data[start:stop])

        header = self.header()
        if "integrity" in header:
            algorithm = digest_name(header["format_version"])
            header["integrity"]["index"] = index_digest(entries, tensor, algorithm)
        self.set_header(header)

    def bytes(self) -> bytes:
        head = json.dumps(self.directory, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head + bytes(self.data)


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list) and node:
        index = len(node) // 2
        yield from _paths(node[index], (*prefix, index))
    yield prefix, node


def mutate(raw: bytes, kind: str, rng: random.Random) -> bytes:
    """One mutant of the pack bytes `raw`."""
    if kind == "data" or kind == "header":
        (length,) = struct.unpack("<Q", raw[:8])
        low, high = (8 + length, len(raw)) if kind == "data" else (8, 8 + length)
        out = bytearray(raw)
        at = rng.randrange(low, high)
        out[at] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == "truncate":
        return raw[: rng.randrange(0, len(raw))]
    parts = Parts.of(raw)
    names = sorted(k for k in parts.directory if k != "__metadata__")
    if kind == "dtype":
        name = rng.choice([n for n in names if parts.directory[n]["dtype"] in SAME_SIZE])
        entry = parts.directory[name]
        entry["dtype"] = SAME_SIZE[entry["dtype"]]
        return parts.bytes()
    if kind == "shape":
        name = rng.choice(names)
        shape = parts.directory[name]["shape"]
        if len(shape) >= 2 and rng.random() < 0.5:
            shape[0], shape[-1] = shape[-1], shape[0]  # the same bytes, another shape
        else:
            shape[rng.randrange(len(shape))] += rng.choice([-1, 1, 2**20])
        parts.reseal()
        return parts.bytes()
    if kind == "table":
        name = rng.choice([n for n in ("blocks.table", "blocks.time") if n in parts.directory])
        start, stop = parts.directory[name]["data_offsets"]
        dtype = STORED[parts.directory[name]["dtype"]]
        # mutated wide, then stored back in the pack's own width (an int32 table wraps)
        wide = np.float64 if dtype == np.float64 else np.int64
        values = np.frombuffer(bytes(parts.data[start:stop]), dtype=dtype).astype(wide)
        at = rng.randrange(len(values))
        values[at] = rng.choice([-1, 0, 1, 2**27, -(2**40), values[at] + 1, values[at] - 1])
        if dtype == np.float64 and rng.random() < 0.3:
            values[at] = rng.choice([np.nan, np.inf, -5.0])
        parts.data[start:stop] = values.astype(dtype).tobytes()
        parts.reseal()
        return parts.bytes()
    if kind == "nonfinite":
        return nonfinite(parts, rng)
    header = parts.header()
    blocks = "blocks.pos" in parts.directory and "blocks.table" in parts.directory
    # the v7 table's columns say which rows a block's checksum covers
    if kind == "positions" and blocks and header.get("format_version", 0) >= 7:
        last = (header.get("layout") or {}).get("next_position") or 1
        value = rng.choice([-1, -1_000_000, 2**31 - 1, last, last + 5, last - 1, 0])
        return with_positions(raw, value)
    if kind == "kvshape" and isinstance(header.get("kv"), dict):
        kv = header["kv"]
        key = rng.choice(["layers", "kv_heads", "head_dim", "both"])
        if key == "both" and all(isinstance(kv.get(k), int) for k in ("layers", "kv_heads")):
            kv["layers"], kv["kv_heads"] = kv["layers"] * kv["kv_heads"], 1
        elif isinstance(kv.get(key), int):
            kv[key] = rng.choice([kv[key] * 2, kv[key] + 1, max(1, kv[key] // 2)])
        parts.set_header(header)
        return parts.bytes()
    if kind == "text":
        strings = [path for path, value in _paths(header) if path and isinstance(value, str)]
        if strings:
            path = rng.choice(strings)
            node = header
            for key in path[:-1]:
                node = node[key]
            hostile = rng.choice(HOSTILE_TEXT)
            node[path[-1]] = rng.choice([hostile, node[path[-1]] + hostile])
            parts.set_header(header)
            return parts.bytes()
    # field (and a kind the pack has nothing for): one header value replaced by junk, the
    # header checksum recomputed
    path, _ = rng.choice([p for p in _paths(header) if p[0]])
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = rng.choice(JUNK)
    parts.set_header(header)
    return parts.bytes()


def nonfinite(parts: Parts, rng: random.Random, name: str | None = None) -> bytes:
    """A NaN or Inf written into a K/V (or scale) tensor (`name`, or one drawn), and every
    checksum over it recomputed: a forger's pack whose bytes are all as sealed."""
    entries = parts.directory
    floats = [n for n in FLOAT_TENSORS if n in entries and entries[n]["dtype"] in NON_FINITE]
    if parts.header()["format_version"] < 7:  # a table without the v7 columns: spans only
        floats = [n for n in floats if not n.startswith("blocks.")]
    name = name or rng.choice(floats)
    entry = entries[name]
    start, stop = entry["data_offsets"]
    size = len(NON_FINITE[entry["dtype"]][0])
    element = rng.randrange((stop - start) // size)
    parts.data[start + element * size : start + (element + 1) * size] = rng.choice(
        NON_FINITE[entry["dtype"]]
    )
    header = parts.header()
    span = name.split(".")[0]
    algorithm = digest_name(header["format_version"])
    if span != "blocks":
        pieces = [_tensor_bytes(parts, f"{span}.{p}") for p in ("k", "v", "pos")]
        spans = header["spans" if "spans" in header else "segments"]  # v2-v4: "segments"
        resealed = new_digest(algorithm)
        resealed.update(b"".join(pieces))
        spans[span][algorithm] = resealed.hexdigest()
        parts.set_header(header)
    elif name == "blocks.kq" and _spanning(header):  # v9: the key scales' own chunk digests
        digest = header["integrity"]["key_scales"]
        digest[algorithm] = chunk_digests(_tensor_bytes(parts, name), digest["chunk"], algorithm)
        parts.set_header(header)
    else:
        row = element // max(1, math.prod(entry["shape"][1:]))
        _reseal_block(parts, header, name, row)
    parts.reseal()
    return parts.bytes()


def _spanning(header: dict) -> bool:
    """v9: key groups run across blocks, their scales covered by no block's checksum."""
    return (header.get("quant") or {}).get("key_groups") == "span"


def _tensor_bytes(parts: Parts, name: str, rows: tuple[int, int] | None = None) -> bytes:
    entry = parts.directory[name]
    start, stop = entry["data_offsets"]
    if rows is not None:
        row = (stop - start) // max(1, entry["shape"][0])
        start, stop = start + rows[0] * row, start + rows[1] * row
    return bytes(parts.data[start:stop])


def _reseal_block(parts: Parts, header: dict, name: str, row: int) -> None:
    """The checksum of the block holding row `row` of block tensor `name`, recomputed (v7 on)."""
    table_entry = parts.directory["blocks.table"]
    table = np.frombuffer(
        _tensor_bytes(parts, "blocks.table"), STORED[table_entry["dtype"]]
    ).reshape(table_entry["shape"])
    column = 6 if name == "blocks.kq" else 3  # key groups, or token rows
    index = int(np.searchsorted(table[:, column], row, side="right")) - 1
    counts = table[index, 7:]
    tokens, offset = int(counts.sum()), int(table[index, 3])
    positions = int(counts[0]) if table[index, 5] else tokens
    spans = {
        "k": (offset, offset + tokens),
        "v": (offset, offset + tokens),
        "pos": (int(table[index, 4]), int(table[index, 4]) + positions),
        "vq": (offset, offset + tokens),
    }
    if "blocks.kq" in parts.directory and not _spanning(header):
        group = header["quant"]["group"]
        groups = int(sum(-(-int(c) // group) for c in counts))
        spans["kq"] = (int(table[index, 6]), int(table[index, 6]) + groups)
    algorithm = digest_name(header["format_version"])
    entry = parts.directory[f"blocks.{algorithm}"]
    units = entry["shape"][1] if len(entry["shape"]) == 3 else 1  # v12: a digest per layer run
    runs = len(counts) // units
    edges = np.concatenate([[0], np.cumsum(counts)])
    digests = b""
    for unit in range(units):  # each run's rows of every part (positions stored once: all)
        first, stop = int(edges[unit * runs]), int(edges[(unit + 1) * runs])
        digest = new_digest(algorithm)
        for part in ("k", "v", "pos", "kq", "vq"):
            if f"blocks.{part}" in parts.directory and part in spans:
                a, b = spans[part]
                if units > 1 and b - a == tokens:
                    a, b = a + first, a + stop
                digest.update(_tensor_bytes(parts, f"blocks.{part}", (a, b)))
        digests += digest.digest()
    start = entry["data_offsets"][0] + 32 * units * index
    parts.data[start : start + len(digests)] = digests


def with_positions(raw: bytes, value: int) -> bytes:
    """Every stored block position set to `value` (in the pack's own width), each block's
    checksum and the index digest recomputed: a forger's pack whose bytes are all as sealed."""
    parts = Parts.of(raw)
    entry = parts.directory["blocks.pos"]
    start, stop = entry["data_offsets"]
    dtype = STORED[entry["dtype"]]
    count = (stop - start) // np.dtype(dtype).itemsize
    parts.data[start:stop] = np.full(count, value, dtype=dtype).tobytes()
    header = parts.header()
    table_entry = parts.directory["blocks.table"]
    table = np.frombuffer(
        _tensor_bytes(parts, "blocks.table"), STORED[table_entry["dtype"]]
    ).reshape(table_entry["shape"])
    for row in table[:, 3].tolist():  # each block's first token row: its checksum again
        _reseal_block(parts, header, "blocks.k", int(row))
    parts.reseal()
    return parts.bytes()


def shown_raw(path) -> str | None:
    """What showing the pack (`inspect`, and `ls` of its folder) put on a terminal that it should
    not have: a raw control character or a markup error (None: nothing)."""
    import contextlib
    import io

    from rich.console import Console

    from mmkv_cli import api
    from mmkv_cli.cli import display
    from mmkv_cli.core.errors import MmkvError

    buffer = io.StringIO()
    saved = display.out_console
    display.out_console = Console(file=buffer, force_terminal=False, color_system=None, width=100)
    try:
        with contextlib.suppress(MmkvError):  # refused, in one line elsewhere
            display.show_inspect(api.inspect(path))
        display.show_listing_of_packs(str(path.parent), api.listing(path.parent))
    except Exception as err:  # noqa: BLE001 (what the fuzzers count)
        return f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        display.out_console = saved
    raw = [c for c in buffer.getvalue() if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0)]
    return f"a raw control character {raw[0]!r} shown" if raw else None


def read_everything(path) -> str:
    """What reading every byte of a pack (no model: the old fixtures name none) came to: refused
    (one clear error), read (every block and span read back, all finite), or internal."""
    import torch

    from mmkv_cli import api
    from mmkv_cli.core.errors import MmkvError
    from mmkv_cli.pack import PackReader

    try:
        api.inspect(path)
        api.verify(path)
        reader = PackReader(path)
        names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
        spans = [reader.span(n, keep=False) for n in ("prefix", "suffix", *names)]
    except MmkvError:
        return "refused"
    except Exception as err:  # noqa: BLE001 (what the fuzzers count)
        return f"internal: {type(err).__name__}: {str(err)[:200]}"
    values = [t for span in spans for t in (*span.keys, *span.values)]
    if not all(bool(torch.isfinite(t).all()) for t in values):
        return "internal: non-finite K/V handed out"
    return "read"
