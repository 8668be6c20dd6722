"""Blocks' checksums, checked against the table on their own stored bytes."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Blocks this large on average are checksummed on up to HASH_THREADS threads. Small ones are not:
# hashing many small buffers on threads churns the GIL (2 cores, 1024 blocks of 17 KB: 22 -> 25 ms;
# 64 blocks of 5.6 MB, a real backbone's size: 204 -> 105 ms). A HERMES pack of a 0.5B model in
# bf16 holds ~0.8 MB blocks: at the old 1 MB bar they were hashed on one thread (0.65-0.73 GB/s on
# an H100 box's CPU); 60 blocks of 280 KB read at 0.74 GB/s serial, 1.02 on 2 threads.
PARALLEL_HASH_BLOCK_BYTES = 1 << 16
HASH_THREADS = 8


def mismatched(views: dict, where, pending: list[int], block_bytes, token_major: bool) -> list[int]:
    """The blocks at `pending` (positions in BlockRows `where`) whose sha256 over their rows of
    every block tensor in `views` differs from the table's. A large read is hashed on several
    threads (hashlib lets go of the GIL on big buffers): on a real backbone the checksums of a
    retrieved context (hundreds of MB) would otherwise cost more than reading it."""
    spans = {part: where.block_ranges(part) for part in views}

    def ranges(i: int) -> list[tuple[np.ndarray, int, int]]:
        return [(views[part][0], *spans[part][i]) for part in views]

    def digests(items):
        out = []
        for i in items:
            h = hashlib.sha256()
            for view, start, stop in ranges(i):
                h.update(block_bytes(view, start, stop))
            out.append(h.digest())
        return out

    size = sum(
        (stop - start) * (view.nbytes // max(1, view.shape[0 if token_major else 1]))
        for i in pending
        for view, start, stop in ranges(i)
    )
    big = pending and size // len(pending) >= PARALLEL_HASH_BLOCK_BYTES
    workers = min(HASH_THREADS, os.cpu_count() or 1, len(pending)) if big else 1
    # one run of consecutive blocks per thread: a task per block costs more than it hashes
    if workers > 1:
        step = -(-len(pending) // workers)
        with ThreadPoolExecutor(workers) as pool:
            runs = pool.map(digests, [pending[i : i + step] for i in range(0, len(pending), step)])
            got = [d for run in runs for d in run]
    else:
        got = digests(pending)
    return [i for i, found in zip(pending, got) if found != where.digests[i].tobytes()]
