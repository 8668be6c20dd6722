"""A pack's block table: columns kept as tensors, one dict per block built only when that block is asked for.

Retrieval over an hour of video scores tens of thousands of blocks; building a Python dict for each on
every ask would make `ask` grow with the video. Columns (granularity labels, start times, start steps,
layer counts) answer whole-table questions at once; `table[i]` gives block i's dict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mmkv_cli.pack.format import TABLE_COLUMNS, block_name


class BlockTable(Sequence):
    """Table tensors (v3 on): rows [N, 4 + layers] int64, times [N, 2] float64 (NaN: none), digests [N, 32] uint8."""

    def __init__(
        self,
        kinds: list[str],
        rows: torch.Tensor,
        times: torch.Tensor,
        digests: torch.Tensor,
        names: list[str] | None = None,
    ):
        self.kinds = list(kinds)
        self._rows, self._times, self._digests = rows, times, digests
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
                "sha256": self._digests[index].numpy().tobytes().hex(),
            }
        return self._cache[index]

    def codes(self) -> torch.Tensor:
        """[N] each block's granularity as an index into `kinds`."""
        return self._rows[:, 0]

    def labels(self) -> list[str]:
        """Every block's granularity."""
        return [self.kinds[c] for c in self.codes().tolist()]

    def times(self) -> torch.Tensor:
        """[N, 2] time of each block's first and last frame; NaN where a block has none."""
        return self._times

    def start_times(self) -> torch.Tensor:
        """[N] time of each block's first frame; NaN where a block has none."""
        return self._times[:, 0]

    def start_steps(self) -> torch.Tensor:
        """[N] each block's first temporal step (0 where it has none)."""
        return self._rows[:, 1].clamp(min=0)

    def spans(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For blocks `indices`: offsets [n], per-layer counts [n, layers] and sha256 digests [n, 32]."""
        rows = self._rows[indices].numpy()
        return rows[:, 3], rows[:, TABLE_COLUMNS:], self._digests[indices].numpy()

    def layer_totals(self) -> torch.Tensor:
        """[N, layers] tokens each block keeps per layer."""
        return self._rows[:, TABLE_COLUMNS:]

    @classmethod
    def from_dicts(cls, blocks: list[dict]) -> BlockTable:
        """A table from per-block dicts (the v2 header's JSON list)."""
        kinds = list(dict.fromkeys(b["granularity"] for b in blocks))
        rows = torch.tensor(
            [
                [
                    kinds.index(b["granularity"]),
                    *(b["steps"] or (-1, -1)),
                    b["offset"],
                    *b["layer_counts"],
                ]
                for b in blocks
            ],
            dtype=torch.int64,
        ).reshape(len(blocks), -1)
        times = torch.tensor(
            [b["time"] or (math.nan, math.nan) for b in blocks], dtype=torch.float64
        ).reshape(len(blocks), 2)
        digests = torch.tensor(
            [list(bytes.fromhex(b["sha256"])) for b in blocks], dtype=torch.uint8
        ).reshape(len(blocks), 32)
        return cls(kinds, rows, times, digests, names=[b["name"] for b in blocks])


def eligible_before(table: BlockTable, before: float | None) -> torch.Tensor:
    """Indices of the blocks that start by `before`, in time order (a block with no time counts as 0)."""
    chosen = torch.arange(len(table))
    if before is not None:
        chosen = torch.nonzero(torch.nan_to_num(table.start_times(), nan=0.0) <= before).flatten()
    return chosen[torch.argsort(table.start_steps()[chosen], stable=True)]
