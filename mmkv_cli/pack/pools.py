"""Thread pools made on first use and kept for the process: starting threads for every read cost
more than a layer's read at 7B. A forked child has none of the parent's threads: it makes its
own."""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

_kept: weakref.WeakSet[KeptPool] = weakref.WeakSet()


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


os.register_at_fork(after_in_child=_forget_all)
