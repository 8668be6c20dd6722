"""A pack's written bytes sent on to the disk while the rest is written. Linux holds written pages
in memory until a share of it is dirty (gigabytes on a GPU machine), so an hour's pack (4-20 GB)
went to the disk only at the fsync that ends its write, a wait of seconds after the encode was
done. Every WRITEBACK_BYTES written, the ranges written since are handed to the disk
(sync_file_range, not waited for); the fsync then finds little left (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes

from mmkv_cli.pack.io import libc

WRITEBACK_BYTES = 64 << 20
SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; do not wait


def _sync_file_range():
    """Linux's sync_file_range, or None (another system: the fsync alone writes)."""
    return libc.function(
        ("sync_file_range",),
        (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint),
        ctypes.c_int,
    )


class WriteBack:
    """Tracks what has been written to `fh` since it was last handed to the disk: a range per
    part of the file being written in order (a pack's K, V, positions...)."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.pending: dict[int, tuple[int, int]] = {}  # part -> [start, stop) not yet handed on
        self.held = 0

    def wrote(self, part: int, start: int, size: int) -> None:
        """`size` bytes were written at `start`, the next of `part`'s."""
        first, stop = self.pending.get(part, (start, start))
        if stop != start:  # not where the part's writes left off: what came before goes now
            self._hand_on([(first, stop)])
            self.held -= stop - first
            first = start
        self.pending[part] = (first, start + size)
        self.held += size
        if self.held >= WRITEBACK_BYTES:
            self._hand_on(list(self.pending.values()))
            self.pending, self.held = {}, 0

    def _hand_on(self, ranges: list[tuple[int, int]]) -> None:
        call = _sync_file_range()
        if call is None:
            return
        self.fh.flush()  # Python's buffer first: its bytes are not in the file yet
        fd = self.fh.fileno()
        for first, stop in ranges:
            # advisory: a failure here shows at the fsync, which checks every byte's write
            call(fd, first, stop - first, SYNC_FILE_RANGE_WRITE)
