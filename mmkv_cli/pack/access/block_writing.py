"""The blocks' bytes, streamed into the pack file one block at a time: each block made (and
quantized) once, hashed, and written at its place in each shared block tensor."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate

from mmkv_cli.pack.integrity.hashing import new_digest
from mmkv_cli.pack.io.writeback import WriteBack
from mmkv_cli.pack.quantized import vidkv
from mmkv_cli.pack.quantized.quant import (
    QuantSpec,
    SpanningKeyRanges,
    quantize_keys_with,
    quantize_values,
    spanning_groups,
)
from mmkv_cli.pack.schema.format import Span, raw_bytes
from mmkv_cli.pack.schema.stored import stored_positions


class KeyScales:
    """Spanning key groups in one pass over the blocks: a block's key codes are made as soon as
    every group its tokens fall in is closed (a small block waits for the next few, never more
    than a group's tokens of them), and the scales are complete after the last block."""

    def __init__(self, quant: QuantSpec, totals: list[int], heads: int, dim: int):
        self.quant = quant
        self.ranges = SpanningKeyRanges(totals, quant.group, quant.bits, heads, dim)
        self.before = [0] * len(totals)
        self.waiting: list[tuple[Span, list[int]]] = []

    def feed(self, block: Span) -> list[tuple[Span, list]]:
        """Take in the next block; the blocks (in order) whose codes can now be made."""
        values = block.part(1) if self.quant.mixed else None
        self.ranges.add(block.part(0), block.layer_counts, values)
        self.waiting.append((block, self.before))
        self.before = [a + b for a, b in zip(self.before, block.layer_counts)]
        ready = 0
        while ready < len(self.waiting) and self._closed(*self.waiting[ready]):
            ready += 1
        return self._codes(ready)

    def finish(self) -> list[tuple[Span, list]]:
        self.ranges.finish()
        return self._codes(len(self.waiting))

    def _closed(self, block: Span, before: list[int]) -> bool:
        group, closed = self.quant.group, self.ranges.closed
        return all(
            n == 0 or (start + n - 1) // group < done
            for start, n, done in zip(before, block.layer_counts, closed)
        )

    def _codes(self, ready: int) -> list[tuple[Span, list]]:
        """(block, its stored parts) for the first `ready` waiting blocks."""
        out, quant = [], self.quant
        for block, before in self.waiting[:ready]:
            rows = spanning_groups(before, block.layer_counts, quant.group, self.ranges.firsts)
            keys = quantize_keys_with(block.part(0), self.ranges.scales, rows, quant.bits)
            positions = stored_positions(block)[0]
            if quant.mixed:  # values per channel, against the same groups' fourth plane
                planes = self.ranges.scales.index_select(0, rows)
                out.append((block, [keys, vidkv.encode_values(block.part(1), planes), positions]))
                continue
            heads, dim = block.keys[0].shape[0], block.keys[0].shape[2]
            group = quant.value_group(heads, dim)
            values, value_scales = quantize_values(block.part(1), quant.bits, group)
            out.append((block, [keys, values, positions, value_scales]))
        del self.waiting[:ready]
        return out


def write_blocks(
    fh,
    blocks: Iterable[Span],
    starts: list[int],
    keys: KeyScales | None,
    digest: str,
    digest_layers: int,
):
    """Write every block's stored tensors where they go (starts: where each streamed part's
    tensor begins in the file), each block made (and quantized) once, then (quantized) the keys'
    scales. Returns where each part's writes ended and the blocks' checksums (each its digests of
    `digest_layers` stored layers at a time, joined).
    The file keeps all blocks' K, then all V, ...: each part is a run of writes in block order."""
    at, digests, back = list(starts), [], WriteBack(fh)

    def write(block: Span, stored: list | None) -> None:
        if stored is None:  # as computed
            stored = [block.part(0), block.part(1), stored_positions(block)[0]]
        raws = [raw_bytes(data) for data in stored]
        rows = [int(data.shape[0]) for data in stored]
        digests.append(layer_digests(raws, rows, block.layer_counts, digest_layers, digest))
        for part, raw in enumerate(raws):
            fh.seek(at[part])
            fh.write(raw)
            back.wrote(part, at[part], raw.nbytes)
            at[part] += raw.nbytes

    for block in blocks:
        for made in keys.feed(block) if keys else [(block, None)]:
            write(*made)
    if keys:
        for made in keys.finish():
            write(*made)
        raw = raw_bytes(keys.ranges.scales)
        fh.seek(at[-1])
        fh.write(raw)
        at[-1] += raw.nbytes
    return at, digests


def layer_digests(
    raws: list, rows: list[int], counts: list[int], digest_layers: int, algorithm: str
) -> bytes:
    """A block's checksum as stored: for each run of `digest_layers` layers, the digest of its
    rows of every stored part in turn (raws: the parts' bytes, token-major, of rows[i] rows each;
    positions stored once for every layer go whole into each digest). One run of all the layers:
    the digest of the block's bytes."""
    total = sum(counts)
    edges = [0, *accumulate(counts)]  # each layer's first row
    out = []
    for first in range(0, len(counts), digest_layers):
        a, b = edges[first], edges[min(len(counts), first + digest_layers)]
        hashed = new_digest(algorithm)
        for raw, stored in zip(raws, rows):
            row = raw.nbytes // stored if stored else 0
            hashed.update(raw[a * row : b * row] if stored == total else raw)
        out.append(hashed.digest())
    return b"".join(out)
