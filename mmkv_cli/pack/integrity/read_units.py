"""Digest units checked on the bytes a read left in its buffers, not read from the file again.

With a digest a layer (v12) a unit is one layer's run of a block, and a read for the model holds
each of its parts (K, V, positions, value scales) in that layer's rows. A retrieval's question
checks thousands of these, each paying its Python under the GIL; small ones are therefore taken in
stretches: units lying one after another in every part's buffer, of one size, whose parts are
joined side by side with one numpy call, so that each unit costs one BLAKE3 call.
"""

from __future__ import annotations

import numpy as np

from mmkv_cli.pack.integrity.finite import finite_stored
from mmkv_cli.pack.io.pools import scratch

# Units of at most this many bytes on average are joined in stretches before they are hashed: for
# small units one BLAKE3 update costs less than one a part (StreamingTOM's 27 KB units hold
# positions and value scales of a few hundred bytes each); a larger unit's copy costs more
JOIN_BYTES = 64 << 10


class ReadUnits:
    """Where each digest unit's parts lie in the buffers a read left, and their checks.

    parts: for each part (name, dtype, unit starts, unit stops: arrays, row bytes); kept: part
    name -> the read's numpy buffers (one for every layer, or one a layer); layers, rows: each
    unit's layer and its run's first row in that layer's rows; firsts: each layer's first row in
    a buffer for every layer; new: an empty hash; expected: [units, 32] the table's digests;
    blocks: the block each unit is of; finite: check K/V as stored for NaN/Inf too."""

    def __init__(self, parts, kept, layers, rows, firsts, new, expected, blocks, finite: bool):
        self._new, self._expected, self._blocks, self._finite = new, expected, blocks, finite
        self._dtypes = [dtype for _, dtype, _, _, _ in parts]
        self._buffers, which, at, sizes = [], [], [], []
        for name, _, starts, stops, row in parts:
            self._buffers.append([memoryview(b.reshape(-1).view(np.uint8)) for b in kept[name]])
            if len(kept[name]) == 1:
                which.append(np.zeros(len(layers), np.int64))
                at.append((firsts[layers] + rows) * row)
            else:
                which.append(layers)
                at.append(rows * row)
            sizes.append((stops - starts) * row)
        average = int(sum(s.sum() for s in sizes)) // max(1, len(layers))
        self.joined = average <= JOIN_BYTES
        # in buffer order where units are joined in stretches; unit order otherwise
        self._order = np.lexsort((at[0], which[0])) if self.joined else np.arange(len(layers))
        # numpy: a stretch reads its first unit's alone (lists cost more to make than to index)
        self._which = [w[self._order] for w in which]
        self._at = [a[self._order] for a in at]
        self._sizes = [s[self._order] for s in sizes]
        self._next = np.ones(len(layers), bool)  # each unit in order follows the one before
        self._next[:1] = False
        for w, a, s in zip(self._which, self._at, self._sizes):
            self._next[1:] &= (w[1:] == w[:-1]) & (a[1:] == a[:-1] + s[:-1]) & (s[1:] == s[:-1])

    def runs(self, per_run: int) -> list[range]:
        """Runs of at most `per_run` units (positions in this order), none across a stretch."""
        if not self.joined:
            count = len(self._order)
            return [range(i, min(count, i + per_run)) for i in range(0, count, per_run)]
        cuts, out = [*np.flatnonzero(~self._next).tolist(), len(self._order)], []
        for first, stop in zip(cuts, cuts[1:]):
            out += [range(i, min(stop, i + per_run)) for i in range(first, stop, per_run)]
        return out

    def check(self, run: range) -> tuple[list[int], list[int]]:
        """The blocks of the units in `run` whose digest differs, and those holding NaN or Inf."""
        if not self.joined:
            return self._check_each(run)
        count, first = len(run), run.start
        parts, finite = [], True
        for buffers, dtype, which, at, sizes in zip(
            self._buffers, self._dtypes, self._which, self._at, self._sizes
        ):
            size = int(sizes[first])
            part = np.frombuffer(buffers[which[first]], np.uint8, count * size, int(at[first]))
            if self._finite and finite:
                finite = finite_stored(part, dtype)
            parts.append(part.reshape(count, size))
        if not finite:  # which blocks: each unit on its own
            return self._check_each(run)
        units = self._order[run.start : run.stop]
        bad = differing(joined_digests(parts, self._new), self._expected[units])
        return [self._blocks[units[i]] for i in bad], []

    def _check_each(self, run: range) -> tuple[list[int], list[int]]:
        """check(run), unit by unit: one update a part."""
        bad, nonfinite = [], []
        where = [(w[run].tolist(), a[run].tolist(), s[run].tolist())
                 for w, a, s in zip(self._which, self._at, self._sizes)]  # fmt: skip
        for i, unit in enumerate(self._order[run].tolist()):
            digest, finite = self._new(), True
            for buffers, dtype, (which, at, sizes) in zip(self._buffers, self._dtypes, where):
                piece = buffers[which[i]][at[i] : at[i] + sizes[i]]
                if self._finite and finite:
                    finite = finite_stored(np.frombuffer(piece, np.uint8), dtype)
                digest.update(piece)
            if not finite:
                nonfinite.append(self._blocks[unit])
            if digest.digest() != self._expected[unit].tobytes():
                bad.append(self._blocks[unit])
        return bad, nonfinite


def joined_digests(parts: list[np.ndarray], new) -> bytes:
    """The digests of units whose parts are given as [units, bytes] arrays ([1, bytes]: a part
    every unit holds whole, as positions stored once for every layer), each unit's parts in turn:
    joined side by side in this thread's kept buffer, one hash (`new`) a unit; 32 bytes each."""
    count, width = max(p.shape[0] for p in parts), sum(p.shape[1] for p in parts)
    joined = np.frombuffer(scratch(count * width, "join"), np.uint8, count * width)
    joined = joined.reshape(count, width)
    column = 0
    for part in parts:
        joined[:, column : column + part.shape[1]] = part
        column += part.shape[1]
    rows = memoryview(joined.reshape(-1))
    return b"".join([new(rows[i * width : (i + 1) * width]).digest() for i in range(count)])


def differing(got: bytes, expected: np.ndarray) -> list[int]:
    """Which units' digests in `got` (32 bytes each) differ from expected [units, 32]."""
    if got == expected.tobytes():
        return []
    mine = np.frombuffer(got, np.uint8).reshape(-1, 32)
    return np.flatnonzero((mine != expected).any(axis=1)).tolist()
