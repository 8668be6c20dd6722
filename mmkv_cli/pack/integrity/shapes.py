"""Every tensor of a pack has the dtype and shape its header and block table say (v3 on), and the
table agrees with itself: checked on open, before any count from the file sizes an allocation.

Formats before v7 carry no digest over their table, times or directory, so these checks are all
that stands between a flipped bit there and a read that allocates from it; they are the same
checks v7 and v8 get, in each version's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack.integrity.checks import KV_DTYPES, STORED_KV_DTYPES, check_kv_shape
from mmkv_cli.pack.integrity.hashing import chunk_count
from mmkv_cli.pack.schema.format import (
    BLOCKS,
    EMBEDS,
    OLD_TABLE_COLUMNS,
    TABLE_COLUMNS,
    digest_name,
)
from mmkv_cli.pack.schema.header import KVShape


@dataclass(frozen=True)
class Layout:
    """Where a format version keeps what."""

    token_major: bool  # K/V [tokens, heads, dim] and positions [tokens, P] (v4 on)
    positions: str  # the positions' dtype
    shared_positions: bool  # a span may store one layer's positions for all (v7 on)
    columns: int  # the block table's columns before the layer counts
    integers: tuple[str, ...]  # dtypes the table and the tokens per step may have
    reps_per_layer: bool  # representatives [blocks, layers, dim] (v6 on), else [blocks, dim]
    reps_in_kv_dtype: bool  # in the KV's dtype (v7 on), else float32


def layout(version: int) -> Layout:
    current = version >= 7
    return Layout(
        token_major=version >= 4,
        positions="I32" if current else "I64",
        shared_positions=current,
        columns=TABLE_COLUMNS if current else OLD_TABLE_COLUMNS,
        integers=("I64", "I32") if version >= 8 else ("I64",),
        reps_per_layer=version >= 6,
        reps_in_kv_dtype=current,
    )


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise PackError(f"{where} is corrupted ({what})")


def expect(entries: dict, name: str, dtype: str | tuple, shape: list, where: str) -> None:
    """Tensor `name` exists with this dtype and shape (None in `shape`: any size there)."""
    entry = entries.get(name)
    _need(entry is not None, where, f"tensor {name} missing")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    got = entry["shape"]
    fits = len(got) == len(shape) and all(w is None or w == g for w, g in zip(shape, got))
    _need(entry["dtype"] in dtypes and fits, where, f"tensor {name} is not {dtypes[0]} {shape}")


def check_table(
    rows: np.ndarray, times: np.ndarray, group: int, form: Layout, where: str, span: bool = False
) -> dict:
    """The block table against itself: every offset the running sum the writer makes, counts and
    steps in range. Returns the rows each block tensor must have. span: key groups run across the
    blocks (v9): the key-group column is 0 and each layer's run has ceil(tokens / group)."""
    counts = rows[:, form.columns :]
    _need((counts >= 0).all() and (rows[:, 0] >= 0).all(), where, "negative table entries")
    totals = counts.sum(axis=1)
    _need(np.array_equal(rows[:, 3], np.cumsum(totals) - totals), where, "table offsets")
    position_rows, groups = totals, np.zeros_like(totals)
    if form.columns == TABLE_COLUMNS:
        shared = rows[:, 5]
        _need(np.isin(shared, (0, 1)).all(), where, "table flags")
        same = (counts == counts[:, :1]).all(axis=1)
        _need(same[shared == 1].all(), where, "shared positions with unequal layer counts")
        position_rows = np.where(shared == 1, counts[:, 0], totals)
        _need(
            np.array_equal(rows[:, 4], np.cumsum(position_rows) - position_rows),
            where,
            "table position offsets",
        )
        if span:
            _need(not rows[:, 6].any(), where, "table key groups")
            groups = -(-counts.sum(axis=0) // group)
        else:
            if group:
                groups = (-(-counts // group)).sum(axis=1)
            _need(np.array_equal(rows[:, 6], np.cumsum(groups) - groups), where, "table key groups")
    first, stop = rows[:, 1], rows[:, 2]
    _need(((first == -1) & (stop == -1) | (first >= 0) & (stop >= first)).all(), where, "steps")
    _need(not np.isinf(times).any(), where, "block times")
    return {
        "tokens": int(totals.sum()),
        "positions": int(position_rows.sum()),
        "groups": int(groups.sum()),
    }


def _kv(form: Layout, tokens: int, kv: KVShape) -> list:
    return (
        [tokens, kv.kv_heads, kv.head_dim]
        if form.token_major
        else [kv.kv_heads, tokens, kv.head_dim]
    )


def _positions(form: Layout, rows: int, dims: int | None) -> list:
    return [rows, dims] if form.token_major else [dims, rows]


def digest_shape(header: dict, kv: KVShape, count: int, where: str) -> list[int]:
    """The shape of the blocks' digests: one a block before v12; from it one per run of
    `digest_layers` stored layers, which must cut the layers evenly."""
    if header["format_version"] < 12:
        return [count, 32]
    runs = header["blocks"]["digest_layers"]
    _need(kv.layers % runs == 0, where, "blocks.digest_layers")
    return [count, kv.layers // runs, 32]


def check_tensors(
    header: dict, entries: dict, spans: dict, table, quant, kv: KVShape, version: int, where: str
) -> None:
    """Every tensor's dtype and shape as the header, the KV shape and the table say: nothing is
    allocated from a count that the tensors do not bear out."""
    form = layout(version)
    code = KV_DTYPES[kv.dtype]
    dims = (header.get("layout") or {}).get("position_dims")
    for name in ("prefix", "suffix"):
        meta = spans[name]
        counts = meta["layer_counts"]
        _need(len(counts) == kv.layers, where, f"{name} counts")
        shared = form.shared_positions and meta.get("shared_positions")
        _need(not shared or len(set(counts)) == 1, where, f"positions of {name}")
        for part in ("k", "v"):
            expect(entries, f"{name}.{part}", code, _kv(form, sum(counts), kv), where)
        rows = counts[0] if shared else sum(counts)
        expect(entries, f"{name}.pos", form.positions, _positions(form, rows, dims), where)
    for name, stored in (("media.timestamps", "F64"), ("layout.step_lengths", form.integers)):
        if name in entries:
            expect(entries, name, stored, [None], where)
    count = len(table)
    _need(count == header["blocks"]["count"], where, "block count")
    # before the early return: a forged pack of no blocks may still claim representatives
    _check_reps(header, entries, count, kv, form, where)
    _check_embeds(header, entries, table, where)
    if not count:
        return
    expect(entries, f"{BLOCKS}.table", form.integers, [count, form.columns + kv.layers], where)
    expect(entries, f"{BLOCKS}.time", "F64", [count, 2], where)
    digests = digest_shape(header, kv, count, where)
    expect(entries, f"{BLOCKS}.{digest_name(version)}", "U8", digests, where)
    _need((table.codes() < len(header["blocks"]["granularities"])).all(), where, "granularities")
    span = quant is not None and quant.span
    _need(span == (quant is not None and version >= 9), where, "quantization header")
    sizes = check_table(table.rows(), table.times(), quant.group if quant else 0, form, where, span)
    widths = (quant.key_width(kv.head_dim), quant.value_width(kv.head_dim)) if quant else None
    for part, width in zip(("k", "v"), widths or (kv.head_dim,) * 2):
        stored = KVShape(kv.layers, kv.kv_heads, width, kv.dtype)
        expect(
            entries,
            f"{BLOCKS}.{part}",
            "U8" if quant else code,
            _kv(form, sizes["tokens"], stored),
            where,
        )
    expect(
        entries, f"{BLOCKS}.pos", form.positions, _positions(form, sizes["positions"], dims), where
    )
    if quant:
        heads, dim = kv.kv_heads, kv.head_dim
        groups = heads * dim // quant.value_group(heads, dim)
        planes = [sizes["groups"], quant.key_planes, heads, dim]
        expect(entries, f"{BLOCKS}.kq", "F16", planes, where)
        if not quant.mixed:  # 1.5 bits: the values' scales are the key groups' fourth plane
            expect(entries, f"{BLOCKS}.vq", "F16", [sizes["tokens"], groups, 2], where)
        if span:  # every byte of them covered: a digest per chunk
            digest = header["integrity"].get("key_scales")
            start, stop = entries[f"{BLOCKS}.kq"]["data_offsets"]
            chunks = chunk_count(stop - start, digest["chunk"]) if digest else -1
            counted = digest is not None and len(digest[digest_name(version)]) == chunks
            _need(counted, where, "key scale digests")


def _check_reps(header: dict, entries: dict, count: int, kv: KVShape, form: Layout, where: str):
    reps = header.get("representatives")
    if not reps:
        return
    width = kv.kv_heads * kv.head_dim
    _need(reps["dim"] == width, where, "representatives")
    dtype = KV_DTYPES[kv.dtype] if form.reps_in_kv_dtype else "F32"
    if not form.reps_per_layer:
        expect(entries, "reps", dtype, [count, width], where)
        return
    stored = reps.get("layers")
    _need(stored in (1, kv.layers), where, "representatives")
    expect(entries, "reps", dtype, [count, stored, width], where)
    version = header["format_version"]
    if version >= 8:  # every byte of them covered: a digest per chunk
        digest = header["integrity"].get("reps")
        start, stop = entries["reps"]["data_offsets"]
        chunks = chunk_count(stop - start, digest["chunk"]) if digest else -1
        counted = digest is not None and len(digest[digest_name(version)]) == chunks
        _need(counted, where, "reps digests")


def _check_embeds(header: dict, entries: dict, table, where: str) -> None:
    """v13's embeddings: one float16 row a token of each block's first layer, every byte under a
    digest; never in a pack held per head (its heads keep tokens of their own)."""
    embeds = header.get("embeddings")
    if not embeds:
        return
    _need(not (header.get("kv") or {}).get("per_head"), where, "embeddings")
    tokens = int(table.first_layer_starts()[-1])
    expect(entries, EMBEDS, "F16", [tokens, embeds["dim"]], where)
    digest = header["integrity"][EMBEDS]
    start, stop = entries[EMBEDS]["data_offsets"]
    counted = len(digest[digest_name(header["format_version"])]) == chunk_count(
        stop - start, digest["chunk"]
    )
    _need(counted, where, "embeds digests")


def kv_shape_of(stored: dict, entries: dict, layers: int, token_major: bool, where: str) -> KVShape:
    """The KV's layers, heads, width and dtype: as the header says (v7 on, checked against every
    tensor); older headers may not say, and the prefix's keys tell (`layers`: its layer counts),
    within the same bounds."""
    kv = stored.get("kv") or {}
    entry = entries.get("prefix.k")
    shape = entry["shape"] if entry is not None else []
    _need(len(shape) == 3 and entry["dtype"] in STORED_KV_DTYPES, where, "prefix keys")
    found = KVShape(
        layers=kv.get("layers", layers),
        kv_heads=kv.get("kv_heads", shape[1] if token_major else shape[0]),
        head_dim=kv.get("head_dim", shape[2]),
        dtype=kv.get("dtype", STORED_KV_DTYPES[entry["dtype"]]),
        per_head=kv.get("per_head", False),
    )
    check_kv_shape(found, where)
    return found
