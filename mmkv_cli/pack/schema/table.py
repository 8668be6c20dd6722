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

from mmkv_cli.pack.schema.format import OLD_TABLE_COLUMNS, TABLE_COLUMNS, block_name


class BlockTable(Sequence):
    """Table arrays (v3 on): rows [N, columns + layers] int64 (columns: 7 from v7, 4 before),
    times [N, 2] float64 (NaN: none), digests [N, digests, 32] uint8 (a block's checksum, one
    digest per run of its layers; [N, 32] before v12: one). Numpy, so that `inspect` reads a pack
    without importing torch."""

    def __init__(
        self,
        kinds: list[str],
        rows: np.ndarray,
        times: np.ndarray,
        digests: np.ndarray,
        names: list[str] | None = None,
        columns: int = TABLE_COLUMNS,
    ):
        self.kinds = list(kinds)
        self.columns = columns
        self._rows, self._times, self._digests = (np.asarray(a) for a in (rows, times, digests))
        if self._digests.ndim == 2:  # one digest a block (v2-v11)
            self._digests = self._digests[:, None, :]
        self._names = names  # v2 packs named blocks freely; later ones name them b<row>
        self._cache: dict[int, dict] = {}
        self._runs_of: tuple | None = None  # layer_runs(), for the group it was asked for

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
                "layer_counts": row[self.columns :],
                "digest": self._digests[index].tobytes().hex(),
            }
        return self._cache[index]

    def rows(self) -> np.ndarray:
        """[N, columns + layers] the table's integer rows."""
        return self._rows

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
        """For blocks `indices`: offsets [n], per-layer counts [n, layers] and digests [n,
        digests, 32]."""
        rows = self._rows[indices]
        return rows[:, 3], rows[:, self.columns :], self._digests[indices]

    def storage(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For blocks `indices` (v7 on): the first row of their positions, whether one set of
        positions serves every layer, and their first key group (quantized packs). Before v7:
        positions at the token offset, once per layer, and no key groups."""
        rows = self._rows[indices]
        if self.columns == OLD_TABLE_COLUMNS:
            zeros = np.zeros(len(rows), dtype=np.int64)
            return rows[:, 3], zeros, zeros
        return rows[:, 4], rows[:, 5], rows[:, 6]

    def layer_totals(self) -> np.ndarray:
        """[N, layers] tokens each block keeps per layer."""
        return self._rows[:, self.columns :]

    def first_layer_starts(self) -> np.ndarray:
        """[N + 1] int64: where each block's rows of a tensor with one row a token of its first
        layer begin (v13's embeddings), and the total last."""
        counts = self._rows[:, self.columns].astype(np.int64) if len(self) else np.zeros(0, int)
        return np.concatenate([[0], np.cumsum(counts)])

    def layer_runs(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """Spanning key groups (v9): ([N, layers] tokens of layer l in the blocks before each,
        [layers] each layer's first group row). Computed once per table."""
        if self._runs_of is None or self._runs_of[0] != group:
            counts = self.layer_totals().astype(np.int64)
            before = np.cumsum(counts, axis=0) - counts
            groups = -(-counts.sum(axis=0) // group)
            self._runs_of = (group, before, np.cumsum(groups) - groups)
        return self._runs_of[1], self._runs_of[2]

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
            columns=OLD_TABLE_COLUMNS,
        )


def eligible_at(table: BlockTable, at: float | None) -> np.ndarray:
    """Indices of the blocks whose every frame was shown by the moment `at` (their last frame at
    or before it), in time order; every block when `at` is None. A block spanning the moment holds
    frames after it, and a pack does not say which of its tokens came from which frame, so it is
    left out whole: an answer at `at` never sees a later frame. A block with no time counts as 0."""
    chosen = np.arange(len(table))
    if at is not None:
        ends = np.nan_to_num(table.times()[:, 1], nan=0.0)
        chosen = np.flatnonzero(ends <= at + 1e-9)  # times are stored rounded
    return chosen[np.argsort(table.start_steps()[chosen], kind="stable")]


def run_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows of runs [start, start + count), one after another, as one index array."""
    return np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)


class BlockRows:
    """Where some blocks' rows are in each stored block tensor. A block keeps its layers' tokens
    one layer after another: layer l of block i starts at offset_i + counts_i[:l] in K, V and the
    value scales, at its position offset (+ the same, unless one set of positions serves every
    layer) in positions. Its key groups run per layer from its first key group (v7, v8), or (span,
    v9) each layer's tokens of all blocks in table order are cut into groups together.

    A block's checksum is `units` digests (v12; one before), each over a run of `digest_layers`
    layers: its rows of every part in turn, positions stored once for every layer whole. A unit is
    named by block position * units + its run."""

    def __init__(self, table: BlockTable, indices: list[int], group: int, span: bool = False):
        self.indices = indices
        self.offsets, self.counts, self.digests = table.spans(indices)
        self.position_offsets, self.shared, self.first_groups = table.storage(indices)
        self.group = group
        self.layers = self.counts.shape[1]
        before = np.cumsum(self.counts, axis=1) - self.counts
        self.token_starts = self.offsets[:, None] + before
        self.position_starts = self.position_offsets[:, None] + np.where(
            self.shared[:, None] == 1, 0, before
        )
        self.span = span
        self.units = self.digests.shape[1]
        self.digest_layers = max(1, self.layers // self.units)
        self.groups = -(-self.counts // group)
        self.group_starts = (
            self.first_groups[:, None] + np.cumsum(self.groups, axis=1) - self.groups
        )
        if span:  # where each (block, layer) starts in its layer's run, and each run's first group
            before, self.layer_first = table.layer_runs(group)
            self.run_starts = before[indices]

    def block_ranges(self, part: str) -> list[tuple[int, int]]:
        """Every block's row range [start, stop) in the block tensor of `part`."""
        starts, stops = self.block_bounds(part)
        return list(zip(starts.tolist(), stops.tolist()))

    def block_bounds(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        """Every block's first row and stop row in the block tensor of `part`."""
        totals = self.counts.sum(axis=1)
        if part == "pos":
            starts = self.position_offsets
            stops = starts + np.where(self.shared == 1, self.counts[:, 0], totals)
        elif part == "kq":
            starts = self.first_groups
            stops = starts + self.groups.sum(axis=1)
        else:
            starts, stops = self.offsets, self.offsets + totals
        return starts, stops

    def all_units(self) -> np.ndarray:
        """Every digest unit of these blocks."""
        return np.arange(len(self.indices) * self.units, dtype=np.int64)

    def units_taken(self, taken: list[np.ndarray]) -> np.ndarray:
        """The digest units holding the rows of layer l of the blocks at taken[l], each once."""
        runs = np.arange(self.layers) // self.digest_layers
        named = [t.astype(np.int64) * self.units + runs[layer] for layer, t in enumerate(taken)]
        return np.unique(np.concatenate(named)) if named else np.zeros(0, dtype=np.int64)

    def table_units(self, units: np.ndarray) -> list[int]:
        """The units `units` named in the whole table: its block's row * units + its run."""
        rows = np.asarray(self.indices, dtype=np.int64)[units // self.units]
        return (rows * self.units + units % self.units).tolist()

    def unit_bounds(self, part: str, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first row and stop row of each digest unit of `units` in the block tensor of
        `part` (with one unit a block: the block's)."""
        if self.units == 1:
            starts, stops = self.block_bounds(part)
            return starts[units], stops[units]
        if part == "kq":  # v12 writes key scales spanning blocks, under digests of their own
            raise ValueError("key scales as block rows have one digest a block")
        # a run's layers lie together: from its first layer's start to its last layer's end
        block, first = units // self.units, units % self.units * self.digest_layers
        last = first + self.digest_layers - 1
        starts = self.position_starts if part == "pos" else self.token_starts
        return starts[block, first], starts[block, last] + self.counts[block, last]

    def layer_totals(self, taken: list[np.ndarray]) -> list[int]:
        """Rows each layer reads taking the blocks at taken[l] (token_rows, position_rows)."""
        return [int(self.counts[t, layer].sum()) for layer, t in enumerate(taken)]

    def rows_in_read(self, taken: list[np.ndarray], units: np.ndarray) -> tuple[np.ndarray, ...]:
        """For digest units of one layer each: each unit's layer, the row its run starts at
        within that layer's rows of a read of `taken` (token_rows, position_rows), and each
        layer's first row in the whole read."""
        within = np.zeros((len(self.indices), self.layers), dtype=np.int64)
        for layer, t in enumerate(taken):
            counts = self.counts[t, layer]
            within[t, layer] = np.cumsum(counts) - counts
        layers = units % self.units
        firsts = np.cumsum([0, *self.layer_totals(taken)])
        return layers, within[units // self.units, layers], firsts

    def _runs(self, starts: np.ndarray, taken: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # layer-major: every layer's taken blocks in context order, so a tensor is read in one go
        firsts = np.concatenate([starts[t, layer] for layer, t in enumerate(taken)])
        counts = np.concatenate([self.counts[t, layer] for layer, t in enumerate(taken)])
        return firsts, counts

    def token_rows(self, taken: list[np.ndarray]) -> np.ndarray:
        """Rows of K, V and value scales for layer l taking blocks taken[l], layer after layer."""
        return run_rows(*self._runs(self.token_starts, taken))

    def position_rows(self, taken: list[np.ndarray]) -> np.ndarray:
        return run_rows(*self._runs(self.position_starts, taken))

    def key_group_rows(self, taken: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(the key-scale rows the tokens use, each once, and every token's index into them)."""
        if self.span:
            firsts, counts = self._runs(self.run_starts, taken)
            bases = np.concatenate(
                [np.full(len(t), self.layer_first[layer]) for layer, t in enumerate(taken)]
            )
            within = run_rows(np.zeros_like(firsts), counts)
            place = np.repeat(firsts, counts) + within  # each token's place in its layer's run
            groups = np.repeat(bases, counts) + place // self.group
        else:
            firsts, counts = self._runs(self.group_starts, taken)
            within = run_rows(np.zeros_like(firsts), counts)  # each token's place in its run
            groups = np.repeat(firsts, counts) + within // self.group
        change = np.ones(len(groups), dtype=bool)
        change[1:] = groups[1:] != groups[:-1]
        return groups[change], np.cumsum(change) - 1
