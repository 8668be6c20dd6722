"""Read a pack lazily: the header and representatives first, block rows only when asked (pread
through the descriptor opened)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.access.block_store import BlockStore
from mmkv_cli.pack.access.opening import open_pack
from mmkv_cli.pack.access.side_tensors import (
    SideTensors,
    checked_span,
)
from mmkv_cli.pack.integrity.checks import check_positions, uncovered
from mmkv_cli.pack.integrity.hashing import BlockHashes, hashed_beside, mismatched, mismatched_later
from mmkv_cli.pack.integrity.tensors import StoredTensors
from mmkv_cli.pack.integrity.verdicts import LaterVerdicts, finite_flag
from mmkv_cli.pack.io.source import block_byte_ranges, open_pack_file
from mmkv_cli.pack.schema.format import BLOCKS, PARTS, SERIES, Span, split_layers
from mmkv_cli.pack.schema.header import read_header
from mmkv_cli.pack.schema.table import BlockRows, BlockTable

# Reads of at least this many K/V bytes are checksummed on a thread beside the copy; below it the
# thread's start costs more than it saves (docs/measurements.md)
OVERLAP_BYTES = 8 << 20
# verify checks blocks this many at a time (an hour of video at a block a frame is 3,600 or more)
VERIFY_BLOCKS = 1024
# A question's read leaves its checksums to finish beside the next read only on this many cores or
# more: on 2 the hashing has no core to itself and ReKV's layers read slower so (bench/rates.py
# layer_reads; figures in docs/benchmarks.md)
DEFER_CORES = 8


class PackReader:
    """A pack opened for reading: `header` (typed, upgraded from the version that stored it) and
    the block table on open, every field checked; K/V rows read, and checksummed, when asked."""

    def __init__(self, path: str | Path):
        # Everything is read through this one descriptor: a pack replaced under the reader (an
        # encode --force, a sync) leaves it reading the file it opened, whole. A pack on object
        # storage is a sparse local mirror, filled by range requests just before each read.
        self.source, self.path = open_pack_file(path)
        self._tensors = StoredTensors(self.source, self.path)
        self._entries = self._tensors.entries
        # digest units gather() has checked: table index * units a block + unit
        self._verified: set[int] = set()
        self._store: BlockStore | None = None  # the block tensors, on the first read
        self._spans: dict[str, Span] = {}
        opened = open_pack(self._tensors, str(self.path))
        self._stored, self.format_version = opened.stored, opened.format_version
        self.digest = opened.digest  # the hash of its checksums, and their fields' name
        self._token_major, self._columns = opened.token_major, opened.columns
        self.quant, self.spans_meta, self._kv = opened.quant, opened.spans_meta, opened.kv
        self._blocks = opened.blocks
        self.header = read_header(self._stored, self.format_version, self._kv, self._where)
        # the representatives and v9's key scales: read and checked once, on first use
        self.sides = SideTensors(
            self._tensors, self._stored, self.format_version, self.digest, self.quant, self._where
        )

    @property
    def _where(self) -> str:
        return str(self.path)

    def uncovered(self) -> list[str]:
        """What this pack stores with no checksum over it, in its format (v8: nothing)."""
        return uncovered(self.format_version, self._stored, self._entries)

    @property
    def blocks(self) -> BlockTable:
        return self._blocks

    def _block_meta(self, name: str) -> dict | None:
        index = self._blocks.index_of(name)
        return None if index is None else self._blocks[index]

    def stored_bytes(self, names: list[str]) -> int:
        """Bytes the tensors `names` take in the file (0 for those it does not hold)."""
        return self._tensors.stored_bytes(names)

    @property
    def size(self) -> int:
        return self._tensors.size

    def series(self, name: str) -> list:
        """A per-frame or per-step list ("media.timestamps", "layout.step_lengths"): a tensor from
        v4 on."""
        if name not in SERIES:
            raise KeyError(name)
        if name in self._entries:
            return self._tensors.array(name).tolist()
        section, key = name.split(".")
        value = (self._stored.get(section) or {}).get(key)
        if value is None:
            raise PackError(f"{self.path} stores no {name}")
        return list(value)

    def representatives(self) -> torch.Tensor | None:
        """[blocks, layers, dim] retrieval keys, or None (SideTensors.representatives)."""
        return self.sides.representatives()

    def stored_representatives(self) -> np.ndarray | None:
        """The representatives as stored, checked, or None (numpy: no torch)."""
        return self.sides.stored_representatives()

    def embeddings(self) -> torch.Tensor | None:
        """v13: [tokens, dim] the blocks' tokens as taken in, or None (SideTensors.embeddings)."""
        return self.sides.embeddings()

    def stored_embeddings(self) -> np.ndarray | None:
        """v13's embeddings as stored, checked, or None (numpy: no torch)."""
        return self.sides.stored_embeddings()

    @property
    def rotated_representatives(self) -> bool:
        return self.sides.rotated_representatives

    def span(self, name: str, keep: bool = True, dtype: torch.dtype | None = None) -> Span:
        """Load one span ("prefix", "suffix" or a block name), verifying its checksum. keep: hold
        it for the next call (a pass over every block, as convert makes, would hold them all).
        dtype: what a quantized block decodes into (default: the KV's dtype)."""
        if name in self._spans:
            return self._spans[name]
        loaded = self._load_span(name, dtype)
        if keep:
            self._spans[name] = loaded
        return loaded

    def gather(
        self,
        names: list[str],
        per_layer: list[list[str]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        later: LaterVerdicts | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Blocks `names` joined per layer, in that order: (keys, values, positions), each a list
        over layers of [H_kv, n, D] and [P, n] int64. per_layer: for every layer the names it takes
        instead (each a subset of `names`, in context order), for retrieval that picks blocks layer
        by layer. K/V are on `device` (default: the CPU), a quantized pack's dequantized there, only
        the rows read; each layer's is a strided view of its group's buffer (concatenating makes
        it contiguous).

        A context of many blocks is read with a pread per run of consecutive rows; bound for a GPU,
        into pinned memory, a large one in groups of whole blocks each sent while the next is read
        (pack/io/staging.py). Every block's checksum is still verified, on its own bytes, before
        anything read is handed out, unless `later` is given: where the NaN/Inf verdict of K/V
        decoded on the device goes unread, for the caller to read with something it reads anyway,
        and where a read of large digest units leaves its checksums to finish, for the caller to
        wait for before it shows anything made of the rows (None: both read now).
        """
        if not names:
            return [], [], []
        indices = [self._blocks.index_of(name) for name in names]
        if None in indices:
            raise PackError(f"{self.path} has no block {names[indices.index(None)]}")
        where = self._rows(indices)
        store = self._block_store()
        self._tensors.still_whole()
        if per_layer is None:
            taken = [np.arange(len(names))] * where.layers
        else:
            at = {name: i for i, name in enumerate(names)}
            taken = [np.asarray([at[n] for n in chosen], dtype=np.int64) for chosen in per_layer]
        # only the digests over what is read: a layer's retrieval checks that layer's rows
        units = where.units_taken(taken)
        self._fetch(where, units)
        named = where.table_units(units)
        pending = units[np.fromiter((n not in self._verified for n in named), bool, len(named))]
        # K/V as stored are checked for NaN/Inf on the bytes hashed, on the hashing threads (a
        # checksum says the bytes are the writer's, not that the writer was honest or sane)
        hashes = store.hashes(where, pending, finite=self.quant is None)
        as_read = self._hashed_as_read(where, store, taken, device)
        # small, or of units too small to hash but holding the GIL: a thread costs more than it
        # saves, so the checksums come first on this thread
        small = not as_read and (
            store.kv_bytes(where, pending) < OVERLAP_BYTES or hashes.threads() < 2
        )
        # a question (`later`) takes rows whose units are still being hashed, and its first
        # token waits for the verdict: ReKV's next layer is read while this one's is hashed, and
        # StreamingTOM's thousands of small units hashed as read (on one thread: their Python
        # holds the GIL) while its context goes to the device and is decoded and prefilled
        defer = (
            later is not None
            and len(pending) > 0
            and not small
            and (as_read or hashes.threads() > 1)
            and (os.cpu_count() or 1) >= DEFER_CORES
        )
        if as_read:
            # a unit is one run of one layer (a digest a layer): hashed on the bytes read
            kept: dict = {}
            read = store.read_rows(where, taken, device, dtype, kept)
            if set(kept) == set(store.views):
                hashes.read_from(kept, *where.rows_in_read(taken, pending))
            if defer:
                later.defer(self._check_later(where, hashes, named, mismatched_later(hashes)))
            else:
                mismatched(hashes)
                self._refuse(where, hashes)
        elif small:
            mismatched(hashes)
            self._refuse(where, hashes)
            read = store.read_rows(where, taken, device, dtype)
        elif defer:  # the hashing threads read the file beside this thread's rows
            checking = mismatched_later(hashes)
            read = store.read_rows(where, taken, device, dtype)
            later.defer(self._check_later(where, hashes, named, checking))
        else:
            # checksums on threads while the rows are copied (both let go of the GIL), and on
            # this thread too once the copy is done: one after the other, a read ran slower
            read = hashed_beside(hashes, lambda: store.read_rows(where, taken, device, dtype))
            self._refuse(where, hashes)  # before anything read is handed out
        if self.quant is not None:
            read = self._decoded_finite(read, names, later, dtype)
        self._check_positions(read[2], "the blocks read")
        self._tensors.still_whole()  # blocks checked before need not be hashed again
        if not defer:
            self._verified.update(named)
        return read

    def _check_later(self, where: BlockRows, hashes: BlockHashes, named, checking: Future):
        """What a question calls before its first token for a read whose checksums are
        `checking`: it waits for them, and refuses the pack as a read checked at once would."""

        def check() -> None:
            checking.result()  # an error of the file while it was hashed is raised here
            self._tensors.still_whole()
            self._refuse(where, hashes)
            self._verified.update(named)

        return check

    def _hashed_as_read(self, where: BlockRows, store: BlockStore, taken, device) -> bool:
        """Whether a read's units are hashed on the bytes it reads: each unit one layer's run of
        a token-major pack (not v7/v8's key scales, read by group), and the read in one piece
        (a large read bound for a GPU goes in groups, and is hashed beside it from the file)."""
        if where.digest_layers != 1 or not store.token_major or "kq" in store.views:
            return False
        return not store.read_in_groups(sum(where.layer_totals(taken)), device)

    def _decoded_finite(self, read: tuple, names: list[str], later: LaterVerdicts | None, dtype):
        """`read` (keys, values, positions) of a quantized pack unless its decoded K/V hold NaN
        or Inf (so the scales are checked too). later: where the verdict goes unread."""
        flag = finite_flag([*read[0], *read[1]])
        if later is not None:
            later.add(flag, names, lambda: self._nonfinite_block(names, dtype))
        elif flag is not None and not bool(flag):  # one verdict for K and V: one wait
            shown = self._nonfinite_block(names, dtype)
            raise PackError(f"{self.path} is corrupted (NaN or Inf in the K/V of {shown})")
        return read

    def _nonfinite_block(self, names: list[str], dtype) -> str:
        """The first of `names` whose decoded K/V hold NaN or Inf, each read again alone (only
        once a read of them all was refused)."""
        if len(names) > 1:
            for name in names:
                try:
                    self.gather([name], dtype=dtype)
                except PackError:
                    return name
        return names[0] if names else "the blocks read"

    def _rows(self, indices: list[int]) -> BlockRows:
        """Where the blocks at `indices` (table rows) sit in the block tensors."""
        if self.quant is None:
            return BlockRows(self._blocks, indices, 1)
        return BlockRows(self._blocks, indices, self.quant.group, self.quant.span)

    def key_scales(self) -> torch.Tensor:
        """v9: the spanning key groups' planes, checked once (SideTensors.key_scales)."""
        return self.sides.key_scales(str(self.path))

    def _block_store(self) -> BlockStore:
        if self._store is None:
            span = self.quant is not None and self.quant.span
            if self.quant is None:
                parts = PARTS[:3]
            elif span:  # v9: the key scales are one tensor apart, checked on their own
                parts = list(self.quant.block_parts)
            else:
                parts = list(PARTS)
            views = {part: self._tensors.view(f"{BLOCKS}.{part}") for part in parts}
            if not self._token_major:  # v2/v3: a block's rows lie apart in every head; read whole
                views = {part: (array.read(), dtype) for part, (array, dtype) in views.items()}
            # what quantized K/V decode into by default (v7 on; older packs are never quantized)
            kv_dtype = self.header.kv.dtype if self.quant else None
            scales = self.key_scales if span else None
            self._store = BlockStore(
                views, self.quant, kv_dtype, self._token_major, scales, self.digest
            )
        return self._store

    @property
    def fetched(self) -> int | None:
        """Bytes fetched from object storage so far (None: a local pack)."""
        return self.source.fetched

    @property
    def bytes_read(self) -> int:
        """Bytes copied out of the file so far (block rows included)."""
        return self._tensors.bytes_read + (self._store.bytes_read if self._store else 0)

    def _fetch(self, where: BlockRows, units: np.ndarray) -> None:
        """Bring the rows of the digest units `units` of every block tensor within reach (remote:
        theirs alone, whole units: each is checked whole)."""
        if not self.source.local:
            names = [f"{BLOCKS}.{part}" for part in self._block_store().views]
            entries = {name: self._entries[name] for name in names}
            start = self._tensors.data_start
            self.source.ensure(block_byte_ranges(entries, start, where, self._token_major, units))

    def block_faults(self, chunk: int = VERIFY_BLOCKS) -> list[str]:
        """Every block checked against its checksum (verify): the names of those that fail."""
        faults = []
        store = self._block_store()
        if store.key_scales is not None:
            fault = self.sides.key_scales_fault()
            if fault:  # every quantized block decodes through them: none can be read
                return [f"key scales: {fault}"]
        name = self._blocks.name
        for first in range(0, len(self._blocks), chunk):
            where = self._rows(list(range(first, min(len(self._blocks), first + chunk))))
            self._tensors.still_whole()
            self._fetch(where, where.all_units())
            bad, nonfinite = store.faults(where, self._rows)
            faults += [f"block {name(i)}: checksum mismatch" for i in bad]
            faults += [f"block {name(i)}: NaN or Inf in its K/V" for i in nonfinite]
        return faults

    def span_arrays(self, name: str) -> tuple[np.ndarray, ...]:
        """A prompt span's stored K, V and positions, checked (numpy: no torch)."""
        return checked_span(self._tensors, name, self.spans_meta[name], self.digest, self._where)

    def _check_positions(self, positions: list[torch.Tensor], what: str) -> None:
        check_positions(positions, self.header.layout, f"{self.path}", what)

    def _refuse(self, where: BlockRows, hashes: BlockHashes) -> None:
        """Refuse the read `hashes` checked (once every run is hashed) for its first block whose
        checksum differs, or whose K/V as stored hold NaN or Inf."""
        for bad, fault in (
            (hashes.mismatched(), "checksum mismatch in"),
            (hashes.nonfinite(), "NaN or Inf in the K/V of"),
        ):
            if bad:
                name = self._blocks.name(where.indices[bad[0]])
                raise PackError(f"{self.path} is corrupted ({fault} {name})")

    def _load_span(self, name: str, dtype: torch.dtype | None = None) -> Span:
        meta = self.spans_meta.get(name) or self._block_meta(name)
        if meta is None:
            raise PackError(f"{self.path} has no span {name}")
        time, steps = meta.get("time"), meta.get("steps")
        # a block: its token range of the shared block tensors, read and checked by gather
        if "offset" in meta:
            keys, values, positions = (
                [t.contiguous() for t in part] for part in self.gather([name], dtype=dtype)
            )
        else:
            k, v, pos = (
                torch.from_numpy(array).view(getattr(torch, self._tensors.view(f"{name}.{p}")[1]))
                for array, p in zip(self.span_arrays(name), ("k", "v", "pos"))
            )
            counts = meta["layer_counts"]
            self._check_positions([pos], name)
            if meta.get("shared_positions"):  # v7: one layer's rows serve them all
                pos = pos.repeat(len(counts), 1)
            keys, values, positions = (
                [t.contiguous() for t in split_layers(part, counts, self._token_major)]
                for part in (k, v, pos.to(torch.int64))
            )
        return Span(
            name=name,
            keys=keys,
            values=values,
            positions=positions,
            granularity=meta.get("granularity"),
            steps=tuple(steps) if steps else None,
            time=tuple(time) if time else None,
        )
