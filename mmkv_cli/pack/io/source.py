"""Where a pack's bytes come from: a local file, or an object read by ranges (storage.RemoteFile).
The reader reads both through one descriptor and asks for the ranges it is about to read first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Protocol

from mmkv_cli.core.errors import PackError, unreadable
from mmkv_cli.pack.io.storage import RemoteFile, is_url, local_path


class PackFile(Protocol):
    file: IO[bytes]  # read by os.pread / os.preadv of its descriptor, never mapped
    size: int  # bytes, when opened
    local: bool  # a file on this machine (False: an object read by ranges)
    fetched: int | None  # bytes brought over the network (None: a local file)

    def ensure(self, ranges: list[tuple[int, int]]) -> None:
        """Make the absolute byte ranges `ranges` readable through `file`."""

    def unchanged(self) -> bool:
        """The bytes under `file` are still those opened (no one else rewrote them)."""

    def close(self) -> None: ...


class LocalFile:
    def __init__(self, path: Path):
        try:
            if not path.is_file():
                there = path.exists()  # a folder, a FIFO, a device: not a pack's bytes
                raise PackError(f"{path} is not a file" if there else f"no such pack: {path}")
            self.file = open(path, "rb")  # noqa: SIM115 (held for the reader's life)
            stat = os.fstat(self.file.fileno())
        except OSError as err:  # a link loop, a name too long, a folder we may not enter
            raise unreadable(path, err) from None
        self.size = stat.st_size
        self._opened = (stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)
        self.local = True
        self.fetched = None

    def ensure(self, ranges: list[tuple[int, int]]) -> None:
        return None  # every byte is already here

    def unchanged(self) -> bool:
        # ctime too: any write moves it, and no one can set it back as `cp -p` or `touch` can
        # mtime. An unlinked file (replaced by a rename, as mmkv writes) moves only its ctime and
        # keeps its bytes.
        now = os.fstat(self.file.fileno())
        if (now.st_size, now.st_mtime_ns, now.st_ino) != self._opened[:3]:
            return False
        return now.st_ctime_ns == self._opened[3] or now.st_nlink == 0

    def close(self) -> None:
        self.file.close()


def open_pack_file(target: str | Path) -> tuple[PackFile, str | Path]:
    """(the pack's bytes, the name errors call it by)."""
    if is_url(target):
        return RemoteFile(str(target)), str(target)
    path = local_path(target)
    return LocalFile(path), path


def block_byte_ranges(entries: dict, data_start: int, where, token_major: bool, units) -> list:
    """The absolute byte ranges of the digest units `units` of blocks (BlockRows `where`: a
    block's or, v12, some of its layers' rows) in the block tensors `entries` (name -> directory
    entry, named blocks.PART): a retrieval by layer fetches the layers it reads. Head-major packs
    (v2/v3) keep a block's rows apart in every head: their tensors are taken whole."""
    ranges = []
    for name, entry in entries.items():
        start, stop = (data_start + o for o in entry["data_offsets"])
        rows = entry["shape"][0] if entry["shape"] else 0
        if not token_major or not rows:
            ranges.append((start, stop))
            continue
        row = (stop - start) // rows
        part = name.rsplit(".", 1)[1]
        firsts, stops = where.unit_bounds(part, units)
        ranges += [
            (start + a * row, start + b * row) for a, b in zip(firsts.tolist(), stops.tolist())
        ]
    return ranges
