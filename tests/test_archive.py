"""The host archive of offloaded entries: slabs filled in order, handed over whole."""

import torch

from mmkv_cli.methods.archive import Archive, Column


def test_a_column_fills_slabs_in_order_across_their_edges():
    column = Column(dim=-2, slab_bytes=2 * 7 * 4 * 4)  # 7 entries of [2, ., 4] float32 a slab
    pieces = [torch.randn(2, n, 4) for n in (3, 5, 1, 9, 2)]  # 20 entries: crosses edges
    for piece in pieces:
        column.append(piece)
    assert len(column) == 20 and len(column.slabs) == 3  # one allocation per 7 entries
    whole = torch.cat(pieces, dim=1)
    assert torch.equal(torch.cat(column.parts(), dim=1), whole)
    assert torch.equal(torch.cat(column.take(), dim=1), whole)
    assert len(column) == 0 and column.parts() == []


def test_an_archive_keeps_its_columns_in_step_and_adopts_its_pieces_back():
    archive = Archive(slab_bytes=512, piece=8)
    for first in range(0, 44, 11):
        index = torch.arange(first, first + 11)
        archive.add(torch.randn(2, 11, 4), torch.randn(2, 11, 4), index.repeat(3, 1), index)
    assert len(archive) == 44
    assert archive.columns["k"].slabs[0].shape[1] == 16  # 512 bytes hold 16 entries: 2 pieces
    assert archive.columns["index"].slabs[0].shape[0] == 64  # 64: whole pieces of 8
    pieces, tails = archive.pieces()
    assert sorted(pieces["k"]) == [0, 8, 16, 24, 32] and tails["index"].tolist() == [40, 41, 42, 43]
    slabs = {s.untyped_storage().data_ptr() for s in archive.columns["k"].slabs}
    assert all(p.untyped_storage().data_ptr() in slabs for p in pieces["k"].values())  # views
    loaded = {name: [t.clone() for t in by_start.values()] for name, by_start in pieces.items()}
    back = Archive.restoring(loaded, {n: t.clone() for n, t in tails.items()}, piece=8)
    assert back.columns["k"].slabs[0].data_ptr() == loaded["k"][0].data_ptr()  # kept, not copied
    more = torch.arange(44, 49)
    back.add(torch.randn(2, 5, 4), torch.randn(2, 5, 4), more.repeat(3, 1), more)
    assert len(back) == 49
    again, _ = back.pieces()  # the tail went into a fresh slab: pieces stay whole in one slab
    assert sorted(again["k"]) == [0, 8, 16, 24, 32, 40]
    assert again["k"][40].untyped_storage().data_ptr() == back.columns["k"].slabs[-1].data_ptr()
    mine = archive.take()
    for name, theirs in back.take().items():
        dim = -2 if name in ("k", "v") else -1
        whole = torch.cat(theirs, dim=dim)
        assert torch.equal(whole.narrow(dim, 0, 44), torch.cat(mine[name], dim=dim)), name
    assert torch.cat(loaded["index"]).tolist() == list(range(40))  # a whole piece is never written


def test_a_column_reads_entries_across_its_slabs():
    column = Column(dim=-1, slab_bytes=5 * 8)  # 5 int64 entries a slab
    column.append(torch.arange(12))
    one = column.entries(5, 9)
    assert one.tolist() == [5, 6, 7, 8]
    assert one.untyped_storage().data_ptr() == column.slabs[1].untyped_storage().data_ptr()
    assert column.entries(3, 12).tolist() == list(range(3, 12))  # three slabs, joined


def test_a_checkpoint_writes_the_archive_in_place(tmp_path):
    """Saving copies only what safetensors cannot write as it is (a non-contiguous view, a second
    name on one storage): an hour's archive is not cloned whole at every checkpoint."""
    from mmkv_cli.encode.checkpoint import Checkpointing, _writable, load

    archive = Archive(slab_bytes=1024, piece=8)
    for first in range(0, 64, 16):
        archive.add(
            torch.randn(2, 16, 4),
            torch.randn(2, 16, 4),
            torch.zeros(3, 16).long(),
            torch.arange(first, first + 16),
        )
    whole = torch.randn(6, 5)
    tensors = {f"k.{n}": t for n, t in enumerate(archive.parts()["k"])}
    tensors |= {"whole": whole, "again": whole[:2], "strided": whole[:, 1]}
    plain = _writable(tensors)
    full_slab = plain["k.0"]
    assert full_slab.data_ptr() == archive.columns["k"].slabs[0].data_ptr()  # written in place
    one_storage = [plain[n].untyped_storage().data_ptr() for n in ("whole", "again")]
    assert whole.untyped_storage().data_ptr() in one_storage  # one name written in place,
    assert len(set(one_storage)) == 2  # the other copied
    assert plain["strided"].is_contiguous()
    checkpoint = Checkpointing(tmp_path / "c", 1, {"id": 1})
    checkpoint.save({"seen": 64}, tensors, {})
    restored, _, _ = load(tmp_path / "c", {"id": 1})
    for name, tensor in tensors.items():
        assert torch.equal(restored.tensors[name], tensor), name


def test_a_checkpoints_rows_come_back_in_the_order_they_were_saved(tmp_path):
    """Rows go to the segment of their save, never into the head again; a resume gets every
    save's rows in order, and a save with nothing new adds no segment."""
    from mmkv_cli.encode.checkpoint import Checkpointing, checkpoint_path, held, load

    head = checkpoint_path(tmp_path / "out.kvpack")
    a, b = held(torch.ones(2)), held(torch.zeros(3))
    checkpoint = Checkpointing(head, 1, {"id": 1})
    checkpoint.save({"seen": 1}, {}, {"a": a}, [{"n": 1}, {"n": 2}])
    checkpoint.save({"seen": 2}, {}, {"a": a}, [])
    checkpoint.save({"seen": 3}, {}, {"a": a, "b": b}, [{"n": 3}])
    restored, segments, written = load(head, {"id": 1})
    assert restored.progress == {"seen": 3} and len(segments) == 2
    assert written == {"a": 8, "b": 12}
    assert restored.rows == [{"n": 1}, {"n": 2}, {"n": 3}]
    resumed = Checkpointing.open(tmp_path / "out.kvpack", 1, True, {"id": 1})
    resumed.save({"seen": 4}, {}, {"a": a, "b": b}, [])
    assert resumed.segments == segments  # what the resumed-from saves wrote is not written again


def test_a_checkpoint_compacts_once_its_stale_bytes_outweigh_what_is_needed(tmp_path):
    """A sliding window's pieces stop being needed as it moves on: they stay on disk only until
    they outweigh what is needed, then everything needed is written into one new segment (rows
    included) and the old segments go. The disk holds under twice the state; every save's rows
    come back in order."""
    from mmkv_cli.encode.checkpoint import Checkpointing, checkpoint_path, held, load

    head = checkpoint_path(tmp_path / "out.kvpack")
    checkpoint = Checkpointing(head, 1, {"id": 1})
    pieces = {n: held(torch.full((256,), float(n))) for n in range(12)}  # 1 KB each
    on_disk = []
    for save in range(10):
        window = {f"p{n}": pieces[n] for n in range(save, save + 3)}
        checkpoint.save({"save": save}, {}, window, [{"save": save}])
        files = [p for p in tmp_path.iterdir() if ".seg-" in p.name]
        on_disk.append(sum(p.stat().st_size for p in files))
    restored, segments, written = load(head, {"id": 1})
    for n in (9, 10, 11):  # the last window
        assert torch.equal(restored.tensors[f"p{n}"], pieces[n].make())
    assert restored.rows == [{"save": n} for n in range(10)]
    assert len(segments) <= 3 and sum(written.values()) <= 2 * 3 * 1024
    assert max(on_disk) <= 2 * 3 * 1024 + 4 * 1024  # and the segments' own headers


def test_a_checkpoints_blocks_come_back_as_views_of_what_was_loaded():
    """A resumed blockwise encode (MuKV) holds its loaded blocks once, not loaded + a copy."""
    from mmkv_cli.encode.saved_state import block_rows, blocks_from, blocks_tensors
    from mmkv_cli.pack.schema.format import Span

    counts = [3, 5]
    block = Span(
        name="b0",
        keys=[torch.randn(2, n, 4) for n in counts],
        values=[torch.randn(2, n, 4) for n in counts],
        positions=[torch.arange(n).view(1, n) for n in counts],
        granularity="frame",
        steps=(0, 1),
        time=(0.0, 0.5),
        representative=torch.randn(1, 8),
    )
    sealed = blocks_tensors([block])
    loaded = {name: s.make().clone() for name, s in sealed.items()}
    assert all(loaded[name].nbytes == s.nbytes for name, s in sealed.items())
    rows = block_rows([block])
    storages = {t.untyped_storage().data_ptr() for t in loaded.values()}
    (back,) = blocks_from(loaded, rows)
    assert loaded == {}  # taken out: nothing else holds them
    for mine, theirs in zip(
        (back.keys, back.values, back.positions), (block.keys, block.values, block.positions)
    ):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b) and a.untyped_storage().data_ptr() in storages
    assert torch.equal(back.part(0), block.part(0))
