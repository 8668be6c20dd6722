"""Read a pack lazily: the header and representatives first, block tensors only when asked (mmap)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from mmkv_cli.errors import PackError
from mmkv_cli.pack.format import (BLOCKS, FORMAT_NAME, FORMAT_VERSION, META_HEADER, META_HEADER_SHA,
                                  READABLE_VERSIONS, TABLE_COLUMNS, Segment, split_layers,
                                  tensors_sha256)
from mmkv_cli.pack.table import BlockTable


def _read_safetensors_header(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise PackError(f"{path} is not a kvpack (empty or truncated)")
        (length,) = struct.unpack("<Q", raw)
        if length <= 0 or 8 + length > size:
            raise PackError(f"{path} is not a kvpack, or it is truncated")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PackError(f"{path} is corrupted (unreadable header)") from err
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + length + max(ends, default=0) != size:
        raise PackError(f"{path} is truncated or has trailing garbage ({size} bytes on disk)")
    return header


class PackReader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise PackError(f"no such pack: {self.path}")
        raw = _read_safetensors_header(self.path)
        meta = raw.get("__metadata__") or {}
        text = meta.get(META_HEADER)
        if text is None:
            raise PackError(f"{self.path} is a safetensors file but not a kvpack")
        if hashlib.sha256(text.encode()).hexdigest() != meta.get(META_HEADER_SHA):
            raise PackError(f"{self.path} is corrupted (header checksum mismatch)")
        self.header = json.loads(text)
        if self.header.get("format") != FORMAT_NAME:
            raise PackError(f"{self.path} is not a kvpack")
        version = self.header.get("format_version")
        if version not in READABLE_VERSIONS:
            raise PackError(f"{self.path} is kvpack format v{version}; this mmkv reads "
                            f"v{', v'.join(map(str, READABLE_VERSIONS))}")
        self.bytes_read = 0
        self._segments: dict[str, Segment] = {}
        try:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
        except Exception as err:  # SafetensorError
            raise PackError(f"{self.path} is corrupted: {err}") from err
        # v2 kept the table as JSON in the header
        self._blocks = BlockTable.from_dicts(self.header["blocks"]) if version == 2 else self._block_table()

    def _block_table(self) -> BlockTable:
        """The v3 block table: three small tensors, read whole (a few dozen bytes per block)."""
        meta = self.header["blocks"]
        layers = len(self.header["segments"]["prefix"]["layer_counts"])
        if not meta["count"]:
            return BlockTable(meta["granularities"], torch.zeros(0, TABLE_COLUMNS + layers, dtype=torch.int64),
                              torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, 32, dtype=torch.uint8))
        return BlockTable(meta["granularities"], self._tensor(f"{BLOCKS}.table"), self._tensor(f"{BLOCKS}.time"),
                          self._tensor(f"{BLOCKS}.sha256"))

    @property
    def blocks(self) -> BlockTable:
        return self._blocks

    def _block_meta(self, name: str) -> dict | None:
        index = self._blocks.index_of(name)
        return None if index is None else self._blocks[index]

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            t = self._file.get_tensor(name)
        except Exception as err:
            raise PackError(f"{self.path} is corrupted: tensor {name} unreadable ({err})") from err
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _slice(self, name: str, span: slice) -> torch.Tensor:
        try:
            t = self._file.get_slice(name)[:, span]
        except Exception as err:
            raise PackError(f"{self.path} is corrupted: tensor {name} unreadable ({err})") from err
        self.bytes_read += t.numel() * t.element_size()
        return t

    def representatives(self) -> torch.Tensor | None:
        return self._tensor("reps") if self.header.get("representatives") else None

    def segment(self, name: str) -> Segment:
        """Load one segment ("prefix", "suffix" or a block name), verifying its checksum."""
        if name not in self._segments:
            self._segments[name] = self._load_segment(name)
        return self._segments[name]

    def _load_segment(self, name: str) -> Segment:
        meta = self.header["segments"].get(name) or self._block_meta(name)
        if meta is None:
            raise PackError(f"{self.path} has no segment {name}")
        if "offset" in meta:  # a block: its token range of the shared block tensors
            span = slice(meta["offset"], meta["offset"] + sum(meta["layer_counts"]))
            k, v, pos = (self._slice(f"{BLOCKS}.{part}", span) for part in ("k", "v", "pos"))
        else:
            k, v, pos = (self._tensor(f"{name}.{part}") for part in ("k", "v", "pos"))
        if tensors_sha256([k, v, pos]) != meta["sha256"]:
            raise PackError(f"{self.path} is corrupted (checksum mismatch in {name})")
        counts = meta["layer_counts"]
        time = meta.get("time")
        steps = meta.get("steps")
        return Segment(name=name, keys=split_layers(k, counts), values=split_layers(v, counts),
                       positions=split_layers(pos, counts), granularity=meta.get("granularity"),
                       steps=tuple(steps) if steps else None, time=tuple(time) if time else None)
