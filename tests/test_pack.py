"""The pack on disk: exact round trip, atomic writes, truncation and corruption caught."""

import json
import os
import stat
import struct

import pytest
import torch

from mmkv_cli.core.errors import OutputExistsError, PackError
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.integrity.hashing import REPS_CHUNK, chunk_digests
from mmkv_cli.pack.schema.header import LayoutRecord, MediaRecord
from tests.helpers import pack_header
from tests.mutants import Parts


def segment(name, counts, seed, dims=1, granularity=None):
    g = torch.Generator().manual_seed(seed)
    return Span(
        name=name,
        keys=[torch.randn(2, n, 8, generator=g) for n in counts],
        values=[torch.randn(2, n, 8, generator=g) for n in counts],
        positions=[torch.arange(n).expand(dims, -1).clone() for n in counts],
        granularity=granularity,
        steps=(seed, seed + 1) if granularity else None,
        time=(float(seed), float(seed) + 0.5) if granularity else None,
        representative=torch.randn(1, 16, generator=g) if granularity else None,
    )


HEADER = pack_header()


def write(path, force=False):
    blocks = [segment("b0", [3, 2, 1], 1, 3, "frame"), segment("b1", [4, 4, 0], 2, 3, "patch")]
    write_pack(
        path,
        HEADER,
        segment("prefix", [5, 5, 5], 0, 3),
        blocks,
        segment("suffix", [1, 1, 1], 9, 3),
        force=force,
    )
    return blocks


def test_round_trip_is_exact_with_per_layer_counts(tmp_path):
    path = tmp_path / "a.kvpack"
    blocks = write(path)
    reader = PackReader(path)
    assert [b["layer_counts"] for b in reader.blocks] == [[3, 2, 1], [4, 4, 0]]
    for original in blocks:
        loaded = reader.span(original.name)
        for a, b in zip(
            original.keys + original.values + original.positions,
            loaded.keys + loaded.values + loaded.positions,
        ):
            assert torch.equal(a, b)
        assert loaded.granularity == original.granularity and loaded.time == original.time
    assert torch.equal(reader.representatives(), torch.stack([b.representative for b in blocks]))


def test_reader_is_lazy(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    reader = PackReader(path)
    table = 2 * (7 + 3) * 4 + 2 * 2 * 8 + 2 * 32  # the block table (int32): rows, times, checksums
    assert reader.bytes_read == table
    reader.representatives()
    assert reader.bytes_read == table + 2 * 16 * 4  # and the representatives, nothing else
    reader.representatives()  # a session's next question: held, not read and hashed again
    assert reader.bytes_read == table + 2 * 16 * 4
    reader.span("b1")
    # b1's K and V, and its int32 positions (per layer: its layers keep different tokens)
    assert reader.bytes_read == table + 2 * 16 * 4 + 2 * (8 * 2 * 8 * 4) + 8 * 3 * 4


def test_header_does_not_grow_with_the_video(tmp_path):
    sizes = {}
    for count in (2, 2000):
        blocks = [segment(f"b{i}", [1], i, 1, "frame") for i in range(count)]
        path = tmp_path / f"{count}.kvpack"
        header = pack_header(1, media=MediaRecord(frames=count), layout=LayoutRecord(steps=count))
        series = {
            "media.timestamps": [i / 2 for i in range(count)],
            "layout.step_lengths": [1] * count,
        }
        write_pack(
            path,
            header,
            segment("prefix", [2], 0),
            blocks,
            segment("suffix", [1], 9),
            series=series,
        )
        with open(path, "rb") as fh:
            sizes[count] = struct.unpack("<Q", fh.read(8))[0]
        reader = PackReader(path)
        assert len(reader.blocks) == count and reader.blocks[-1]["time"] == [
            count - 1.0,
            count - 0.5,
        ]
        assert torch.equal(reader.span(f"b{count - 1}").keys[0], blocks[-1].keys[0])
        assert reader.series("media.timestamps") == series["media.timestamps"]
        assert reader.series("layout.step_lengths") == [1] * count
        assert reader.header.media == MediaRecord(frames=count)
    # the block table, timestamps and step lengths live in tensors, not in the JSON header
    assert sizes[2000] - sizes[2] < 512


def test_existing_output_is_kept_without_force(tmp_path):
    path = tmp_path / "a.kvpack"
    path.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="--force"):
        write(path)
    assert path.read_bytes() == b"precious"
    write(path, force=True)
    assert PackReader(path).blocks
    assert [p.name for p in tmp_path.iterdir()] == ["a.kvpack"]  # no temporary file left behind


def test_a_pack_gets_the_mode_of_any_new_file(tmp_path):
    old = os.umask(0o027)
    try:
        write(tmp_path / "a.kvpack")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.kvpack").stat().st_mode) == 0o640  # not safetensors' 0600


def test_truncated_pack_is_refused(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(PackError, match="truncated"):
        PackReader(path)
    path.write_bytes(data[:5])
    with pytest.raises(PackError):
        PackReader(path)


def corrupt_b1(path):
    """Flip a byte of block b1's keys."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + length])["blocks.k"]  # [tokens, H, D]: b1 after b0's 6 rows
    row = entry["shape"][1] * entry["shape"][2] * (4 if entry["dtype"] == "F32" else 2)
    data[8 + length + entry["data_offsets"][0] + 6 * row + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_large_read_is_hashed_beside_its_copy_and_by_the_reader_once_copied(
    tmp_path, monkeypatch
):
    import threading

    from mmkv_cli.pack.integrity.hashing import BlockHashes

    monkeypatch.setattr(
        "mmkv_cli.pack.access.reader.OVERLAP_BYTES", 0
    )  # this read goes the large way
    monkeypatch.setattr(
        "mmkv_cli.pack.integrity.hashing.PARALLEL_HASH_BLOCK_BYTES", 0
    )  # on threads
    monkeypatch.setattr("mmkv_cli.pack.integrity.hashing.RUN_BYTES", 0)  # a run a block
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    hashing_on, work = [], BlockHashes.work

    def watched(self):
        hashing_on.append(threading.current_thread() is threading.main_thread())
        work(self)

    monkeypatch.setattr(BlockHashes, "work", watched)
    path = tmp_path / "a.kvpack"
    blocks = write(path)
    keys, _, positions = PackReader(path).gather(["b1", "b0"])
    for layer in range(3):
        want = torch.cat([blocks[1].keys[layer], blocks[0].keys[layer]], dim=1)
        assert torch.equal(keys[layer], want)
    assert sorted(hashing_on) == [False, True]  # a helper thread, then the reader's own
    corrupt_b1(path)
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(path).gather(["b0", "b1"])


def test_a_failed_copy_is_raised_and_leaves_its_blocks_unchecked(tmp_path, monkeypatch):
    from mmkv_cli.pack.access.block_store import BlockStore

    monkeypatch.setattr("mmkv_cli.pack.access.reader.OVERLAP_BYTES", 0)  # hashed beside the copy
    monkeypatch.setattr("mmkv_cli.pack.integrity.hashing.PARALLEL_HASH_BLOCK_BYTES", 0)
    monkeypatch.setattr("mmkv_cli.pack.integrity.hashing.RUN_BYTES", 0)  # a run a block
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    path = tmp_path / "a.kvpack"
    write(path)
    corrupt_b1(path)
    reader = PackReader(path)
    with monkeypatch.context() as patch:

        def fails(*args):
            raise OSError("the disk went away")

        patch.setattr(BlockStore, "read_rows", fails)
        with pytest.raises(OSError, match="went away"):
            reader.gather(["b0", "b1"])
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        reader.gather(["b1"])  # the next read still checks it


@pytest.mark.parametrize("threaded", [False, True])
def test_corrupted_tensor_fails_its_checksum(tmp_path, monkeypatch, threaded):
    from mmkv_cli.pack.integrity import hashing

    pools = []
    if threaded:  # hash even this small read on threads, as a large real-model context is
        monkeypatch.setattr(hashing, "PARALLEL_HASH_BLOCK_BYTES", 0)
        monkeypatch.setattr(hashing, "RUN_BYTES", 0)  # a run a block
        monkeypatch.setattr("os.cpu_count", lambda: 4)
        pool = hashing._hashing.get()

        class Counted:  # the kept pool, its tasks counted
            def submit(self, work):
                pools.append(work)
                return pool.submit(work)

        monkeypatch.setattr(hashing._hashing, "get", Counted)
    path = tmp_path / "a.kvpack"
    write(path)
    corrupt_b1(path)
    reader = PackReader(path)
    reader.span("b0")  # untouched blocks still load
    assert len(reader.gather(["b0"])[0]) == 3
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        reader.span("b1")
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(path).gather(["b0", "b1"])
    # two blocks to check: a pool thread beside this one (b0 alone, checked first: this one)
    assert len(pools) == (1 if threaded else 0)


def test_gathered_blocks_equal_their_segments_joined_per_layer(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    reader = PackReader(path)
    keys, values, positions = reader.gather(["b1", "b0"])  # context order, not table order
    for layer in range(3):
        for got, part in ((keys, "keys"), (values, "values"), (positions, "positions")):
            want = torch.cat([getattr(reader.span(n), part)[layer] for n in ("b1", "b0")], dim=1)
            assert torch.equal(got[layer], want)
    with pytest.raises(PackError, match="no block b9"):
        reader.gather(["b9"])


def test_tampered_header_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'\\"budget\\": 1.0', b'\\"budget\\": 0.5'))
    with pytest.raises(PackError, match="header checksum"):
        PackReader(path)
    other = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(PackError, match="not a kvpack"):
        PackReader(other)
    with pytest.raises(PackError, match="no such pack"):
        PackReader(tmp_path / "missing.kvpack")


def test_block_table_columns_agree_with_its_rows_and_with_a_v2_json_table(tmp_path):
    from mmkv_cli.pack.schema.table import BlockTable, eligible_at

    path = tmp_path / "a.kvpack"
    write(path)
    table = PackReader(path).blocks
    rows = [table[i] for i in range(len(table))]
    assert [table.kinds[c] for c in table.codes()] == ["frame", "patch"] and [
        r["name"] for r in rows
    ] == ["b0", "b1"]
    assert table.start_times().tolist() == [1.0, 2.0] and table.layer_totals().tolist() == [
        [3, 2, 1],
        [4, 4, 0],
    ]
    assert eligible_at(table, 1.5).tolist() == [0] and eligible_at(table, None).tolist() == [0, 1]
    # a v2 pack kept the same rows as JSON in its header, under names of its own
    old = [{**r, "name": f"old{i}", "sha256": r["digest"]} for i, r in enumerate(rows)]
    v2 = BlockTable.from_dicts([{k: v for k, v in r.items() if k != "digest"} for r in old])
    assert [{**v2[i], "name": None} for i in range(2)] == [{**r, "name": None} for r in rows]
    assert v2.index_of("old1") == 1 and v2.index_of("b1") is None and table.index_of("b7") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks_read_back_exactly(tmp_path, dtype):
    def half(seg):
        seg.keys = [k.to(dtype) for k in seg.keys]
        seg.values = [v.to(dtype) for v in seg.values]
        return seg

    blocks = [
        half(segment("b0", [3, 2, 1], 1, 1, "frame")),
        half(segment("b1", [4, 4, 0], 2, 1, "frame")),
    ]
    write_pack(
        tmp_path / "h.kvpack",
        pack_header(3, str(dtype).replace("torch.", "")),
        half(segment("prefix", [5, 5, 5], 0)),
        blocks,
        half(segment("suffix", [1, 1, 1], 9)),
    )
    keys, values, _ = PackReader(tmp_path / "h.kvpack").gather(["b0", "b1"])
    for layer in range(3):
        assert keys[layer].dtype == dtype
        assert torch.equal(keys[layer], torch.cat([b.keys[layer] for b in blocks], dim=1))
        assert torch.equal(values[layer], torch.cat([b.values[layer] for b in blocks], dim=1))


def test_a_pack_is_a_valid_safetensors_file_that_the_library_reads_too(tmp_path):
    """The writer streams the file itself (blocks one at a time); safetensors must agree with it."""
    from safetensors import safe_open

    path = tmp_path / "a.kvpack"
    blocks = write(path)
    reader = PackReader(path)
    with safe_open(str(path), framework="pt") as lib:
        assert lib.metadata()["mmkv_sha256"] and set(lib.keys()) >= {"blocks.k", "reps", "prefix.k"}
        stored = lib.get_tensor("blocks.k")
        assert stored.shape[0] == sum(sum(b.layer_counts) for b in blocks)
        assert torch.equal(stored[:3].transpose(0, 1), blocks[0].keys[0])  # block 0, layer 0
        assert torch.equal(
            lib.get_tensor("blocks.blake3"), torch.from_numpy(reader.blocks.spans([0, 1])[2])
        )


def test_a_flipped_byte_in_the_representatives_fails_their_checksum(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    parts = Parts.of(path.read_bytes())
    start, _ = parts.directory["reps"]["data_offsets"]
    parts.data[start + 5] ^= 0x10
    path.write_bytes(parts.bytes())
    reader = PackReader(path)  # the table and the blocks are untouched
    assert len(reader.gather(["b0"])[0]) == 3
    with pytest.raises(PackError, match="checksum mismatch in reps"):
        reader.representatives()


def test_representatives_need_one_digest_per_chunk(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    parts = Parts.of(path.read_bytes())
    header = parts.header()
    assert header["integrity"]["reps"]["chunk"] == REPS_CHUNK
    assert len(header["integrity"]["reps"]["blake3"]) == 1  # 128 bytes: one chunk
    for digests in ([], header["integrity"]["reps"]["blake3"] * 2):
        header["integrity"]["reps"]["blake3"] = digests
        parts.set_header(header)
        path.write_bytes(parts.bytes())
        with pytest.raises(PackError, match="reps digests"):
            PackReader(path)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_chunk_digests_cover_each_chunk_on_threads(monkeypatch, algorithm):
    import hashlib

    import blake3

    reference = {"sha256": hashlib.sha256, "blake3": blake3.blake3}[algorithm]
    data = bytes(range(256)) * 1000  # 256,000 bytes: four chunks of 64 KiB, the last short
    serial = chunk_digests(memoryview(data), 1 << 16, algorithm)
    starts = range(0, len(data), 1 << 16)
    want = [reference(data[i : i + (1 << 16)]).hexdigest() for i in starts]
    assert serial == want and len(want) == 4
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert chunk_digests(memoryview(data), 1 << 16, algorithm) == want
    assert chunk_digests(memoryview(b""), 1 << 16, algorithm) == [reference(b"").hexdigest()]


def test_a_tensor_named_twice_in_the_directory_is_refused(tmp_path):
    path = tmp_path / "a.kvpack"
    write(path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + length].decode()
    entry = '"blocks.time":' + json.dumps(json.loads(text)["blocks.time"], separators=(",", ":"))
    twice = text.replace("{", "{" + entry + ",", 1)
    twice += " " * (-len(twice) % 8)
    path.write_bytes(struct.pack("<Q", len(twice)) + twice.encode() + raw[8 + length :])
    with pytest.raises(PackError, match="given twice"):
        PackReader(path)


@pytest.mark.parametrize("space", ["\t", "\n", "\r"])
def test_a_directory_padded_with_other_whitespace_is_refused(tmp_path, space):
    """The padding after the directory's JSON is covered by no checksum: spaces only (a pack
    written while it is encoded leaves up to 1 KiB of them), so a flipped padding byte is seen."""
    path = tmp_path / "a.kvpack"
    write(path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + length].rstrip(b" ") + b" " * 16  # the data 16 bytes on: still a pack
    padded = tmp_path / "padded.kvpack"
    padded.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    assert PackReader(padded).gather(["b0"])[0]
    flipped = text[:-5] + space.encode() + text[-4:]
    padded.write_bytes(struct.pack("<Q", len(flipped)) + flipped + raw[8 + length :])
    with pytest.raises(PackError, match="whitespace in its directory"):
        PackReader(padded)
    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app

    shown = CliRunner().invoke(app, ["inspect", str(padded)])
    assert shown.exit_code == 4 and "whitespace in its directory" in shown.output
    assert "Traceback" not in shown.output
