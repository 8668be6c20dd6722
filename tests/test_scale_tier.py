"""Sizes a real pack reaches and a one-layer test pack never does (docs/scale-tests.md).

A 7B pack's representatives are 28 layers x 512 channels a block (28 KiB in float16): they pass the
4 MiB digest chunk at about 147 blocks. These packs are built at that real size, or with the
threshold lowered where the real size would cost minutes, and each crosses its threshold by at
least two steps. A failure here is the kind only a user's hour of video would otherwise show.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from blake3 import blake3

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.access.report import verify
from mmkv_cli.pack.integrity.hashing import REPS_CHUNK, chunk_count, chunk_digests
from mmkv_cli.pack.io import vectored
from mmkv_cli.pack.quantized.quant import QuantSpec
from tests.helpers import capped_rows, pack_header
from tests.mutants import Parts
from tests.scale_shapes import DIM, HEADS, LAYERS, block, plain


def write_7b(path, blocks: int, tokens: int = 1, quant=None, layers: int = LAYERS, keys=None):
    header = pack_header(layers=layers, dtype="float16", heads=HEADS, dim=DIM)
    spans = [block(f"b{i}", tokens, i, layers, keys) for i in range(blocks)]
    write_pack(path, header, plain("prefix", 2, layers), spans, plain("suffix", 1, layers), False,
               quant)  # fmt: skip
    return spans


@pytest.fixture(scope="module")
def reps_pack(tmp_path_factory):
    """320 blocks at 7B width: 8.75 MiB of representatives, three 4 MiB digest chunks."""
    path = tmp_path_factory.mktemp("scale") / "reps.kvpack"
    spans = write_7b(path, 320)
    return path, spans


def test_representatives_past_two_digest_chunks_open_and_verify(reps_pack):
    path, spans = reps_pack
    header = Parts.of(path.read_bytes()).header()
    digests = header["integrity"]["reps"]["blake3"]
    reps_bytes = 320 * LAYERS * HEADS * DIM * 2
    assert reps_bytes > 2 * REPS_CHUNK and len(digests) == chunk_count(reps_bytes, REPS_CHUNK) == 3
    reader = PackReader(path)
    reps = reader.representatives()
    assert torch.equal(reps, torch.stack([s.representative for s in spans]))
    assert verify(path)["ok"]


def test_a_flipped_byte_in_the_last_reps_chunk_is_caught(reps_pack, tmp_path):
    path, _ = reps_pack
    parts = Parts.of(path.read_bytes())
    start, stop = parts.directory["reps"]["data_offsets"]
    parts.data[stop - 3] ^= 0x01  # in the third chunk: a one-digest reader would miss which
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="checksum mismatch in reps"):
        PackReader(bad).representatives()
    assert not verify(bad)["ok"]


def test_chunk_digests_cut_a_shaped_array_by_bytes_not_rows():
    rows = np.arange(3 * 70_000, dtype=np.float16).reshape(3, 70_000)  # 140,000 bytes a row
    flat = rows.tobytes()
    want = [blake3(flat[i : i + (1 << 16)]).hexdigest() for i in range(0, len(flat), 1 << 16)]
    assert len(want) == 7
    assert chunk_digests(rows, 1 << 16, "blake3") == chunk_digests(flat, 1 << 16, "blake3") == want
    assert chunk_digests(memoryview(rows), 1 << 16, "blake3") == want
    empty = np.zeros((0, 4), np.float16)
    assert chunk_digests(empty, 1 << 16, "blake3") == [blake3().hexdigest()]


def test_spanning_key_scales_past_two_digest_chunks(tmp_path, monkeypatch):
    """v9's key scales cross the chunk (lowered to its floor, 64 KiB) by more than two steps: 2-bit
    keys in groups of 16 tokens over 28 layers of 40 tokens make 84 groups of 2 KiB."""
    monkeypatch.setattr("mmkv_cli.pack.access.writer.REPS_CHUNK", 1 << 16)
    path = tmp_path / "q.kvpack"
    spans = write_7b(path, 4, tokens=10, quant=QuantSpec(2, 16))
    header = Parts.of(path.read_bytes()).header()
    digest = header["integrity"]["key_scales"]
    start, stop = Parts.of(path.read_bytes()).directory["blocks.kq"]["data_offsets"]
    assert digest["chunk"] == 1 << 16 and stop - start > 2 * (1 << 16)
    assert len(digest["blake3"]) == chunk_count(stop - start, 1 << 16) >= 3
    reader = PackReader(path)
    keys, _, _ = reader.gather([s.name for s in spans])
    want = torch.cat([s.keys[LAYERS - 1] for s in spans], dim=1).float()
    assert (keys[LAYERS - 1].float() - want).abs().max() < 1.5  # 2-bit: within a step of the range
    assert verify(path)["ok"]
    parts = Parts.of(path.read_bytes())
    parts.data[stop - 5] ^= 0x01
    (tmp_path / "bad.kvpack").write_bytes(parts.bytes())
    assert verify(tmp_path / "bad.kvpack")["faults"] == ["key scales: checksum mismatch"]


@pytest.mark.parametrize(
    "blocks, tokens, layers, keys, path_taken",
    [
        (52, 7, LAYERS, None, "as read"),  # a digest a layer of 14 KiB: one thread
        (12, 36, LAYERS, None, "as read"),  # 72 KiB: on threads
        (1100, 1, 8, 1, "before"),  # a digest a block of 8 layers, 16 KiB: one thread, first
        (12, 36, LAYERS, 1, "beside"),  # 2 MiB a digest: on threads beside the copy
    ],
)
def test_a_context_past_the_overlap_threshold_reads_back_exactly(
    tmp_path, monkeypatch, blocks, tokens, layers, keys, path_taken
):
    """Every read here passes two steps of the 8 MiB of K/V at which one is hashed on threads
    beside the copy. With a digest a layer (v12: the pack keeps a retrieval key per layer) a
    unit is one run of the read, and is hashed on the bytes read, after it: on one thread under
    the 32 KiB where threads pay (below it a unit's Python costs as much as its hashing, all of it
    holding the GIL), on several past it (both by two steps). With a digest a block, units of 16
    KiB are hashed from the file on one thread before the read, units of 2 MiB on threads beside
    it."""
    from mmkv_cli.pack.access.reader import OVERLAP_BYTES
    from mmkv_cli.pack.integrity import hashing
    from mmkv_cli.pack.integrity.hashing import PARALLEL_HASH_BLOCK_BYTES

    path = tmp_path / "p.kvpack"
    spans = write_7b(path, blocks, tokens=tokens, layers=layers, keys=keys)
    kv_bytes = sum(2 * t.numel() * t.element_size() for s in spans for t in s.keys)
    per_digest = kv_bytes // (blocks * (layers if keys is None else 1))
    assert kv_bytes > 2 * OVERLAP_BYTES
    threaded = per_digest > 2 * PARALLEL_HASH_BLOCK_BYTES
    assert threaded or 2 * per_digest <= PARALLEL_HASH_BLOCK_BYTES
    threads: list[int] = []
    counted = hashing.BlockHashes.threads
    monkeypatch.setattr(
        hashing.BlockHashes, "threads", lambda self: threads.append(counted(self)) or threads[-1]
    )
    taken: list[str] = []
    monkeypatch.setattr(
        "mmkv_cli.pack.access.reader.hashed_beside",
        lambda hashes, read: taken.append("beside") or hashing.hashed_beside(hashes, read),
    )
    from_read = hashing.BlockHashes.read_from
    monkeypatch.setattr(
        hashing.BlockHashes,
        "read_from",
        lambda self, *a: taken.append("as read") or from_read(self, *a),
    )
    from mmkv_cli.pack.integrity import read_units

    joined: list[bool] = []
    runs = read_units.ReadUnits.runs
    monkeypatch.setattr(
        read_units.ReadUnits, "runs", lambda self, n: joined.append(self.joined) or runs(self, n)
    )
    keys_read, values, positions = PackReader(path).gather([s.name for s in spans])
    assert taken == ([] if path_taken == "before" else [path_taken])
    # hashed as read: units of 64 KiB or less in stretches joined side by side, larger a part
    # at a time
    want = [per_digest <= read_units.JOIN_BYTES] if path_taken == "as read" else []
    assert joined == want
    if threaded:
        assert threads and min(threads) > 1 or (os.cpu_count() or 1) < 2
    else:
        assert set(threads) == {1}
    for layer in (0, layers - 1):
        assert torch.equal(keys_read[layer], torch.cat([s.keys[layer] for s in spans], dim=1))
        assert torch.equal(values[layer], torch.cat([s.values[layer] for s in spans], dim=1))
        assert torch.equal(positions[layer], torch.cat([s.positions[layer] for s in spans], dim=1))
    # b1's first K row flipped; a NaN forged (re-sealed) into the last block's last V row: each
    # refused by its name, the NaN by the checksums' threads, from the bytes they hash
    rows = blocks * tokens * layers
    bad = flipped_and_forged(path, tmp_path / "bad.kvpack", tokens * layers, rows - 1, b"\x00\x7e")
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(bad).gather([s.name for s in spans])
    with pytest.raises(PackError, match=f"NaN or Inf in the K/V of {spans[-1].name}"):
        PackReader(bad).gather([s.name for s in spans if s.name != "b1"])


def test_a_layer_at_full_depth_checks_its_own_digests(reps_pack, tmp_path):
    """28 layers at 7B width: a flip in the last layer of one block leaves every other layer's
    retrieval of it readable, and is refused where layer 27 reads it and named by verify."""
    path, spans = reps_pack
    parts = Parts.of(path.read_bytes())
    assert parts.directory["blocks.blake3"]["shape"] == [320, LAYERS, 32]
    start, _ = parts.directory["blocks.k"]["data_offsets"]
    row = 300 * LAYERS + LAYERS - 1  # block b300's one token at layer 27
    parts.data[start + row * HEADS * DIM * 2 + 9] ^= 0x02
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    reader = PackReader(bad)
    for layer in range(LAYERS - 1):
        keys, *_ = reader.gather(["b300"], [["b300"] if i == layer else [] for i in range(LAYERS)])
        assert torch.equal(keys[layer], spans[300].keys[layer])
    with pytest.raises(PackError, match="checksum mismatch in b300"):
        reader.gather(["b300"], [["b300"] if i == LAYERS - 1 else [] for i in range(LAYERS)])
    assert verify(bad)["faults"] == ["block b300: checksum mismatch"]


def flipped_and_forged(path, out, flip_row: int, forged_row: int, value: bytes):
    """`path` with a bit of K row `flip_row` flipped, and V row `forged_row` starting with the
    float16 `value` (NaN or Inf) under a re-sealed checksum, as a forger would: written to `out`."""
    from tests.mutants import _reseal_block

    parts = Parts.of(path.read_bytes())
    row = HEADS * DIM * 2  # float16
    k_start = parts.directory["blocks.k"]["data_offsets"][0]
    parts.data[k_start + flip_row * row + 3] ^= 0x10
    at = parts.directory["blocks.v"]["data_offsets"][0] + forged_row * row
    parts.data[at : at + 2] = value
    _reseal_block(parts, parts.header(), "blocks.v", forged_row)
    parts.reseal()
    out.write_bytes(parts.bytes())
    return out


def test_verify_past_two_chunks_of_blocks_names_each_fault_once(tmp_path):
    """verify checks VERIFY_BLOCKS (1,024) blocks at a time; an hour at a block a frame is 3,600 or
    more. 2,100 blocks (one token, one layer at 7B width): a flipped byte in the second chunk
    and a forged NaN (its checksum re-sealed) in the third are each named once, by their own
    block's name; every block reads back."""
    from mmkv_cli.pack.access.reader import VERIFY_BLOCKS

    path = tmp_path / "many.kvpack"
    spans = write_7b(path, 2100, layers=1)
    assert len(spans) > 2 * VERIFY_BLOCKS
    keys, values, _ = PackReader(path).gather([s.name for s in spans])
    assert torch.equal(keys[0], torch.cat([s.keys[0] for s in spans], dim=1))
    assert torch.equal(values[0], torch.cat([s.values[0] for s in spans], dim=1))
    bad = flipped_and_forged(path, tmp_path / "bad.kvpack", 1030, 2090, b"\x00\x7e")  # a NaN
    assert verify(bad)["faults"] == [
        "block b1030: checksum mismatch",
        "block b2090: NaN or Inf in its K/V",
    ]


@pytest.mark.parametrize("rows_a_piece", [1, 3, 40])
def test_blocks_hashed_through_a_kept_buffer_in_pieces(tmp_path, monkeypatch, rows_a_piece):
    """A block's rows are hashed SCRATCH_BYTES (8 MiB) at a time through a buffer each thread
    keeps: one frame's K at 7B is 5.5 MB, a block of many frames far more. Lowered to a few rows,
    so a block's 28 per-layer digests (v12) straddle the pieces' edges: every block reads back,
    `verify` passes, and a flip and a forged Inf in a block's last piece are each named once."""
    from mmkv_cli.pack.integrity import hashing

    path = tmp_path / "p.kvpack"
    spans = write_7b(path, 6, tokens=5)  # 5 x 28 = 140 rows a block
    row = HEADS * DIM * 2
    monkeypatch.setattr(hashing, "SCRATCH_BYTES", rows_a_piece * row)
    reader = PackReader(path)
    for layer in (0, 13, LAYERS - 1):  # a layer's own digests, read alone
        keys, *_ = reader.gather(["b4"], [["b4"] if i == layer else [] for i in range(LAYERS)])
        assert torch.equal(keys[layer], spans[4].keys[layer])
    keys, values, _ = PackReader(path).gather([s.name for s in spans])
    assert torch.equal(values[LAYERS - 1], torch.cat([s.values[-1] for s in spans], dim=1))
    assert verify(path)["ok"]
    # b2's last row and an Inf in b5's: each in its block's last piece
    bad = flipped_and_forged(
        path, tmp_path / "bad.kvpack", 2 * 140 + 139, 5 * 140 + 137, b"\x00\x7c"
    )
    assert verify(bad)["faults"] == [
        "block b2: checksum mismatch",
        "block b5: NaN or Inf in its K/V",
    ]
    with pytest.raises(PackError, match="checksum mismatch in b2"):
        PackReader(bad).gather(["b2"], [["b2"] if i == LAYERS - 1 else [] for i in range(LAYERS)])
    keys, *_ = PackReader(bad).gather(["b2"], [["b2"] if i == 0 else [] for i in range(LAYERS)])
    assert torch.equal(keys[0], spans[2].keys[0])  # its other layers' digests still hold


def test_a_context_read_in_several_staging_groups_reads_back_exactly(reps_pack, monkeypatch):
    """A large read bound for a GPU goes in groups of whole blocks cut in file order (64 MiB at
    real size; pack/io/staging.py), each copied into its places in every layer. Lowered to 1 MiB
    (and let on the CPU), this 7B-width context, each layer with blocks of its own, is read in more
    than three groups, and every layer reads back exact."""
    from mmkv_cli.pack.io import staging

    monkeypatch.setattr(staging, "HOST_STAGE_BYTES", 1 << 20)
    made: list[int] = []
    groups = staging.Staging.groups
    monkeypatch.setattr(
        staging.Staging,
        "groups",
        lambda self, *a: (lambda g: made.append(len(g or [])) or g)(groups(self, *a)),
    )
    path, spans = reps_pack
    names = [s.name for s in spans]
    per_layer = [names[layer % 3 :: 1 + layer % 4] for layer in range(LAYERS)]
    keys, values, positions = PackReader(path).gather(names, per_layer, "cpu")
    assert len(made) == 1 and made[0] > 3
    by_name = {s.name: s for s in spans}
    for layer, chosen in enumerate(per_layer):
        for got, part in ((keys, "keys"), (values, "values"), (positions, "positions")):
            want = torch.cat([getattr(by_name[n], part)[layer] for n in chosen], dim=1)
            assert torch.equal(got[layer], want), (layer, part)


def test_staging_groups_cut_the_read_in_file_order():
    """Two layers of blocks of two tokens: block b's rows are 4b..4b+3, layer 0's first."""
    import numpy as np

    from mmkv_cli.pack.io import staging

    rows = np.array([0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11])
    firsts, ends = np.array([0, 6]), np.array([6, 12])
    cpu, gpu = staging.Staging("cpu"), staging.Staging("cuda")
    assert not cpu.pinned and cpu.groups(rows, firsts, ends, 1 << 30) is None  # the CPU: one read
    assert gpu.pinned and gpu.stage_bytes == staging.STAGE_BYTES
    gpu.stage_bytes = 4
    assert gpu.groups(rows, firsts, ends, 1) == [
        [(0, 2), (0, 2)],
        [(2, 4), (2, 4)],
        [(4, 6), (4, 6)],
    ]
    assert gpu.groups(rows, firsts, ends, 1)[1] == [(2, 4), (2, 4)]
    assert gpu.groups(rows[::-1].copy(), firsts, ends, 1) is None  # out of file order: one read
    gpu.stage_bytes = 12
    assert gpu.groups(rows, firsts, ends, 1) is None  # small: one read


@pytest.mark.parametrize(
    ("low", "high", "dtype"),
    [
        (0, 2**31 - 1, torch.int32),
        (-(2**31), 0, torch.int32),
        (0, 2**31, torch.int64),  # one past: kept wide
        (-(2**31) - 1, 0, torch.int64),
        (0, 2**33, torch.int64),  # two steps past
    ],
)
def test_tables_narrow_to_int32_only_when_every_value_fits(low, high, dtype):
    from mmkv_cli.pack.access.writer import narrowed

    out = narrowed(torch.tensor([low, high], dtype=torch.int64))
    assert out.dtype == dtype and out.tolist() == [low, high]


def test_positions_at_the_int32_edge_round_trip_and_past_it_are_refused(tmp_path):
    """A stream's positions are stored int32: the last one that fits reads back exact, one past
    the edge is refused in one line before anything is written, and one below 0 where it is read
    (issue 74)."""
    edge = 2**31 - 1
    layers = 2

    def at(first: int) -> Span:
        span = block("b0", 3, 1, layers)
        span.positions = [torch.arange(first, first + 3).expand(3, -1)] * layers
        return span

    header = pack_header(layers=layers, dtype="float16", heads=HEADS, dim=DIM)
    path = tmp_path / "edge.kvpack"
    write_pack(path, header, plain("prefix", 2, layers), [at(edge - 2)], plain("suffix", 1, layers))
    _, _, positions = PackReader(path).gather(["b0"])
    assert positions[0][0].tolist() == [edge - 2, edge - 1, edge]
    low = tmp_path / "low.kvpack"  # the int32 floor is stored, but no position is below 0
    write_pack(low, header, plain("prefix", 2, layers), [at(-(2**31))], plain("suffix", 1, layers))
    with pytest.raises(PackError, match="a position of the blocks read outside 0 or more"):
        PackReader(low).gather(["b0"])
    past = tmp_path / "past.kvpack"
    with pytest.raises(PackError, match="does not fit 32 bits"):
        write_pack(past, header, plain("prefix", 2, layers), [at(edge)], plain("suffix", 1, layers))
    assert not past.exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_stored_values_are_checked_finite_by_their_exponent_bits(dtype):
    from mmkv_cli.pack.integrity.finite import finite_stored

    big = torch.finfo(getattr(torch, dtype)).max
    values = torch.tensor([0.0, -1.5, big, -big], dtype=getattr(torch, dtype))
    as_stored = values.view(torch.uint16).numpy() if dtype == "bfloat16" else values.numpy()
    assert finite_stored(as_stored, dtype)
    for bad in (float("inf"), float("-inf"), float("nan")):
        broken = values.clone()
        broken[1] = bad
        stored = broken.view(torch.uint16).numpy() if dtype == "bfloat16" else broken.numpy()
        assert not finite_stored(stored, dtype), (dtype, bad)
    assert finite_stored(np.arange(4, dtype=np.int32), "int32")


def test_reads_longer_than_one_preadv_returns_are_finished_by_the_loop(reps_pack, monkeypatch):
    """Linux returns at most 2 GiB - 4 KiB from one preadv; the reader loops over short reads.
    The cap lowered to 4099 bytes (an odd size, so reads stop inside a buffer and a row)."""
    import os

    path, spans = reps_pack
    want = PackReader(path).gather([s.name for s in spans[:40]])
    real, real_table, calls = os.preadv, vectored.preadv, []

    def capped(fd, buffers, offset):
        left, cut = 4099, []
        for buffer in buffers:
            if left <= 0:
                break
            cut.append(memoryview(buffer)[:left])
            left -= len(cut[-1])
        calls.append(offset)
        return real(fd, cut, offset)

    def capped_table(fd, address, count, offset):  # a scattering read's pieces, cut the same
        cut = capped_rows(address, count, 4099)
        calls.append(offset)
        return real_table(fd, cut.ctypes.data, len(cut), offset)

    monkeypatch.setattr("mmkv_cli.pack.integrity.tensors.os.preadv", capped)
    monkeypatch.setattr(vectored, "preadv", capped_table)
    got = PackReader(path).gather([s.name for s in spans[:40]])
    assert len(calls) > 100
    for mine, theirs in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert verify(path)["ok"]


def test_a_context_of_few_tokens_a_layer_reads_every_layer_in_one_pass(tmp_path, monkeypatch):
    """A per-layer eviction's pack (HERMES, SnapKV...) holds a few tokens of each layer a block:
    read a layer at a time, each (block, layer) run was a preadv of its own, 28 x 2 x blocks of
    them at 7B. Every layer's runs now go in file order, those next to each other in one preadv
    of up to IOV_MAX buffers (lowered to 64 here, so a pass crosses it several times)."""

    g = torch.Generator().manual_seed(3)

    def span(name: str, counts: list[int], kind: str | None = "frame") -> Span:
        kv = [torch.randn(HEADS, n, DIM, generator=g).half() for n in counts * 2]
        positions = [torch.arange(n)[None] for n in counts]
        steps = (0, 1) if kind else None
        return Span(name, kv[: len(counts)], kv[len(counts) :], positions, granularity=kind,
                    steps=steps)  # fmt: skip

    body = [span(f"b{i}", torch.randint(0, 5, (LAYERS,), generator=g).tolist()) for i in range(60)]
    path = tmp_path / "few.kvpack"
    header = pack_header(LAYERS, "float16", heads=HEADS, dim=DIM)
    write_pack(path, header, span("prefix", [2] * LAYERS, None), body,
               span("suffix", [1] * LAYERS, None))  # fmt: skip
    monkeypatch.setattr("mmkv_cli.pack.integrity.tensors.IOV_MAX", 64)
    real, calls = vectored.preadv, []

    def counted(fd, address, count, offset):
        calls.append(count)
        return real(fd, address, count, offset)

    monkeypatch.setattr(vectored, "preadv", counted)
    chosen = [s.name for s in body[::2]] + [s.name for s in body[1::2]]  # out of file order too
    keys, values, positions = PackReader(path).gather(chosen)
    by_name = {s.name: s for s in body}
    for layer in range(LAYERS):
        for got, part in ((keys, "keys"), (values, "values"), (positions, "positions")):
            want = torch.cat([getattr(by_name[n], part)[layer] for n in chosen], dim=1)
            assert torch.equal(got[layer], want)
    runs = sum(1 for s in body for n in s.layer_counts if n)
    assert max(calls) == 64 and sum(calls) >= 2 * runs  # every run read, K and V
    assert len(calls) < runs / 4  # not a preadv a run (the file's other reads counted too)


def test_a_large_read_on_several_threads_reads_back_exactly(reps_pack, monkeypatch):
    """Past PARALLEL_READ_BYTES a read is cut, between runs, into preads of about READ_BYTES (an
    odd size here, so no window ends on a run's edge) on READ_THREADS threads: 4 on a 16-core
    machine, 1 on this one, so the test asks for 3."""
    import threading

    import mmkv_cli.pack.integrity.tensors as tensors
    from mmkv_cli.pack.io.pools import KeptPool

    path, spans = reps_pack
    names = [s.name for s in spans]
    want = PackReader(path).gather(names)
    monkeypatch.setattr(tensors, "READ_THREADS", 3)
    monkeypatch.setattr(tensors, "_reading", KeptPool(3, "mmkv-read"))
    monkeypatch.setattr(tensors, "READ_BYTES", (1 << 20) + 17)
    monkeypatch.setattr(tensors, "PARALLEL_READ_BYTES", 4 << 20)
    real, threads = vectored.preadv, set()

    def seen(fd, address, count, offset):
        threads.add(threading.current_thread().name)
        return real(fd, address, count, offset)

    monkeypatch.setattr(vectored, "preadv", seen)
    got = PackReader(path).gather(names)
    for mine, theirs in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert len({t for t in threads if t.startswith("mmkv-read")}) > 1


def test_a_retrievals_scattered_runs_go_to_the_reading_threads_in_tasks_of_bytes(
    reps_pack, monkeypatch
):
    """Each layer retrieving its own half of 320 blocks reads thousands of runs of a few KB,
    scattered (StreamingTOM's question: 14,000 a tensor). A task each cost the pool more than the
    reads (docs/measurements.md). They go in tasks of about READ_BYTES (lowered to 256 KiB
    past PARALLEL_READ_BYTES, lowered to 1 MiB, on 3 threads): never more tasks than
    READ_BYTES-windows, and every layer reads back exact."""
    import threading

    import mmkv_cli.pack.integrity.tensors as tensors
    from mmkv_cli.pack.io.pools import KeptPool

    path, spans = reps_pack
    names = [s.name for s in spans]
    rng = np.random.default_rng(3)
    per_layer = [
        [names[i] for i in sorted(rng.choice(320, 160, replace=False))] for _ in spans[0].keys
    ]
    want = PackReader(path).gather(names, per_layer)
    monkeypatch.setattr(tensors, "READ_THREADS", 3)
    monkeypatch.setattr(tensors, "_reading", KeptPool(3, "mmkv-read"))
    monkeypatch.setattr(tensors, "READ_BYTES", 256 << 10)
    monkeypatch.setattr(tensors, "PARALLEL_READ_BYTES", 1 << 20)
    calls, threads = [], set()
    read_many, read_each = tensors.StoredTensors.read_many, tensors.StoredTensors._read_each

    def counted(self, pieces, tasks, total):
        calls.append((len(tasks), sum(map(len, tasks)), total))
        return read_many(self, pieces, tasks, total)

    def seen(self, pieces, reads):
        threads.add(threading.current_thread().name)
        return read_each(self, pieces, reads)

    monkeypatch.setattr(tensors.StoredTensors, "read_many", counted)
    monkeypatch.setattr(tensors.StoredTensors, "_read_each", seen)
    got = PackReader(path).gather(names, per_layer)
    for mine, theirs in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    k_read = max(calls, key=lambda call: call[2])  # K (or V): 4.6 MB in thousands of runs
    assert k_read[2] > 2 * tensors.PARALLEL_READ_BYTES and k_read[1] > 1000
    assert all(tasks <= total // tensors.READ_BYTES + 1 for tasks, _, total in calls)
    assert len({t for t in threads if t.startswith("mmkv-read")}) > 1


def test_a_forked_child_reads_on_a_pool_of_its_own(monkeypatch):
    """A child forked after a parallel read has none of the pool's threads: its reads would wait
    forever on the parent's pool, so it makes its own."""
    import os

    import mmkv_cli.pack.integrity.tensors as tensors
    from mmkv_cli.pack.io.pools import KeptPool

    monkeypatch.setattr(tensors, "_reading", KeptPool(2, "mmkv-read"))
    parents = tensors._reading.get()
    assert list(parents.map(abs, [-1, -2])) == [1, 2]
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's own exit code says how it went)
        ok = tensors._reading.get() is not parents and list(
            tensors._reading.get().map(abs, [-3])
        ) == [3]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
