"""Mutated packs, seeded, for the fuzz test and bench/fuzz.py: what an adversary or a bad disk makes
of a pack, and what asking from each one did."""

from __future__ import annotations

import hashlib
import json
import random
import struct
from dataclasses import dataclass

import numpy as np

from mmkv_cli.pack.integrity import index_digest

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
}


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

    def reseal(self) -> None:
        """Recompute the index digest and the header checksum, as a forger would."""
        entries = {k: v for k, v in self.directory.items() if k != "__metadata__"}

        def tensor(name: str) -> bytes:
            start, stop = entries[name]["data_offsets"]
            return bytes(self.data[start:stop])

        header = self.header()
        if "integrity" in header:
            header["integrity"]["index"] = index_digest(entries, tensor)
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
    # field: one header value replaced by junk, the header checksum recomputed
    header = parts.header()
    path, _ = rng.choice([p for p in _paths(header) if p[0]])
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = rng.choice(JUNK)
    parts.set_header(header)
    return parts.bytes()
