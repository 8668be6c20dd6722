"""A hot pack's held spans (serve/hot.py): a follow-up over the same blocks joins nothing again, the
pack's K/V are held once however many questions join them, and every join gives the file's rows."""

import pytest
import torch

from mmkv_cli.pack import PackReader
from mmkv_cli.serve.hot import HotPack, file_identity
from tests.conftest import SAMPLES
from tests.helpers import encode_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory, backbones):
    path = tmp_path_factory.mktemp("hot") / "full.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), path, "demo", "full")
    return path


def _storages(hot: HotPack) -> dict[int, int]:
    """Each distinct storage the held spans' K/V sit in, with its bytes."""
    held = {}
    for span in hot._held.values():
        for tensor in (*span.keys, *span.values):
            storage = tensor.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
    return held


def _same_as_file(got, reader: PackReader, names, per_layer=None) -> bool:
    want = reader.gather(names, per_layer)
    return all(torch.equal(a, b) for part, wanted in zip(got, want) for a, b in zip(part, wanted))


def test_a_follow_up_over_the_same_blocks_joins_nothing_and_the_kv_is_held_once(pack):
    reader = PackReader(pack)
    names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
    hot = HotPack(PackReader(pack), file_identity(pack))
    first = hot.gather(names)
    assert _same_as_file(first, reader, names)
    again = hot.gather(names)
    assert all(a is b for part, other in zip(first, again) for a, b in zip(part, other))
    # the spans are views of the join: the block's K/V bytes once, not the blocks and the join
    kv = sum(t.numel() * t.element_size() for part in first[:2] for t in part)
    assert sum(_storages(hot).values()) == kv
    hot.close()


@pytest.mark.parametrize("pinned", [False, True] if torch.cuda.is_available() else [False])
def test_another_selection_copies_out_what_it_leaves_and_lets_the_old_join_go(pack, pinned):
    """Questions over other blocks (a moment, retrieval by layer) give the file's rows each time;
    a block left out of the new join keeps its rows in storage of its own, and nothing held still
    points into a join no question uses."""
    reader = PackReader(pack)
    names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
    hot = HotPack(PackReader(pack), file_identity(pack), "pinned" if pinned else "host")
    layers = len(reader.span("prefix").keys)
    by_layer = [names[layer % 2 :: 2] for layer in range(layers)]
    for chosen, per_layer in ((names, None), (names[:2], None), (names, by_layer), (names, None)):
        joined = hot._joined[1][0] if hot._joined else []
        before = {t.untyped_storage().data_ptr() for t in joined}
        got = hot.gather(chosen, per_layer)
        assert _same_as_file(got, reader, chosen, per_layer)
        for name in names:
            if name in hot._held:
                span, stored = hot._held[name], reader.span(name)
                assert all(torch.equal(a, b) for a, b in zip(span.keys, stored.keys))
                assert all(torch.equal(a, b) for a, b in zip(span.values, stored.values))
                assert all(t.is_pinned() == pinned for t in (*span.keys, *span.values))
        assert not (set(_storages(hot)) & before)  # the previous join is let go whole
    hot.close()
