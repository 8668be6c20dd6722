"""A safetensors file opened once: its directory checked, each tensor's bytes read with pread
through the descriptor opened (never the path, never a memory map). A pack replaced under the
reader leaves it reading the file it opened; one rewritten in place (`cp` over it) makes a read come
up short or the file's status change, one clear error, where a mapped page past the new end of the
file would kill the process (SIGBUS)."""

from __future__ import annotations

import math
import os

import numpy as np

from mmkv_cli.core.errors import PackError, unreadable
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.integrity.checks import read_directory
from mmkv_cli.pack.io import vectored
from mmkv_cli.pack.io.pools import KeptPool
from mmkv_cli.pack.io.source import PackFile

# buffers one preadv fills at most (Linux's IOV_MAX)
IOV_MAX = 1024
# A read of at least PARALLEL_READ_BYTES is cut into preads of about READ_BYTES, run on
# READ_THREADS threads: a quarter of the cores, at most 4 (the blocks' hashes run on threads of
# their own beside it), so one on a 2-core machine
READ_BYTES = 8 << 20
PARALLEL_READ_BYTES = 32 << 20
READ_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
_reading = KeptPool(READ_THREADS, "mmkv-read")


# safetensors dtype -> the numpy dtype its bytes are read as, and the torch dtype they are viewed as
# after
_DTYPES = {
    "F64": (np.float64, "float64"),
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "I64": (np.int64, "int64"),
    "I32": (np.int32, "int32"),
    "U8": (np.uint8, "uint8"),
}


class FileArray:
    """A stored tensor [rows, ...] read row ranges at a time by pread: indexed like the numpy
    array it would be (a slice of rows, take(rows)), nothing read until then."""

    def __init__(self, stored: StoredTensors, start: int, dtype: np.dtype, shape: list[int]):
        self._stored, self._start = stored, start
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.nbytes = self.itemsize * math.prod(self.shape)
        self.row_bytes = self.itemsize * math.prod(self.shape[1:])

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def read(self) -> np.ndarray:
        """The whole tensor."""
        return self[0 : len(self)] if self.shape else self._into(np.empty((), self.dtype), [(0, 1)])

    def __getitem__(self, rows: slice) -> np.ndarray:
        first, stop, step = rows.indices(len(self))
        if step != 1:
            raise IndexError("a stored tensor is read by contiguous rows")
        count = max(0, stop - first)
        return self._into(np.empty((count, *self.shape[1:]), self.dtype), [(first, stop)])

    def bytes_into(self, first: int, stop: int, into: memoryview) -> memoryview:
        """Rows [first, stop) read into the start of `into` (flat bytes, a kept buffer's): that
        stretch of it. No numpy on the way: a hash of small blocks reads thousands of these."""
        out = into[: (stop - first) * self.row_bytes]
        self._stored.read_into(out, self._start + first * self.row_bytes)
        return out

    def take(self, rows: np.ndarray, axis: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `rows` (int array): runs of consecutive rows that lie next to each other in the
        file are read by one scattering preadv, whatever their order in `rows` (a context's
        layer-major order visits each block once per layer). out: the array to read them into
        (C-contiguous, of their shape and dtype; pinned memory bound for a GPU, say)."""
        if axis != 0:
            raise IndexError("a stored tensor is read by rows")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if out is None:
            out = np.empty((rows.size, *self.shape[1:]), self.dtype)
        self.take_each([rows], [out])
        return out

    def take_each(self, rows: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """Rows rows[i] into outs[i], for every i in one pass through the file: the runs of all of
        them in file order, those next to each other read by scattering preadvs of about
        READ_BYTES into whichever buffers they go to. Each layer of a context into a buffer of its
        own costs no more reads than one buffer: a block's layers lie together in the file, a
        layer's runs apart."""
        sizes_each = []
        for wanted, out in zip(rows, outs):
            shape = (np.size(wanted), *self.shape[1:])
            if out.shape != shape or out.dtype != self.dtype or not out.flags.c_contiguous:
                raise ValueError(f"internal: {shape} rows of {self.dtype} read into {out.shape}")
            sizes_each.append(shape[0])
        wanted = np.concatenate([np.asarray(w, dtype=np.int64).reshape(-1) for w in rows])
        if not wanted.size:
            return
        if wanted.min() < 0 or wanted.max() >= len(self):
            raise IndexError("row out of range")
        # every buffer's runs at once: a run starts where a row does not follow the one before,
        # or a new buffer begins (a layer's context of a few blocks costs no Python loop a layer)
        owners = np.repeat(np.arange(len(rows)), sizes_each)
        opens = np.cumsum(sizes_each) - sizes_each  # each buffer's first row in `wanted`
        starts = np.flatnonzero(
            (np.diff(wanted, prepend=-2) != 1) | (np.diff(owners, prepend=-1) != 0)
        )
        firsts, owner = wanted[starts], owners[starts]
        lengths = np.diff(np.append(starts, wanted.size))
        puts = (starts - opens[owner]) * self.row_bytes
        order = np.argsort(firsts, kind="stable")
        firsts, lengths, puts, owner = firsts[order], lengths[order], puts[order], owner[order]
        sizes = lengths * self.row_bytes
        pieces = vectored.table(outs, owner, puts, sizes)  # no Python object a run
        # a stretch of the file begins where a run does not go on from the one before; within
        # one, a read begins where a run starts a new READ_BYTES window of it, or the read holds
        # IOV_MAX buffers (one preadv's most)
        count = len(firsts)
        stretch = np.append(True, np.diff(firsts) != lengths[:-1])
        ahead = np.cumsum(sizes) - sizes  # bytes of all runs before each
        before = ahead - ahead[stretch][np.cumsum(stretch) - 1]  # ... of its stretch only
        window = before // READ_BYTES
        new = stretch | np.append(True, np.diff(window) != 0)
        at = np.arange(count)
        opened = np.maximum.accumulate(np.where(new, at, 0))  # where each one's read began
        cuts = np.flatnonzero((at - opened) % IOV_MAX == 0)
        offsets = self._start + firsts[cuts] * self.row_bytes
        # each read (file offset, its pieces' rows [first, stop) of the table, bytes) in plain
        # ints: a retrieval's scattered runs are a read each, 14,000 a tensor
        reads = list(
            zip(
                offsets.tolist(),
                cuts.tolist(),
                [*cuts[1:].tolist(), count],
                np.add.reduceat(sizes, cuts).tolist(),
            )
        )
        # handed to the reading threads in tasks of about READ_BYTES: a task a read of a few KB
        # (a retrieval's runs, scattered) cost the pool more than the read
        task = ahead[cuts] // READ_BYTES
        firsts_of = [*np.flatnonzero(np.append(True, np.diff(task) != 0)).tolist(), len(reads)]
        tasks = [reads[a:b] for a, b in zip(firsts_of, firsts_of[1:])]
        self._stored.read_many(pieces, tasks, int(sizes.sum()))

    def _into(self, out: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
        """Row ranges `runs` read one after another into `out`."""
        flat = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        at = 0
        for first, stop in runs:
            size = (stop - first) * self.row_bytes
            self._stored.read_into(flat[at : at + size], self._start + first * self.row_bytes)
            at += size
        return out


class StoredTensors:
    """The tensors of an open pack file, by name."""

    def __init__(self, source: PackFile, path):
        self.source, self.path = source, path
        self._file = source.file
        self.size = source.size  # as opened: a file that changes size under a read is refused
        raw, self.data_start = read_directory(self._file, path, source.ensure)
        self.metadata = raw.get("__metadata__")
        self.entries = {k: v for k, v in raw.items() if k != "__metadata__"}
        self._views: dict[str, tuple[FileArray, str]] = {}  # name -> (view, torch dtype name)
        self.small: dict[str, np.ndarray] = {}  # small tensors' bytes read (and digested) on open
        self.bytes_read = 0

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s stored bytes, read whole."""
        start, stop = (self.data_start + o for o in self.entries[name]["data_offsets"])
        self.source.ensure([(start, stop)])
        out = np.empty(stop - start, dtype=np.uint8)
        self.read_into(memoryview(out), start)
        self.bytes_read += out.nbytes
        return out

    def stored_bytes(self, names: list[str]) -> int:
        """Bytes the tensors `names` take in the file (0 for those it does not hold)."""
        spans = [self.entries[n]["data_offsets"] for n in names if n in self.entries]
        return sum(stop - start for start, stop in spans)

    def still_whole(self) -> None:
        """The file is the one opened, as it was: a pack rewritten in place (even to the same size
        and mtime) is one clear error, before and after each read, never bytes of two files."""
        if not self.source.unchanged():
            raise PackError(f"{self.path} changed while it was being read")

    def read_many(self, pieces: np.ndarray, tasks: list[list[tuple]], total: int) -> None:
        """Each task's reads (file offset, first and stop row of `pieces`, a `vectored.table`,
        bytes), `total` bytes in all; the tasks on READ_THREADS threads when they are many and
        large (a pread lets go of the GIL, and one thread copies from the page cache at a
        fraction of what the memory does)."""
        if READ_THREADS > 1 and len(tasks) > 1 and total >= PARALLEL_READ_BYTES:
            list(_reading.get().map(self._read_each, [pieces] * len(tasks), tasks))
            return
        for reads in tasks:
            self._read_each(pieces, reads)

    def _read_each(self, pieces: np.ndarray, reads: list[tuple]) -> None:
        fd, table, row = self._file.fileno(), pieces.ctypes.data, pieces.strides[0]
        for offset, first, stop, size in reads:
            try:
                got = vectored.preadv(fd, table + first * row, stop - first, offset)
                if got == size:
                    continue
                # cut short (Linux's most a call, or the file cut under the reader): the rest
                whole = got > 0 and vectored.read_fully(fd, pieces[first:stop], offset, got)
            except OSError as err:  # EIO: a failing disk or mount
                raise unreadable(self.path, err) from None
            if not whole:
                raise PackError(f"{self.path} changed while it was being read")

    def read_into(self, into: memoryview, offset: int) -> None:
        """The file's bytes from `offset` on, into the buffer `into`: a short read means the
        file was cut under the reader."""
        fd = self._file.fileno()
        while len(into):
            try:
                got = os.preadv(fd, [into], offset)
            except OSError as err:
                raise unreadable(self.path, err) from None
            if got <= 0:
                raise PackError(f"{self.path} changed while it was being read")
            offset, into = offset + got, into[got:]

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` read whole into memory, as numpy (no torch needed)."""
        if name in self.small:  # read (and digested) on open
            entry = self.entries[name]
            np_dtype = _DTYPES[entry["dtype"]][0]
            return self.small.pop(name).view(np_dtype).reshape(entry["shape"])
        view, _ = self.view(name)
        self.source.ensure([self.tensor_range(name)])
        out = view.read()
        self.bytes_read += out.nbytes
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` read whole into memory, as torch."""
        _, dtype = self.view(name)
        return torch.from_numpy(self.array(name)).view(getattr(torch, dtype))

    def view(self, name: str) -> tuple[FileArray, str]:
        """Tensor `name` as a shaped FileArray (nothing read until it is indexed), and the torch
        dtype its bytes are viewed as."""
        if name not in self._views:
            entry = self.entries.get(name)
            if entry is None or entry.get("dtype") not in _DTYPES:
                raise PackError(
                    f"{self.path} is corrupted: tensor {name} missing or of an unknown type"
                )
            start = self.data_start + entry["data_offsets"][0]
            np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
            self._views[name] = (FileArray(self, start, np_dtype, entry["shape"]), torch_dtype)
        return self._views[name]

    def tensor_range(self, name: str) -> tuple[int, int]:
        """Tensor `name`'s absolute byte range in the file."""
        start, stop = self.entries[name]["data_offsets"]
        return self.data_start + start, self.data_start + stop
