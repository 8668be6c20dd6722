"""A pack's shared block tensors ("blocks.k/.v/.pos", and ".kq/.vq" when quantized), read by rows
from the file: the rows of some blocks copied out (and dequantized), and their checksums computed
on each block's own stored bytes."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import wait

import numpy as np

from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.integrity.hashing import (
    BlockHashes,
    beside_hashing,
    mismatched,
    raw_view,
    stored_bytes,
)
from mmkv_cli.pack.integrity.tensors import FileArray
from mmkv_cli.pack.integrity.verdicts import finite_flag
from mmkv_cli.pack.io.staging import Staging
from mmkv_cli.pack.quantized import vidkv
from mmkv_cli.pack.quantized.decodable import decodes_finite, rows_decode_finite
from mmkv_cli.pack.quantized.quant import QuantSpec, dequantize
from mmkv_cli.pack.schema.table import BlockRows


def sent_once(tensors: list[torch.Tensor], staging: Staging) -> list[torch.Tensor]:
    """Each of `tensors` on the staging's device; one held more than once (the empty layers'
    shared buffer) is sent once."""
    sent: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in sent:
            sent[id(t)] = staging.send(t)
    return [sent[id(t)] for t in tensors]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or Inf in any of `tensors`: each device's verdict read once (a read waits for it)."""
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    flags = [finite_flag(group) for group in by_device.values()]
    return all(bool(flag) for flag in flags if flag is not None)


class BlockStore:
    """views: part -> (the stored tensor, a FileArray or numpy once read whole; torch dtype name),
    for the parts the pack stores.
    token_major: tokens on the first axis (v4 on; v2/v3 kept them second). kv_dtype: what a
    quantized block decodes into unless asked otherwise. bytes_read counts what was copied out.
    key_scales: v9's spanning key scales [groups, 2, H, D], read and checked once when first
    needed (no block's checksum covers them); before v9 they are block rows ("kq" in views).
    algorithm: the hash of the blocks' checksums (format.digest_name)."""

    def __init__(
        self,
        views: dict,
        quant: QuantSpec | None,
        kv_dtype: str | None,
        token_major: bool,
        key_scales,
        algorithm: str,
    ) -> None:
        self.views = views
        self.algorithm = algorithm
        self.key_scales = key_scales
        self.quant = quant
        self.kv_dtype = kv_dtype
        self.token_major = token_major
        self.bytes_read = 0
        self._keys_fine: bool | None = None  # v9's key scales all decode finite (once known)

    def kv_bytes(self, where: BlockRows, units: np.ndarray) -> int:
        """Stored K and V bytes of the digest units `units` (BlockRows names them)."""
        starts, stops = where.unit_bounds("k", units)
        return (self._row_bytes("k") + self._row_bytes("v")) * int((stops - starts).sum())

    def hashes(self, where: BlockRows, units: np.ndarray, finite: bool = False) -> BlockHashes:
        """The digests of the units `units`, to compute on threads beside a read (finite: their
        values as stored checked for NaN/Inf on the same bytes)."""
        return BlockHashes(
            self.views, where, units, self.block_bytes, self.token_major, self.algorithm, finite
        )

    def checked(self, where: BlockRows) -> tuple[list[int], list[int] | None]:
        """(the blocks of `where` whose checksum differs, those holding NaN or Inf as stored) in
        one read on every hashing thread; None for the second on a quantized pack, whose decoded
        values are what to check."""
        hashes = self.hashes(where, where.all_units(), finite=self.quant is None)
        bad = mismatched(hashes)
        return bad, hashes.nonfinite() if self.quant is None else None

    def faults(
        self, where: BlockRows, rows_of: Callable[[list[int]], BlockRows]
    ) -> tuple[list[int], list[int]]:
        """verify's faults among the blocks of `where`, as table rows: (those whose checksum
        differs, those whose K/V hold NaN or Inf: as stored, checked on the bytes hashed, or
        decoded where quantized, for the blocks whose scales might not decode finite). rows_of:
        where other table rows lie (a failing chunk's suspects are decoded one by one)."""
        # a quantized pack's scales are read and checked beside the hashing, not after it
        # (docs/benchmarks.md, Quantized packs)
        suspecting = None
        if self.quant is not None:
            suspecting = beside_hashing(lambda: self.decode_suspects(where))
        try:
            bad, nonfinite = self.checked(where)  # nonfinite: None where quantized
        finally:
            if suspecting is not None:
                wait([suspecting])  # its error, if any, is raised by result() below
        self.bytes_read += self.stored_bytes(where)
        if suspecting is None:
            return [where.indices[i] for i in bad], [where.indices[i] for i in nonfinite or []]
        suspects = [where.indices[i] for i in suspecting.result()]

        def finite(chosen: list[int]) -> bool:
            rows = rows_of(chosen)
            keys, values, *_ = self.read_rows(
                rows, [np.arange(len(chosen))] * rows.layers, None, None
            )
            return all_finite([*keys, *values])

        decoded = (
            [] if not suspects or finite(suspects) else [i for i in suspects if not finite([i])]
        )
        return [where.indices[i] for i in bad], decoded

    def decode_suspects(self, where: BlockRows) -> list[int]:
        """The quantized blocks of `where` (positions in it) whose stored scales might decode to
        NaN or Inf, found from the scales alone (decodable.decodes_finite; about 6% of a 4-bit
        block's bytes): every other block decodes finite, so `verify` decodes only these (from an
        honest writer, none). At 1.5 bits every block: VidKV's planes decode otherwise."""
        count = len(where.indices)
        if self.quant.mixed or not count:
            return list(range(count))
        bits, dtype = int(self.quant.bits), self.kv_dtype

        def fine(plane_axis: int) -> Callable[[np.ndarray], np.ndarray]:
            return lambda rows: rows_decode_finite(rows, plane_axis, bits, dtype)

        suspect = self._failing("vq", where, fine(-1))  # [tokens, groups, 2]
        if self.key_scales is None:  # v7/v8: a block's key groups are rows of its own
            suspect |= self._failing("kq", where, fine(1))  # [groups, 2, H, D]
        elif not self._keys_decode_finite():
            return list(range(count))
        return np.flatnonzero(suspect).tolist()

    def _failing(self, part: str, where: BlockRows, fine) -> np.ndarray:
        """[blocks of where] whether any of a block's rows of `part` fails `fine` (rows -> a bool
        per row)."""
        starts, stops = where.block_bounds(part)
        low = int(starts.min())
        rows = self.views[part][0][low : int(stops.max())]
        failed = ~fine(rows)
        if not failed.any():  # an honest writer's
            return np.zeros(len(starts), dtype=bool)
        before = np.concatenate([[0], np.cumsum(failed)])
        return before[stops - low] > before[starts - low]

    def _keys_decode_finite(self) -> bool:
        """v9 on: whether every spanning key group decodes finite (checked once)."""
        if self._keys_fine is None:
            scales = self.key_scales().numpy()  # [groups, 2, H, D] float16
            fine = decodes_finite(scales[:, 0], scales[:, 1], int(self.quant.bits), self.kv_dtype)
            self._keys_fine = bool(fine.all())
        return self._keys_fine

    def stored_bytes(self, where: BlockRows) -> int:
        """Bytes every block tensor holds for the blocks of `where` (what checking them reads)."""
        return stored_bytes(self.views, where, where.all_units(), self.token_major)

    def block_bytes(self, view, start: int, stop: int, into: memoryview) -> memoryview:
        """The stored bytes of token range [start, stop) of a block tensor, flat, in the order its
        checksum covers: a token-major pack's read into `into` (a buffer the caller keeps and
        reuses; valid until it is reused)."""
        if self.token_major:  # contiguous: one read
            return view.bytes_into(start, stop, into)
        return raw_view(np.ascontiguousarray(view[:, start:stop]))

    def read_rows(
        self,
        where: BlockRows,
        taken: list[np.ndarray],
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        kept: dict | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Layer l's rows of the blocks at taken[l] (positions in `where`), layer after layer:
        (keys, values, positions), K/V on `device` (default: the host), dequantized there where
        stored quantized; positions on the host. Nothing is checked here: the checksums' threads
        check the K/V as stored for NaN/Inf on the bytes they hash (hashes(..., finite=True)), and
        a quantized pack's decoded values are the caller's to check. kept: where each part's host
        buffers (numpy, as read) are left, by part, for checksums computed on them; a part read
        in groups (a large read bound for a GPU) leaves none."""
        staging = Staging(device)
        rows = where.token_rows(taken)
        totals = where.layer_totals(taken)
        positions = self._pick("pos", where.position_rows(taken), Staging(), kept)
        positions = positions.to(torch.int64)
        positions = [p.T for p in torch.split(positions, totals)]
        ends = np.cumsum(totals, dtype=np.int64)
        firsts = ends - np.asarray(totals, dtype=np.int64)
        if self.quant is None:
            return *self._staged_rows(rows, totals, firsts, ends, staging, kept), positions
        groups, expand = where.key_group_rows(taken)
        # rows, scales and indices are read on the host: sent to the device without a wait
        k, v = (staging.send(self._pick(p, rows, staging, kept)) for p in ("k", "v"))
        vq = None
        if "vq" in self.views:
            vq = staging.send(self._pick("vq", rows, staging, kept)).float()
        # float32 before they are spread over the tokens: one conversion per group, not per token
        if self.key_scales is not None:
            key_scales = self.key_scales().index_select(0, torch.from_numpy(groups))
        else:
            key_scales = self._pick("kq", groups, Staging())
        key_scales = key_scales.to(staging.device, non_blocking=True).float()
        # 1.5 bits: every group's channel order and scales made once for all the layers read
        prepared = vidkv.prepare(key_scales) if self.quant.mixed else None
        expand = torch.from_numpy(expand).to(staging.device, non_blocking=True)
        dtype = dtype or getattr(torch, self.kv_dtype)
        keys, values = [], []
        blank = None  # the layers that take no rows share one empty result (see _pick_each)
        for first, stop in zip(firsts.tolist(), ends.tolist()):
            if first == stop and blank is not None:
                keys.append(blank[0])
                values.append(blank[1])
                continue
            at = slice(first, stop)
            layer = dequantize(
                k[at],
                v[at],
                key_scales,
                expand[at],
                None if vq is None else vq[at],
                self.quant.bits,
                dtype,
                prepared,
            )
            keys.append(layer[0].transpose(0, 1))
            values.append(layer[1].transpose(0, 1))
            if first == stop:
                blank = keys[-1], values[-1]
        return keys, values, positions

    def _staged_rows(
        self, rows, totals, firsts, ends, staging: Staging, kept: dict | None
    ) -> tuple[list, list]:
        """Stored K/V rows (layer after layer in `rows`) on the staging's device, each layer a
        [H_kv, n, D] view. In one read, or (a large read bound for a GPU) a group of whole blocks
        at a time, each copied into its places while the next is read."""
        parts = ("k", "v")
        groups = staging.groups(rows, firsts, ends, sum(self._row_bytes(p) for p in parts))
        if groups is None:  # a buffer per layer: a caller joining layer by layer lets go of each
            layers = [rows[a:b] for a, b in zip(firsts.tolist(), ends.tolist())]
            read = {p: self._pick_each(p, layers, staging, kept) for p in parts}
            return tuple([t.transpose(0, 1) for t in sent_once(read[p], staging)] for p in parts)
        out: dict[str, list] = {}
        for part in parts:  # every layer's tensor on the device, filled group by group
            array, dtype = self.views[part]
            shape = array.shape[1:] if self.token_major else (array.shape[0], *array.shape[2:])
            out[part] = [
                torch.empty((n, *shape), dtype=getattr(torch, dtype), device=staging.device)
                for n in totals
            ]
        for slices in groups:
            cut = np.concatenate(
                [rows[f + a : f + b] for f, (a, b) in zip(firsts.tolist(), slices)]
            )
            for part in parts:
                read = self._pick(part, cut, staging)
                at = 0
                for layer, (a, b) in enumerate(slices):
                    out[part][layer][a:b].copy_(read[at : at + b - a], non_blocking=True)
                    at += b - a
        return tuple([t.transpose(0, 1) for t in out[p]] for p in parts)

    def read_in_groups(self, rows: int, device) -> bool:
        """Whether a read of `rows` token rows onto `device` goes in groups (large, stored as
        computed, bound for a GPU): its buffers are let go group by group, never kept."""
        kv_row = self._row_bytes("k") + self._row_bytes("v")
        return self.quant is None and Staging(device).in_groups(rows * kv_row)

    def _row_bytes(self, part: str) -> int:
        """Bytes of one token's row of a block tensor (its heads' channels)."""
        array = self.views[part][0]
        rows_axis = 0 if self.token_major else 1
        return array.itemsize * math.prod(n for i, n in enumerate(array.shape) if i != rows_axis)

    def _pick(
        self, part: str, rows: np.ndarray, staging: Staging, kept: dict | None = None
    ) -> torch.Tensor:
        """Rows `rows` of a block tensor, read out of the file into a buffer of `staging`'s."""
        return self._pick_each(part, [rows], staging, kept)[0]

    def _pick_each(
        self, part: str, rows: list[np.ndarray], staging: Staging, kept: dict | None = None
    ) -> list:
        """Rows rows[i] of a block tensor into a buffer of `staging`'s each, in one pass through
        the file (a stored tensor; one read after another for one held in memory). kept: where
        the buffers (numpy) are left under `part`."""
        array, dtype = self.views[part]
        if not self.token_major:
            array = np.swapaxes(array, 0, 1)
        # the layers that take no rows share one empty buffer: a retrieval inside the forward
        # reads one layer at a time, and each of the others cost a pinned buffer and a copy
        made = staging.buffers([len(r) for r in rows], array.shape[1:], array.dtype, dtype)
        outs = [out for out, _ in made]
        if isinstance(array, FileArray):
            array.take_each(rows, outs)
        else:
            for wanted, out in zip(rows, outs):
                array.take(wanted, 0, out)
        self.bytes_read += sum(out.nbytes for out in outs)
        if kept is not None:
            kept[part] = outs
        return [picked for _, picked in made]
