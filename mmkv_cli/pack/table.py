"""A pack's block table: columns kept as tensors, one dict per block built only when that block is
asked for.

Retrieval over an hour of video scores tens of thousands of blocks; building a Python dict for each
on every ask would make `ask` grow with the video. Columns (granularity labels, start times, start
steps, layer counts) answer whole-table questions at once; `table[i]` gives block i's dict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mmkv_cli.pack.format import TABLE_COLUMNS, block_name


class BlockTable(Sequence):
    """Table arrays (v3 on): rows [N, 4 + layers] int64, times [N, 2] float64 (NaN: none), digests
    [N, 32] uint8. Numpy, so that `inspect` reads a pack without importing torch."""

    def __init__(
        self,
        kinds: list[str],
        rows: np.ndarray,
        times: np.ndarray,
        digests: np.ndarray,
        names: list[str] | None = None,
    ):
        self.kinds = list(kinds)
        self._rows, self._times, self._digests = (np.asarray(a) for a in (rows, times, digests))
        self._names = names  # v2 packs named blocks freely; later ones name them b<row>
        self._cache: dict[int, dict] = {}

    def name(self, index: int) -> str:
        return self._names[index] if self._names is not None else block_name(index)

    def index_of(self, name: str) -> int | None:
        if self._names is not None:
            return self._names.index(name) if name in self._names else None
        index = int(name[1:]) if name.startswith("b") and name[1:].isdigit() else None
        return index if index is not None and index < len(self) else None

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index not in self._cache:
            row = self._rows[index].tolist()
            time = self._times[index].tolist()
            self._cache[index] = {
                "index": index,
                "name": self.name(index),
                "granularity": self.kinds[row[0]],
                "steps": row[1:3] if row[1] >= 0 else None,
                "time": None if math.isnan(time[0]) else time,
                "offset": row[3],
                "layer_counts": row[TABLE_COLUMNS:],
                "sha256": self._digests[index].tobytes().hex(),
            }
        return self._cache[index]

    def codes(self) -> np.ndarray:
        """[N] each block's granularity as an index into `kinds`."""
        return self._rows[:, 0]

    def times(self) -> np.ndarray:
        """[N, 2] time of each block's first and last frame; NaN where a block has none."""
        return self._times

    def start_times(self) -> np.ndarray:
        """[N] time of each block's first frame; NaN where a block has none."""
        return self._times[:, 0]

    def start_steps(self) -> np.ndarray:
        """[N] each block's first temporal step (0 where it has none)."""
        return np.maximum(self._rows[:, 1], 0)

    def spans(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For blocks `indices`: offsets [n], per-layer counts [n, layers] and sha256 digests [n,
        32]."""
        rows = self._rows[indices]
        return rows[:, 3], rows[:, TABLE_COLUMNS:], self._digests[indices]

    def layer_totals(self) -> np.ndarray:
        """[N, layers] tokens each block keeps per layer."""
        return self._rows[:, TABLE_COLUMNS:]

    @classmethod
    def from_dicts(cls, blocks: list[dict]) -> BlockTable:
        """A table from per-block dicts (the v2 header's JSON list)."""
        kinds = list(dict.fromkeys(b["granularity"] for b in blocks))
        rows = [
            [
                kinds.index(b["granularity"]),
                *(b["steps"] or (-1, -1)),
                b["offset"],
                *b["layer_counts"],
            ]
            for b in blocks
        ]
        times = [b["time"] or (math.nan, math.nan) for b in blocks]
        digests = [list(bytes.fromhex(b["sha256"])) for b in blocks]
        return cls(
            kinds,
            np.asarray(rows, dtype=np.int64).reshape(len(blocks), -1),
            np.asarray(times, dtype=np.float64).reshape(len(blocks), 2),
            np.asarray(digests, dtype=np.uint8).reshape(len(blocks), 32),
            names=[b["name"] for b in blocks],
        )


def eligible_at(table: BlockTable, at: float | None) -> np.ndarray:
    """Indices of the blocks that start by the moment `at`, in time order (a block with no time
    counts as 0); every block when `at` is None."""
    chosen = np.arange(len(table))
    if at is not None:
        chosen = np.flatnonzero(np.nan_to_num(table.start_times(), nan=0.0) <= at)
    return chosen[np.argsort(table.start_steps()[chosen], kind="stable")]
