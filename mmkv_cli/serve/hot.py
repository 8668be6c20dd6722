"""Packs kept hot: a server's recently asked packs, their verified KV held in memory under a cap.

A `HotPack` is a pack's reader that keeps every span it has read and checked (the prefix, the
suffix, each block a question took): the next question joins them from memory and reads nothing
from the file. On CUDA the held spans sit in pinned host memory, so they go to the device without
a staging copy, or (`--hot-on-device`) on the device itself, costing no copy at all. `HotPacks`
holds them by path, least recently used out first when their bytes pass the cap, and never answers
from a stale copy: each use compares the path's file with the one opened (device, inode, size,
mtime_ns, ctime_ns) and reopens when a write, a cut or a rename moved any.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from mmkv_cli.core.lazy import torch
from mmkv_cli.pack import PackReader, Span, is_url, joined_spans


def file_identity(path: str | Path) -> tuple | None:
    """What changes when a file is written, cut or replaced (None: there is no file)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _version_of(path: str | Path, version: tuple | None) -> tuple | None:
    """What says a pack is the one held: its shelf's version for a URL, else the file's identity."""
    return version if version is not None or is_url(path) else file_identity(path)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _span_bytes(span: Span) -> int:
    return _bytes([*span.keys, *span.values, *span.positions])


class HotPack:
    """A PackReader whose spans, once read and verified, are kept (the members `ask` uses)."""

    def __init__(
        self, reader: PackReader, version: tuple, where: str = "host", holding: bool = True
    ):
        self.reader, self.version = reader, version
        # False: a pack larger than the whole cap is read as the plain reader reads it (rows
        # coalesced, a layer's alone for retrieval by layer), never block by whole block
        self.holding = holding
        self.where = where  # host | pinned | device: where held K/V sit
        self.device = None  # with where "device": the answering backbone's (set before a read)
        self.path, self.header = reader.path, reader.header
        self.format_version = reader.format_version
        self._held: dict[str, Span] = {}
        # the last question's context joined, by (names, per-layer names): a follow-up over the
        # same blocks (every question of a whole-context method) starts from it, no join again;
        # its K/V are the storage of the spans in it (_hold_as_views)
        self._joined: tuple[tuple, tuple[list, list, list]] | None = None
        self.held_bytes = 0
        self.reps_bytes = 0  # the retrieval keys, held by the reader once read

    @property
    def blocks(self):
        return self.reader.blocks

    @property
    def rotated_representatives(self) -> bool:
        return self.reader.rotated_representatives

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def fetched(self) -> int | None:
        return self.reader.fetched

    def representatives(self):
        reps = self.reader.representatives()  # read once and held by the reader
        if reps is not None and not self.reps_bytes:
            self.reps_bytes = reps.numel() * reps.element_size()
        return reps

    def span(self, name: str, keep: bool = True, dtype=None) -> Span:
        if not self.holding:
            return self.reader.span(name, keep, dtype)
        if dtype is None and name in self._held:
            return self._held[name]
        loaded = self.reader.span(name, keep=False, dtype=dtype)
        if dtype is None:
            loaded = self._kept(loaded)
        return loaded

    def gather(self, names, per_layer=None, device=None, dtype=None, later=None):
        """As PackReader.gather, from the held spans (a block not yet held is read and verified
        whole, then held); K/V on the host, pinned for the caller's copy, or on the device."""
        if dtype is not None or not self.holding:
            return self.reader.gather(names, per_layer, device, dtype, later)
        for name in names:
            if self.blocks.index_of(name) is None:  # as the reader says it
                return self.reader.gather(names, per_layer, device, dtype, later)
        key = (tuple(names), None if per_layer is None else tuple(map(tuple, per_layer)))
        if self._joined is None or self._joined[0] != key:
            spans = {name: self.span(name) for name in names}
            joined = joined_spans(spans, names, per_layer, pinned=self.where == "pinned")
            self._hold_as_views(joined, names, per_layer)
            self._joined = (key, joined)
        # new lists over the held tensors: the caller lets go of its layers as it copies them
        return tuple(list(part) for part in self._joined[1])

    def _hold_as_views(self, joined, names, per_layer) -> None:
        """The joined K/V become the storage of the spans in it (each span's rows a view), so a
        pack's bytes are held once; a span still viewing the previous join gets its rows copied
        out, and that join is let go whole."""
        before = self._joined
        chosen = per_layer if per_layer is not None else [names] * len(joined[0])
        for layer, taken in enumerate(chosen):
            at = 0
            for name in taken:
                span = self._held[name]
                rows = int(span.keys[layer].shape[1])
                span.keys[layer] = joined[0][layer][:, at : at + rows]
                span.values[layer] = joined[1][layer][:, at : at + rows]
                at += rows
        self.held_bytes += _bytes(joined[2])  # K/V counted as the spans'
        if before is None:
            return
        self.held_bytes -= _bytes(before[1][2])
        stale = {t.untyped_storage().data_ptr() for t in (*before[1][0], *before[1][1])}
        for span in self._held.values():
            for part in (span.keys, span.values):
                for layer, tensor in enumerate(part):
                    if tensor.untyped_storage().data_ptr() in stale:
                        part[layer] = self._own_copy(tensor)

    def _own_copy(self, tensor):
        if self.where == "pinned":
            return torch.empty_like(tensor, pin_memory=True).copy_(tensor)
        return tensor.clone()

    def _kept(self, span: Span) -> Span:
        if self.where == "pinned":
            span = replace(
                span,
                keys=[t.pin_memory() for t in span.keys],
                values=[t.pin_memory() for t in span.values],
            )
        elif self.where == "device" and self.device is not None:  # positions stay on the host
            span = replace(
                span,
                keys=[t.to(self.device) for t in span.keys],
                values=[t.to(self.device) for t in span.values],
            )
        self._held[span.name] = span
        self.held_bytes += _span_bytes(span)
        return span

    @property
    def nbytes(self) -> int:
        return self.held_bytes + self.reps_bytes

    @property
    def held_spans(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._joined = None
        self._held.clear()
        self.reader.source.close()


@dataclass
class HotEntry:
    pack: HotPack
    questions: int = 0  # asked of it since it was opened (ps)


class HotPacks:
    """Opened packs by path under a byte cap, least recently used out first; `take` gives a pack
    that is the file on disk now. Not thread-safe on its own: the server takes it on the model
    thread, and `listing` under the lock."""

    def __init__(self, cap_bytes: int, where: str = "host"):
        self.cap = max(0, int(cap_bytes))
        self.where = where
        self.packs: OrderedDict[str, HotEntry] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, path: str | Path, version: tuple | None = None) -> HotPack:
        """The pack at `path` (a URL's `version` from its shelf), opened once and kept while it
        stays the same file; opened afresh when it changed."""
        key = str(path)
        entry = self.packs.get(key)
        now = _version_of(path, version)
        if entry is not None and now is not None and entry.pack.version == now:
            with self.lock:
                self.packs.move_to_end(key)
            return entry.pack
        if entry is not None:
            self._drop(key)
        pack = self._opened(path, version)
        with self.lock:
            self.packs[key] = HotEntry(pack)
        return pack

    def _opened(self, path: str | Path, version: tuple | None) -> HotPack:
        while True:
            before = _version_of(path, version)
            reader = PackReader(path)
            after = _version_of(path, version)
            if before == after:  # not replaced while it was opened
                held = reader.size <= self.cap  # a pack over the whole cap is never held
                return HotPack(reader, after or (), self.where, held)
            reader.source.close()

    def asked(self, pack) -> None:
        """Count a question asked of `pack` (if it is still held)."""
        with self.lock:
            for entry in self.packs.values():
                if entry.pack is pack:
                    entry.questions += 1

    def trim(self, keep: HotPack | None = None) -> None:
        """Least recently used packs out until the held bytes fit the cap; `keep` (the pack just
        asked) goes last, when it alone passes the cap (its next question opens it afresh). A pack
        read without holding goes at once: nothing of it is kept."""
        with self.lock:
            for key in [k for k, e in self.packs.items() if not e.pack.holding]:
                self.packs.pop(key).pack.close()
            while self.held() > self.cap and self.packs:
                others = (k for k, e in self.packs.items() if e.pack is not keep)
                victim = next(others, next(iter(self.packs)))
                self.packs.pop(victim).pack.close()

    def held(self) -> int:
        return sum(entry.pack.nbytes for entry in self.packs.values())

    def _drop(self, key: str) -> None:
        with self.lock:
            entry = self.packs.pop(key, None)
        if entry is not None:
            entry.pack.close()

    def clear(self) -> None:
        for key in list(self.packs):
            self._drop(key)

    def listing(self) -> list[dict]:
        with self.lock:
            return [
                {
                    "path": key,
                    "bytes": entry.pack.nbytes,
                    "spans": entry.pack.held_spans,
                    "questions": entry.questions,
                    "where": entry.pack.where,
                }
                for key, entry in reversed(self.packs.items())
            ]


def default_cap() -> int:
    """A quarter of this machine's memory, at most 64 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return min(total // 4, 64 << 30)


def hot_place(device: str, on_device: bool) -> str:
    """Where a server on `device` holds hot K/V: the device itself when asked (and there is one),
    pinned host memory beside a CUDA device, else plain host memory."""
    if device == "cpu" or not torch.cuda.is_available():
        return "host"
    return "device" if on_device else "pinned"
