"""Retrieval keys carry no position: representatives and question vectors are taken before RoPE,
MuKV blocks are prefilled right after the init prompt, and a block moved in the stream is retrieved
the same way. Per-layer retrieval and the dot-product option."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmkv_cli.kernels.rope import rotate_keys, unrotate
from mmkv_cli.media import load_media
from mmkv_cli.methods.retrieval import RetrievalContext, RetrievalOptions
from mmkv_cli.methods.scoring import SIMILARITY, retrieval_key
from mmkv_cli.pack import PackReader
from tests.helpers import ask_pack, choose, encode_pack


def _rope(dim: int = 16):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim // 2) / (dim // 2)))
    return inv_freq, torch.zeros(dim // 2, dtype=torch.long)


def test_unrotate_undoes_rope_and_the_retrieval_key_ignores_where_a_block_sat():
    torch.manual_seed(0)
    rope = _rope()
    raw = torch.randn(2, 6, 16)  # before RoPE
    here = torch.arange(10, 16).view(1, -1)
    there = here + 5000  # the same block an hour later
    at_here, at_there = (rotate_keys(raw, p, *rope) for p in (here, there))
    assert torch.allclose(unrotate(at_here, here, *rope), raw, atol=1e-5)
    key_here = retrieval_key([at_here], [here], rope)
    key_there = retrieval_key([at_there], [there], rope)
    assert key_here.shape == (1, 32)
    assert torch.allclose(key_here, key_there, atol=1e-4)
    # after RoPE the mean moves with the block: the old representative said where it sat
    assert not torch.allclose(at_here.mean(dim=1), at_there.mean(dim=1), atol=1e-2)


def test_dot_product_favours_a_long_vector_cosine_its_direction():
    query = torch.tensor([1.0, 0.0])
    reps = torch.tensor([[1.0, 0.1], [5.0, 4.0]])  # aligned but short; long but off-axis
    assert int(SIMILARITY["cosine"](query, reps).argmax()) == 0
    assert int(SIMILARITY["dot"](query, reps).argmax()) == 1


def test_cosine_scores_are_the_cosine_of_each_block_and_zero_for_a_zero_key():
    g = torch.Generator().manual_seed(3)
    reps, query = torch.randn(500, 64, generator=g), torch.randn(64, generator=g)
    reps[7] = 0  # a block whose mean key cancelled out
    scores = SIMILARITY["cosine"](query, reps.to(torch.bfloat16))
    plain = reps.to(torch.bfloat16).float()
    want = [float(r @ query / (r.norm() * query.norm())) if r.any() else 0.0 for r in plain]
    assert torch.allclose(scores, torch.tensor(want), atol=1e-6)
    assert float(scores[7]) == 0.0


def _image_set(folder, frames: np.ndarray) -> str:
    folder.mkdir()
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(folder / f"{i:02d}.png")
    return str(folder)


@pytest.mark.parametrize("name", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_a_block_moved_in_the_stream_keeps_its_key_and_is_retrieved_the_same(
    tmp_path, backbones, clip, name
):
    """The same 8 frames, the second half first: every MuKV block keeps its representative, and a
    question retrieves the same content."""
    backbone = backbones[name]
    shape = load_media(clip, max_frames=1).read(0, 1).shape[1:]
    frames = np.random.default_rng(0).integers(0, 256, (8, *shape), dtype=np.uint8)  # no twins
    moved = np.concatenate([frames[4:], frames[:4]])
    k = {"patch": 3, "frame": 2, "segment": 1}
    packs = {}
    for label, order in (("a", frames), ("b", moved)):
        media = _image_set(tmp_path / label, order)
        packs[label] = tmp_path / f"{label}.kvpack"
        encode_pack(media, packs[label], method="mukv", backbone=backbone, max_frames=8)
        reader = PackReader(packs[label])
        params = choose("mukv", k=k).params
        packs[label] = (reader, params)
    a, b = packs["a"][0], packs["b"][0]
    steps = len(a.series("layout.step_lengths"))
    half = steps // 2

    def content(reader, row):  # (granularity, steps of the original order, first token)
        meta = reader.blocks[row]
        first, stop = meta["steps"]
        if reader is b:
            first, stop = (first + half) % steps, (stop - 1 + half) % steps + 1
        return meta["granularity"], first, stop, meta["layer_counts"][0]

    reps_a, reps_b = a.representatives(), b.representatives()
    where_b = {}
    for row in range(len(b.blocks)):
        where_b.setdefault(content(b, row), []).append(row)
    for row in range(len(a.blocks)):
        twins = where_b[content(a, row)]
        assert any(torch.allclose(reps_a[row], reps_b[t], atol=1e-4) for t in twins)

    # the question scores every block by its content alone, so retrieval picks the same content
    from mmkv_cli.ask.layerwise import question_vector

    question = "what color is the circle ?"
    scores, picked = {}, {}
    for reader in (a, b):
        ids = backbone.question_ids(question, reader.header.prompt.question)
        vector = question_vector(backbone, reader, ids, "query_mean")
        scores[reader] = {
            content(reader, row): float(s)
            for row, s in enumerate(
                SIMILARITY["cosine"](vector[-1], reader.representatives()[:, -1])
            )
        }
        policy = RetrievalContext(RetrievalOptions(k=k, top_segments=5, rerank={"patch": 0.3}))
        chosen = policy.select(reader.blocks, reader.representatives, lambda mode, v=vector: v)
        picked[reader] = sorted((e["granularity"], round(e["reranked"], 4)) for e in chosen.explain)
    for key, score in scores[a].items():
        assert score == pytest.approx(scores[b][key], abs=1e-4)
    assert picked[a] == picked[b]  # the same picks (up to exact ties between blocks)


@pytest.mark.parametrize("name", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_mukv_keys_are_stored_at_their_stream_positions(tmp_path, backbones, clip, name):
    """Prefilled after the init prompt, re-rotated for the pack: a block's layer-0 keys (token and
    position only) are the full stream's keys at the same positions."""
    backbone = backbones[name]
    encode_pack(clip, tmp_path / "f.kvpack", method="full", backbone=backbone, max_frames=8)
    encode_pack(clip, tmp_path / "m.kvpack", method="mukv", backbone=backbone, max_frames=8)
    full, mukv = PackReader(tmp_path / "f.kvpack"), PackReader(tmp_path / "m.kvpack")
    keys, _, positions = full.gather([full.blocks.name(i) for i in range(len(full.blocks))])
    slot = {tuple(p): i for i, p in enumerate(positions[0].T.tolist())}
    checked = 0
    for row in range(len(mukv.blocks)):
        block = mukv.span(mukv.blocks.name(row))
        for j, p in enumerate(block.positions[0].T.tolist()):
            assert torch.allclose(block.keys[0][:, j], keys[0][:, slot[tuple(p)]], atol=1e-4)
            checked += 1
    assert checked > 50


def test_rekv_can_retrieve_layer_by_layer(tmp_path, backbones, clip):
    from mmkv_cli.ask.answer import build_cache
    from mmkv_cli.ask.layerwise import question_vector

    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "r.kvpack"
    encode_pack(clip, pack, method="rekv-paper", backbone=backbone, max_frames=8)
    reader = PackReader(pack)
    assert reader.representatives().shape[1] == 1  # the paper's reading: one key a block
    from mmkv_cli.encode.encoder import encode_media

    media = load_media(clip, max_frames=8)
    each = encode_media(backbone, media, choose("rekv"))  # the authors' code: a key per layer
    last = encode_media(backbone, media, choose("rekv", layers="last", retrieve="two_pass"))
    dim = reader.representatives().shape[2]
    for a, b in zip(each.blocks, last.blocks):
        assert a.representative.shape == (4, dim) and b.representative.shape == (1, dim)
        assert torch.equal(a.representative[-1:], b.representative)

    # every layer chooses with its own vectors: plant layer 2's needle in block 5 only
    from mmkv_cli.pack import write_pack

    blocks = [reader.span(reader.blocks.name(i)) for i in range(len(reader.blocks))]
    ids = backbone.question_ids("what color ?", reader.header.prompt.question)
    wanted = question_vector(backbone, reader, ids, "query_mean")
    for i, block in enumerate(blocks):
        block.representative = each.blocks[i].representative
    blocks[5].representative = blocks[5].representative.clone()
    blocks[5].representative[2] = wanted[2] * 10
    header = reader.header
    write_pack(
        tmp_path / "planted.kvpack", header, reader.span("prefix"), blocks, reader.span("suffix")
    )
    planted = PackReader(tmp_path / "planted.kvpack")
    assert planted.representatives().shape[1] == 4
    policy = RetrievalContext(RetrievalOptions(k={"frame": 1}, layers="each"))
    chosen = policy.select(
        planted.blocks,
        planted.representatives,
        lambda mode: question_vector(backbone, planted, ids, mode),
    )
    assert chosen.per_layer[2] == ["b5"]
    assert all(len(names) == 1 for names in chosen.per_layer)
    assert set(chosen.names) == {n for names in chosen.per_layer for n in names}
    assert next(e for e in chosen.explain if e["block"] == "b5")["layers"] >= 1
    cache, *_ = build_cache(backbone, planted, chosen.names, per_layer=chosen.per_layer)
    layer2 = cache.layers[2].keys[0, :, reader.span("prefix").layer_counts[0] :]
    assert torch.equal(layer2[:, : blocks[5].layer_counts[2]].cpu(), blocks[5].keys[2])
    # a pack with one key a block cannot retrieve layer by layer: one clear error
    from mmkv_cli.core.errors import PackError

    with pytest.raises(PackError, match="layers: each"):
        policy.select(
            reader.blocks,
            reader.representatives,
            lambda mode: question_vector(backbone, reader, ids, mode),
        )


@pytest.mark.parametrize("method", ["rekv", "mukv-layers"])
def test_the_per_layer_presets_answer_end_to_end(tmp_path, backbones, clip, method):
    backbone = backbones["tiny-qwen2-vl"]
    pack = tmp_path / "l.kvpack"
    encode_pack(clip, pack, method=method, backbone=backbone, max_frames=8)
    assert PackReader(pack).representatives().shape[1] == 4
    answer = ask_pack(
        pack, "what color ?", backbone=backbone, max_new_tokens=2, budget=0.5, prune="snapkv"
    )
    assert answer.retrieved and all("layers" in r for r in answer.retrieved)
    assert answer.kv_tokens is not None
