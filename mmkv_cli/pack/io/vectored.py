"""Scattering reads described by a table: one row (address, length) per buffer piece, the
layout of the C library's `struct iovec`, made by numpy for all the pieces of a read at once.
A context of a per-layer eviction's pack is tens of thousands of runs of a few KB, each going to
its layer's buffer: a Python buffer object a run was a large share of such a read (figures in
docs/benchmarks.md). The table is handed to the C library's preadv as it is."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from mmkv_cli.pack.io import libc

# struct iovec: a pointer and a size_t, both the width of a pointer
IOVEC = np.uintp


def _preadv():
    """The C library's preadv (preadv64 where it has both: a 64-bit offset on every platform)."""
    found = libc.function(
        ("preadv64", "preadv"),
        (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64),
        ctypes.c_ssize_t,
    )
    if found is None:
        raise OSError(errno.ENOSYS, "this system's C library has no preadv")
    return found


def table(buffers: list[np.ndarray], owner: np.ndarray, at: np.ndarray, sizes: np.ndarray):
    """The (address, length) rows of pieces [at, at + size) of buffers[owner]: each piece checked
    to lie inside its buffer, which must be C-contiguous, writable, and kept alive by the caller
    until the reads are done."""
    for buffer in buffers:
        if not (buffer.flags.c_contiguous and buffer.flags.writeable):
            raise ValueError("internal: a read's buffer is not contiguous and writable")
    if len(owner) and (
        (at < 0).any()
        or (sizes < 0).any()
        or (at + sizes > np.asarray([b.nbytes for b in buffers], np.int64)[owner]).any()
    ):
        raise ValueError("internal: a read's piece lies outside its buffer")
    bases = np.asarray([b.ctypes.data for b in buffers], dtype=IOVEC)
    rows = np.empty((len(owner), 2), dtype=IOVEC)
    rows[:, 0] = bases[owner] + at.astype(IOVEC)
    rows[:, 1] = sizes
    return rows


def preadv(fd: int, address: int, count: int, offset: int) -> int:
    """One preadv of the file's bytes from `offset` on into the `count` pieces of the table rows
    at `address` (at most IOV_MAX): the bytes read, which may be fewer than asked (Linux's most in
    a call is 2 GiB - 4 KiB). An interrupted call is made again; any other failure is an
    OSError."""
    call = _preadv()
    while True:
        got = call(fd, address, count, offset)
        if got >= 0:
            return got
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


def read_fully(fd: int, rows: np.ndarray, offset: int, got: int = 0) -> bool:
    """The file's bytes from `offset` on into every piece of `rows`, one after another, however
    many calls that takes, the first `got` of them read already (a call cut short): False where
    the file ends first (it was cut under the reader)."""
    rows = rows[rows[:, 1] > 0].copy()  # C-contiguous, and changed below
    left = int(rows[:, 1].sum())
    while True:
        offset, left = offset + got, left - got
        if not left:
            return True
        if got:  # the pieces filled whole are dropped; one filled in part goes on where it stopped
            ends = np.cumsum(rows[:, 1])
            first = int(np.searchsorted(ends, got, side="right"))
            done = got - (int(ends[first - 1]) if first else 0)
            rows = rows[first:].copy()
            rows[0, 0] += done
            rows[0, 1] -= done
        got = preadv(fd, rows.ctypes.data, len(rows), offset)
        if got <= 0:
            return False
