"""Blocks' checksums, checked against the table on their own stored bytes."""

from __future__ import annotations

import hashlib
import operator
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import blake3
import numpy as np

from mmkv_cli.pack.integrity.finite import finite_stored
from mmkv_cli.pack.integrity.read_units import JOIN_BYTES, ReadUnits, differing, joined_digests
from mmkv_cli.pack.io.pools import KeptPool, scratch
from mmkv_cli.pack.schema.format import raw_bytes

# Digest units of at least this many bytes on average are checksummed on up to HASH_THREADS threads
# (and beside a read): below it a unit's Python costs as much as its hashing, all of it holding the
# GIL, and threads passing it to and fro ran slower than one (docs/measurements.md). A frame of a
# 7B pack is MBs; a layer of StreamingTOM's 4-bit 50-token frame, 27 KB.
PARALLEL_HASH_BLOCK_BYTES = 32 << 10
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
# A block's rows are hashed this many bytes at a time, through a buffer each thread keeps (a real
# block's K or V is a few MB at 7B; one of hundreds of frames, far more)
SCRATCH_BYTES = 8 << 20
# threads kept for hashing: a retrieval inside the forward checks a layer's blocks 28 times a
# question, and starting threads for each cost more than hashing a layer's rows
_hashing = KeptPool(HASH_THREADS, "mmkv-hash")
# a question's reads whose checksums finish while its forward runs, one after another (each on the
# hashing threads too): read before its first token is shown (LaterVerdicts)
_checking = KeptPool(1, "mmkv-check")


def new_digest(algorithm: str):
    """An empty hash of `algorithm` ("sha256" or "blake3"): update(bytes), digest(), hexdigest()."""
    return DIGESTS[algorithm]()


class BlockHashes:
    """The digests (`algorithm`) of some blocks' digest units (each a run of a block's layers, or
    the whole block) over every block tensor in `views`, compared with the table's. Runs of units
    come from one queue, so any thread that is free can `work` on them: a reader that copies rows
    while a thread hashes joins in once its copy is done (one hash stream is slower than the copy,
    and would otherwise set the pace of every large read).

    where: BlockRows; units: the units to check (BlockRows names them); block_bytes(view, start,
    stop, into): a tensor's stored bytes of rows [start, stop), flat, in checksum order (into: a
    kept buffer to read them into, token-major packs; None for the others)."""

    def __init__(
        self,
        views: dict,
        where,
        units: np.ndarray,
        block_bytes,
        token_major: bool,
        algorithm: str,
        finite: bool = False,
    ):
        self._new = DIGESTS[algorithm]
        units = np.asarray(units, dtype=np.int64)
        self._units = units.tolist()
        self._blocks = (units // where.units).tolist()  # the block each unit is of
        # each unit's stretch of every tensor (arrays for read_from), and as lists: a unit is
        # hashed without numpy calls; and a row's bytes (v2/v3, read whole: one unit a block,
        # never cut by rows)
        self._bounds = [where.unit_bounds(p, units) for p in views]
        self._parts = [
            (p, view, dtype, *(b.tolist() for b in bounds), view.row_bytes if token_major else 0)
            for (p, (view, dtype)), bounds in zip(views.items(), self._bounds)
        ]
        self._expected = where.digests.reshape(-1, 32)[units]
        # finite: each unit's values as stored are checked for NaN/Inf on the bytes hashed too
        # (verify: one read, on every thread, not a second pass after)
        self._finite = finite
        self._nonfinite: list[int] = []
        self._block_bytes = block_bytes
        self._token_major = token_major
        size = stored_bytes(views, where, units, token_major)
        self._average = size // len(units) if len(units) else 0
        per_run = max(1, RUN_BYTES // max(1, self._average))
        if len(units) == len(np.unique(units // where.units)) * where.units:  # whole blocks:
            per_run = -(-per_run // where.units) * where.units  # a run takes whole blocks
        count = len(units)
        self._runs = iter([range(i, min(count, i + per_run)) for i in range(0, count, per_run)])
        self._taking = threading.Lock()  # each run to one thread only, with or without a GIL
        self._run_count = -(-count // per_run)
        self._bad: list[int] = []
        self._stopped = False
        self._read: ReadUnits | None = None  # the buffers read, where they are given

    def read_from(
        self, kept: dict, layers: np.ndarray, rows: np.ndarray, firsts: np.ndarray
    ) -> None:
        """Hash the units from the buffers a read left (`kept`: part -> numpy buffers, one for
        every layer or one a layer), not the file: each unit is one layer's run there. layers,
        rows: each unit's layer and its run's first row in that layer's rows (BlockRows.
        rows_in_read); firsts: each layer's first row in a buffer for every layer. A retrieval's
        thousands of small units are then read once, not a second time to be hashed."""
        parts = [
            (p, dtype, *bounds, row)
            for (p, _, dtype, _, _, row), bounds in zip(self._parts, self._bounds)
        ]
        read = ReadUnits(
            parts, kept, layers, rows, firsts, self._new, self._expected, self._blocks, self._finite
        )
        runs = read.runs(max(1, RUN_BYTES // max(1, self._average)))
        self._read, self._runs, self._run_count = read, iter(runs), len(runs)

    def work(self) -> None:
        """Hash runs until none is left (or `stop` is called)."""
        while not self._stopped:
            with self._taking:
                run = next(self._runs, None)
            if run is None:
                return
            if self._read is not None:  # the units lie in the buffers read
                bad, nonfinite = self._read.check(run)
                self._bad += bad
                self._nonfinite += nonfinite
                continue
            first = run.start
            units, blocks = self._units, self._blocks
            while first < run.stop:  # a block's neighbouring units of the run: read in one piece
                stop = first + 1
                while (
                    stop < run.stop
                    and blocks[stop] == blocks[first]
                    and units[stop] == units[stop - 1] + 1
                ):
                    stop += 1
                self._check(first, stop)
                first = stop

    def _check(self, first: int, stop: int) -> None:
        """Units first..stop-1, neighbours in one block (so in every part): each part's stretch
        of them read in pieces, each unit's digest fed its rows of every piece, part after part.
        Bytes all the way, no numpy call a unit: a retrieval a layer hashes thousands of small
        units a question, and each call's cost is paid holding the GIL."""
        if self._check_joined(first, stop):
            return
        digests = [self._new() for _ in range(first, stop)]
        finite = True
        for _, view, dtype, starts, stops, row in self._parts:
            # one block's units in layer order: their rows follow one another (positions stored
            # once a block: the same rows for each)
            low, high = starts[first], stops[stop - 1]
            for at, piece in self._pieces(view, low, high, row):
                if self._finite and finite:
                    finite = finite_stored(np.frombuffer(piece, np.uint8), dtype)
                if stop - first == 1:  # one unit (v2/v3: the block whole): every byte is its
                    digests[0].update(piece)
                    continue
                end = at + len(piece) // row
                for j in range(first, stop):
                    a, b = max(starts[j], at), min(stops[j], end)
                    if a < b:
                        digests[j - first].update(piece[(a - at) * row : (b - at) * row])
        if not finite:
            self._nonfinite.append(self._blocks[first])
        for j, digest in zip(range(first, stop), digests):
            if digest.digest() != self._expected[j].tobytes():
                self._bad.append(self._blocks[j])

    def _check_joined(self, first: int, stop: int) -> bool:
        """_check where every part's stretch of the units fits the thread's kept buffer at once:
        the parts read side by side, and the units hashed evenly where they can be (_hashed_evenly:
        `verify` of StreamingTOM's pack, 28 units of four parts a frame), else each by _digest_of.
        False where that does not hold, and nothing is done."""
        parts = self._parts
        if not self._token_major or stop - first < 2:
            return False
        sizes = [(stops[stop - 1] - starts[first]) * row for _, _, _, starts, stops, row in parts]
        if sum(sizes) > SCRATCH_BYTES:
            return False
        buffer, at, read, finite = scratch(sum(sizes)), 0, [], True
        for (_, view, dtype, starts, stops, _), size in zip(parts, sizes):
            read.append(self._block_bytes(view, starts[first], stops[stop - 1], buffer[at:]))
            if self._finite and finite:
                finite = finite_stored(np.frombuffer(read[-1], np.uint8), dtype)
            at += size
        if not finite:
            self._nonfinite.append(self._blocks[first])
        if self._hashed_evenly(first, stop, read):
            return True
        for j in range(first, stop):
            pieces = [
                region[(starts[j] - starts[first]) * row : (stops[j] - starts[first]) * row]
                for region, (_, _, _, starts, stops, row) in zip(read, parts)
            ]
            if self._digest_of(pieces) != self._expected[j].tobytes():
                self._bad.append(self._blocks[j])
        return True

    def _hashed_evenly(self, first: int, stop: int, read: list) -> bool:
        """Units first..stop-1 hashed from `read` (each part's stretch of them, as _check_joined
        read it) where each part holds them in even, consecutive runs, or in one run they all
        share (a block's positions), and a unit is small (JOIN_BYTES): every part laid beside the
        others for all the units by one numpy copy a part, then one update a unit, no Python a
        piece (read_units.joined_digests). False where that does not hold, and nothing is done."""
        count, widths = stop - first, []
        for _, _, _, starts, stops, row in self._parts:
            heads, ends = starts[first:stop], stops[first:stop]
            lengths = set(map(operator.sub, ends, heads))
            shared = heads.count(heads[0]) == count and ends.count(ends[0]) == count
            if len(lengths) != 1 or not (shared or heads[1:] == ends[:-1]):
                return False
            widths.append(lengths.pop() * row)
        if sum(widths) > JOIN_BYTES:
            return False
        parts = [np.frombuffer(r, np.uint8).reshape(-1, w) for r, w in zip(read, widths)]
        got = joined_digests(parts, self._new)  # a shared part is one row, for every unit
        self._bad += [self._blocks[first + i] for i in differing(got, self._expected[first:stop])]
        return True

    def _digest_of(self, pieces: list[memoryview]) -> bytes:
        """The digest of `pieces` one after another: joined in this thread's kept buffer and
        hashed in one update when they are small (JOIN_BYTES), one update a piece otherwise."""
        digest, size = self._new(), sum(map(len, pieces))
        if size > JOIN_BYTES:
            for piece in pieces:
                digest.update(piece)
            return digest.digest()
        joined, end = scratch(size, "join"), 0
        for piece in pieces:
            joined[end : end + len(piece)] = piece
            end += len(piece)
        digest.update(joined[:size])
        return digest.digest()

    def _pieces(self, view, low: int, high: int, row: int):
        """(first row, their bytes) of rows [low, high) of a block tensor, read SCRATCH_BYTES at a
        time into this thread's kept buffer: a fresh buffer for every read paid its page faults,
        about as much again as the read (a head-major pack's block whole: its rows lie apart in
        every head)."""
        if not self._token_major:
            yield low, self._block_bytes(view, low, high, None)
            return
        step = max(1, SCRATCH_BYTES // max(1, row))
        if high - low <= step:  # the usual case: one piece
            yield low, self._block_bytes(view, low, high, scratch((high - low) * row))
            return
        buffer = scratch(step * row)
        for at in range(low, high, step):
            yield at, self._block_bytes(view, at, min(high, at + step), buffer)

    def stop(self) -> None:
        """Hash no more runs: what they were for failed."""
        self._stopped = True

    def let_go(self) -> None:
        """Drop the buffers `read_from` was given, once every run is hashed (the verdicts stay): a
        question's layer read bound for a GPU is pinned memory, which the next layer's read can
        take again only once nothing holds it."""
        self._read = None

    def threads(self) -> int:
        """How many threads to hash on: one for units under PARALLEL_HASH_BLOCK_BYTES."""
        if self._average < PARALLEL_HASH_BLOCK_BYTES:
            return 1
        return max(1, min(HASH_THREADS, os.cpu_count() or 1, self._run_count))

    def mismatched(self) -> list[int]:
        """The blocks with a digest that differs (positions in `where`), once every run is
        hashed."""
        return sorted(set(self._bad))

    def nonfinite(self) -> list[int]:
        """With `finite`: the blocks holding NaN or Inf as stored, once every run is hashed."""
        return sorted(set(self._nonfinite))


def stored_bytes(views: dict, where, units, token_major: bool) -> int:
    """Bytes the digest units `units` of `where` hold in every block tensor of `views`."""
    total = 0
    for part, (view, _) in views.items():
        row = view.nbytes // max(1, view.shape[0 if token_major else 1])
        starts, stops = where.unit_bounds(part, units)
        total += row * int((stops - starts).sum())
    return total


def mismatched(hashes: BlockHashes) -> list[int]:
    """The blocks `hashes` covers with a digest that differs from the table's. A read of large
    blocks is hashed on several threads (both hashes let go of the GIL on big buffers): on a real
    backbone the checksums of a retrieved context (hundreds of MB) would otherwise cost more than
    reading it."""
    if hashes.threads() > 1:
        hashed_beside(hashes, lambda: None)  # this thread hashes with the pool's
    else:
        hashes.work()
    return hashes.mismatched()


def mismatched_later(hashes: BlockHashes) -> Future:
    """`mismatched(hashes)` on a thread of its own (with the hashing threads), not waited for: its
    result, or the error a read of the file raised while hashing, comes with `.result()`. The
    buffers hashed are let go as soon as they are, not when the result is read."""

    def check() -> list[int]:
        try:
            return mismatched(hashes)
        finally:
            hashes.let_go()

    return _checking.get().submit(check)


def beside_hashing(work: Callable[[], T]) -> Future:
    """work() on one of the hashing threads, not waited for: a check that reads the file while
    this thread hashes (numpy's checks, like the reads and the hashes, run mostly without the
    GIL)."""
    return _hashing.get().submit(work)


def hashed_beside(hashes: BlockHashes, read: Callable[[], T]) -> T:
    """read() on this thread while pool threads compute `hashes`; once it returns, this thread
    hashes what is left with them. Every hash is done when this returns (or read's error is
    raised, after the others stop). A pool thread that starts late finds no run left."""
    workers = max(1, hashes.threads() - 1)  # this thread makes one more once its read is done
    helping = [_hashing.get().submit(hashes.work) for _ in range(workers)]
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
    return list(_hashing.get().map(one, pieces))


def digest_of(pieces, algorithm: str) -> str:
    """The hex digest (`algorithm`) of `pieces` (buffers of any shape) one after another."""
    digest = new_digest(algorithm)
    for piece in pieces:
        digest.update(raw_view(piece))
    return digest.hexdigest()


def tensors_digest(tensors: list, algorithm: str) -> str:
    """The hex digest of `tensors`' stored bytes one after another."""
    return digest_of([raw_bytes(t) for t in tensors], algorithm)
