"""Blocks' checksums, checked against the table on their own stored bytes."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import blake3

from mmkv_cli.pack.finite import finite_stored

# Blocks of at least this many bytes on average are checksummed on up to HASH_THREADS threads:
# from here up, threads fed runs of blocks beat one (docs/measurements.md); a real backbone's blocks
# are MBs.
PARALLEL_HASH_BLOCK_BYTES = 1 << 13
HASH_THREADS = 8
# Blocks are handed out in runs of about this many bytes: a task per small block costs more than it
# hashes, and a run much larger leaves one thread hashing alone at the end
RUN_BYTES = 1 << 20
T = TypeVar("T")
# Bytes of the representatives each digest covers (v8), so that they are hashed on every core: an
# hour's per-layer retrieval index at 7B is tens of MB, checked on every fresh ask
REPS_CHUNK = 4 << 20
# The hashes a pack's checksums are made with, by name (format.digest_name says which a version
# uses): BLAKE3 hashes at about 2.5x sha256's rate a core, which sets the pace of every fresh read
DIGESTS = {"sha256": hashlib.sha256, "blake3": blake3.blake3}


def new_digest(algorithm: str):
    """An empty hash of `algorithm` ("sha256" or "blake3"): update(bytes), digest(), hexdigest()."""
    return DIGESTS[algorithm]()


class BlockHashes:
    """The digest (`algorithm`) of some blocks' rows of every block tensor in `views`, compared
    with the table's. Runs of blocks come from one queue, so any thread that is free can `work` on
    them: a reader that copies rows while a thread hashes joins in once its copy is done (one hash
    stream is slower than the copy, and would otherwise set the pace of every large read).

    where: BlockRows; pending: the blocks to check (positions in `where`); block_bytes(view, start,
    stop): a block's stored bytes of a tensor, in checksum order."""

    def __init__(
        self,
        views: dict,
        where,
        pending: list[int],
        block_bytes,
        token_major: bool,
        algorithm: str,
        finite: bool = False,
    ):
        self._new = DIGESTS[algorithm]
        spans = {part: where.block_ranges(part) for part in views}
        # each block's stretch of every tensor: (view, start, stop, the dtype its bytes mean)
        self._ranges = {
            i: [(views[p][0], *spans[p][i], views[p][1]) for p in views] for i in pending
        }
        # finite: each block's values as stored are checked for NaN/Inf on the bytes hashed too
        # (verify: one read, on every thread, not a second pass after)
        self._finite = finite
        self._nonfinite: list[int] = []
        self._where, self._block_bytes = where, block_bytes
        size = stored_bytes(views, where, pending, token_major)
        self._average = size // len(pending) if pending else 0
        per_run = max(1, RUN_BYTES // max(1, self._average))
        self._runs = iter([pending[i : i + per_run] for i in range(0, len(pending), per_run)])
        self._taking = threading.Lock()  # each run to one thread only, with or without a GIL
        self._run_count = -(-len(pending) // per_run)
        self._bad: list[int] = []
        self._stopped = False

    def work(self) -> None:
        """Hash runs until none is left (or `stop` is called)."""
        while not self._stopped:
            with self._taking:
                run = next(self._runs, None)
            if run is None:
                return
            for i in run:
                digest, finite = self._new(), True
                for view, start, stop, dtype in self._ranges[i]:
                    stored = self._block_bytes(view, start, stop)
                    digest.update(raw_view(stored))
                    finite = finite and (not self._finite or finite_stored(stored, dtype))
                if digest.digest() != self._where.digests[i].tobytes():
                    self._bad.append(i)
                if not finite:
                    self._nonfinite.append(i)

    def stop(self) -> None:
        """Hash no more runs: what they were for failed."""
        self._stopped = True

    def threads(self) -> int:
        """How many threads to hash on: one for blocks under PARALLEL_HASH_BLOCK_BYTES."""
        if self._average < PARALLEL_HASH_BLOCK_BYTES:
            return 1
        return max(1, min(HASH_THREADS, os.cpu_count() or 1, self._run_count))

    def mismatched(self) -> list[int]:
        """The blocks whose checksum differs (positions in `where`), once every run is hashed."""
        return sorted(self._bad)

    def nonfinite(self) -> list[int]:
        """With `finite`: the blocks holding NaN or Inf as stored, once every run is hashed."""
        return sorted(self._nonfinite)


def stored_bytes(views: dict, where, chosen, token_major: bool) -> int:
    """Bytes the blocks at `chosen` (positions in `where`) hold in every block tensor of `views`."""
    total = 0
    for part, (view, _) in views.items():
        row = view.nbytes // max(1, view.shape[0 if token_major else 1])
        starts, stops = where.block_bounds(part)
        total += row * int((stops[chosen] - starts[chosen]).sum())
    return total


def mismatched(hashes: BlockHashes) -> list[int]:
    """The blocks `hashes` covers whose digest differs from the table's. A read of large blocks is
    hashed on several threads (both hashes let go of the GIL on big buffers): on a real backbone the
    checksums of a retrieved context (hundreds of MB) would otherwise cost more than reading it."""
    workers = hashes.threads()
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            for done in [pool.submit(hashes.work) for _ in range(workers)]:
                done.result()
    else:
        hashes.work()
    return hashes.mismatched()


def hashed_beside(hashes: BlockHashes, read: Callable[[], T]) -> T:
    """read() on this thread while other threads compute `hashes`; once it returns, this thread
    hashes what is left with them. Every hash is done when this returns (or read's error is
    raised, after the others stop)."""
    workers = max(1, hashes.threads() - 1)  # this thread makes one more once its read is done
    with ThreadPoolExecutor(workers) as pool:
        helping = [pool.submit(hashes.work) for _ in range(workers)]
        try:
            out = read()
            hashes.work()
        except BaseException:
            hashes.stop()
            raise
        finally:
            for done in helping:
                done.result()
    return out


def raw_view(data) -> memoryview:
    """A C-contiguous buffer (bytes, memoryview, numpy array of any shape and dtype) as its flat
    bytes, without a copy: slicing it cuts bytes, never rows."""
    view = memoryview(data)
    if view.nbytes == 0:  # an empty shape cannot be cast
        return memoryview(b"")
    if view.ndim == 1 and view.format in ("B", "b", "c"):
        return view
    return view.cast("B")


def chunk_count(nbytes: int, chunk: int) -> int:
    """How many digests `chunk_digests` makes of `nbytes` bytes (one for none)."""
    return max(1, -(-nbytes // chunk))


def chunk_digests(data, chunk: int, algorithm: str) -> list[str]:
    """The digest (`algorithm`) of each `chunk` bytes of `data`'s raw bytes (one digest when
    empty), hashed on up to HASH_THREADS threads. The one place writer, reader, verify and the
    tests' forgeries cut chunks: a shaped array is cut by its bytes, as it was written."""
    flat = raw_view(data)
    pieces = [flat[i : i + chunk] for i in range(0, chunk_count(len(flat), chunk) * chunk, chunk)]
    workers = min(HASH_THREADS, os.cpu_count() or 1, len(pieces))

    def one(piece) -> str:
        digest = new_digest(algorithm)
        digest.update(piece)
        return digest.hexdigest()

    if workers < 2:
        return [one(piece) for piece in pieces]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, pieces))


def digest_of(pieces, algorithm: str) -> str:
    """The hex digest (`algorithm`) of `pieces` (buffers of any shape) one after another."""
    digest = new_digest(algorithm)
    for piece in pieces:
        digest.update(raw_view(piece))
    return digest.hexdigest()
