"""Thread pools made on first use and kept for the process: starting threads for every read cost
more than a layer's read at 7B. A forked child has none of the parent's threads: it makes its
own. And each thread's kept buffers: a fresh buffer for every read paid a page fault for every
4 KiB it was given, about as much again as the read."""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_kept: weakref.WeakSet[KeptPool] = weakref.WeakSet()
_scratch = threading.local()


class KeptPool:
    """`workers` threads named `name`-N, started on the first `get()`."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._pool: ThreadPoolExecutor | None = None
        self._made = threading.Lock()
        _kept.add(self)

    def get(self) -> ThreadPoolExecutor:
        with self._made:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool

    def _forget(self) -> None:
        self._pool, self._made = None, threading.Lock()


def _forget_all() -> None:
    for pool in list(_kept):
        pool._forget()


def scratch(nbytes: int, use: str = "read") -> memoryview:
    """This thread's kept buffer for `use` ("read": bytes read to be hashed; "join": a unit's
    parts joined), of at least `nbytes` (grown when asked for more), as flat bytes: they are the
    caller's until this thread asks again for the same use."""
    held = getattr(_scratch, use, None)
    if held is None or len(held) < nbytes:
        held = memoryview(np.empty(nbytes, np.uint8))
        setattr(_scratch, use, held)
    return held


os.register_at_fork(after_in_child=_forget_all)
