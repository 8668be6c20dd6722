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


def test_an_archive_keeps_its_columns_in_step_and_adopts_its_parts_back():
    archive = Archive(slab_bytes=512)
    for first in range(0, 40, 8):
        index = torch.arange(first, first + 8)
        archive.add(torch.randn(2, 8, 4), torch.randn(2, 8, 4), index.repeat(3, 1), index)
    assert len(archive) == 40
    parts = archive.parts()
    assert len(parts["k"]) > 1 and len(parts["index"]) == 1  # slabs sized by each column's width
    loaded = {name: [t.clone() for t in tensors] for name, tensors in parts.items()}
    back = Archive.adopting(loaded)  # a resume: the loaded slabs are kept, not copied again
    assert back.columns["k"].slabs[0].data_ptr() == loaded["k"][0].data_ptr()
    more = torch.arange(40, 45)
    back.add(torch.randn(2, 5, 4), torch.randn(2, 5, 4), more.repeat(3, 1), more)
    assert len(back) == 45
    for name, mine in back.take().items():
        dim = -2 if name in ("k", "v") else -1
        whole = torch.cat(mine, dim=dim)
        assert torch.equal(whole.narrow(dim, 0, 40), torch.cat(parts[name], dim=dim)), name
    assert torch.cat(parts["index"]).tolist() == list(range(40))
    assert loaded["index"][0].tolist() == list(range(40))  # a full slab is never written into


def test_a_checkpoint_writes_the_archive_in_place(tmp_path):
    """Saving copies only what safetensors cannot write as it is (a non-contiguous view, a second
    name on one storage): an hour's archive is not cloned whole at every checkpoint."""
    from mmkv_cli.checkpoint import _writable, load, save

    archive = Archive(slab_bytes=1024)
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
    save(tmp_path / "c", {"id": 1}, {"seen": 64}, tensors)
    _, back = load(tmp_path / "c", {"id": 1})
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name


def test_a_checkpoints_blocks_come_back_as_views_of_what_was_loaded():
    """A resumed blockwise encode (MuKV) holds its loaded blocks once, not loaded + a copy."""
    from mmkv_cli.checkpoint import blocks_from, blocks_tensors
    from mmkv_cli.pack.format import Span

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
    tensors, rows = blocks_tensors([block])
    loaded = {name: t.clone() for name, t in tensors.items()}
    storages = {t.untyped_storage().data_ptr() for t in loaded.values()}
    (back,) = blocks_from(loaded, rows)
    assert loaded == {}  # taken out: nothing else holds them
    for mine, theirs in zip(
        (back.keys, back.values, back.positions), (block.keys, block.values, block.positions)
    ):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b) and a.untyped_storage().data_ptr() in storages
    assert torch.equal(back.part(0), block.part(0))
