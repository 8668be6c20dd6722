"""A pack's bytes are handed on to the disk as they are written (pack/io/writeback.py): every
WRITEBACK_BYTES written, the ranges written since go to Linux's sync_file_range, so the fsync at
the end of an hour's pack finds little left to write."""

from __future__ import annotations

import torch

import mmkv_cli.pack.io.writeback as writeback
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.access.report import verify
from mmkv_cli.pack.quantized.quant import QuantSpec
from tests.helpers import pack_header

LAYERS, HEADS, DIM = 4, 2, 32


def span(name: str, tokens: int, seed: int, kind: str | None = "frame") -> Span:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(HEADS, tokens, DIM, generator=g) for _ in range(2 * LAYERS)]
    return Span(name, kv[:LAYERS], kv[LAYERS:], [torch.arange(tokens)[None]] * LAYERS,
                granularity=kind, steps=(seed, seed + 1) if kind else None)  # fmt: skip


def recorded(monkeypatch, threshold: int) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []

    def sync_file_range(fd, offset, nbytes, flags):
        assert flags == writeback.SYNC_FILE_RANGE_WRITE  # start the writes, never wait
        seen.append((offset, offset + nbytes))
        return 0

    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", threshold)
    monkeypatch.setattr(writeback, "_sync_file_range", lambda: sync_file_range)
    return seen


def blocks_extent(path) -> list[tuple[int, int]]:
    """Where each block tensor (K, V, positions, ...) lies in the file."""
    reader = PackReader(path)
    tensors = reader._tensors
    return [
        tuple(tensors.data_start + o for o in entry["data_offsets"])
        for name, entry in tensors.entries.items()
        if name.startswith("blocks.") and not name.endswith(".digest")
    ]


def test_the_blocks_bytes_are_handed_on_as_they_are_written(tmp_path, monkeypatch):
    """Lowered to 40 KB (a block here is 16 KB of K and V a part): the bytes go in many ranges,
    each inside one block tensor, none twice, together all of the blocks' K and V but the last
    few; the pack reads back and verifies."""
    seen = recorded(monkeypatch, 40_000)
    body = [span(f"b{i}", 16, i) for i in range(30)]
    path = tmp_path / "p.kvpack"
    header = pack_header(LAYERS, "float32", heads=HEADS, dim=DIM)
    write_pack(path, header, span("prefix", 2, 99, None), body, span("suffix", 1, 98, None))
    extents = blocks_extent(path)
    assert len(seen) > 10
    for first, stop in seen:
        assert any(a <= first < stop <= b for a, b in extents), (first, stop)
    handed = sorted(seen)
    assert all(a[1] <= b[0] for a, b in zip(handed, handed[1:]))  # no byte twice
    kv = sorted(extents, key=lambda e: e[1] - e[0])[-2:]  # K and V, the largest
    total = sum(stop - first for first, stop in seen)
    assert total >= sum(b - a for a, b in kv) - 3 * 40_000
    assert verify(path)["ok"]
    keys, values, _ = PackReader(path).gather([b.name for b in body])
    assert torch.equal(keys[2], torch.cat([b.keys[2] for b in body], dim=1))


def test_a_quantized_packs_parts_are_handed_on_too(tmp_path, monkeypatch):
    """Four parts of a block (codes, scales, positions) written side by side in their tensors."""
    seen = recorded(monkeypatch, 8_000)
    body = [span(f"b{i}", 16, i) for i in range(20)]
    path = tmp_path / "q.kvpack"
    header = pack_header(LAYERS, "float32", heads=HEADS, dim=DIM)
    write_pack(path, header, span("prefix", 2, 99, None), body, span("suffix", 1, 98, None),
               quant=QuantSpec(4, 16))  # fmt: skip
    extents = blocks_extent(path)
    assert len({next(i for i, (a, b) in enumerate(extents) if a <= f < b) for f, _ in seen}) >= 3
    assert verify(path)["ok"]


def test_without_sync_file_range_the_fsync_writes_alone(tmp_path, monkeypatch):
    """Another system's C library has none: nothing is handed on, the pack is whole."""
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(writeback, "_sync_file_range", lambda: None)
    path = tmp_path / "p.kvpack"
    header = pack_header(LAYERS, "float32", heads=HEADS, dim=DIM)
    body = [span(f"b{i}", 8, i) for i in range(5)]
    write_pack(path, header, span("prefix", 2, 99, None), body, span("suffix", 1, 98, None))
    assert verify(path)["ok"]


def test_a_write_away_from_where_its_part_left_off_hands_on_what_came_before(monkeypatch):
    seen = recorded(monkeypatch, 1 << 30)

    class File:
        def flush(self) -> None: ...

        def fileno(self) -> int:
            return 7

    back = writeback.WriteBack(File())
    back.wrote(0, 100, 50)
    back.wrote(0, 150, 50)  # goes on: one range
    back.wrote(1, 1000, 10)
    assert seen == []
    back.wrote(0, 500, 20)  # elsewhere: [100, 200) goes now
    assert seen == [(100, 200)]
