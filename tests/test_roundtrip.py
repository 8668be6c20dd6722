"""A full pack written and read back reproduces one live forward over [prompt + media +
question]."""

import pytest
import torch

from mmkv_cli.media import load_media
from tests.conftest import SAMPLES, TINY
from tests.helpers import ask_pack, encode_pack, reference_inputs

QUESTION = "what color is the circle ?"


def live_logits(backbone, media: str, max_frames: int) -> torch.Tensor:
    frames = load_media(media, fps=2.0, max_frames=max_frames)
    pixels = frames.read(0, frames.num_frames)
    with torch.inference_mode():
        return (
            backbone.model(**reference_inputs(backbone, pixels, QUESTION, frames.timestamps))
            .logits[0, -1]
            .float()
        )


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("media", ["clip.mp4", "images", "doc.pdf"])
def test_full_pack_gives_live_logits(tmp_path, backbones, name, media):
    backbone = backbones[name]
    source = str(SAMPLES / media)
    frames = 4 if media != "doc.pdf" else 2  # an even count: Qwen fuses frame pairs
    pack = tmp_path / "full.kvpack"
    encode_pack(source, pack, method="full", backbone=backbone, fps=2.0, max_frames=frames)
    answer = ask_pack(pack, QUESTION, backbone=backbone, keep_logits=True, max_new_tokens=2)
    diff = (answer.first_logits - live_logits(backbone, source, frames)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("name", TINY)
def test_chunked_encode_matches_single_forward(tmp_path, backbones, name, clip, monkeypatch):
    """16 frames streamed in chunks of 4 give the same answer logits as one forward over all."""
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "full-4.yaml").write_text("extends: full\nparams: {chunk_frames: 4}\n")
    monkeypatch.setenv("MMKV_PRESETS", str(tmp_path))  # a user preset over the method in code
    backbone = backbones[name]
    pack = tmp_path / "chunked.kvpack"
    encode_pack(clip, pack, method="full-4", backbone=backbone, fps=4.0, max_frames=16)
    answer = ask_pack(pack, QUESTION, backbone=backbone, keep_logits=True, max_new_tokens=1)
    frames = load_media(clip, fps=4.0, max_frames=16)
    with torch.inference_mode():
        live = (
            backbone.model(
                **reference_inputs(backbone, frames.read(0, 16), QUESTION, frames.timestamps)
            )
            .logits[0, -1]
            .float()
        )
    assert (answer.first_logits - live).abs().max().item() <= 1e-4


def test_pack_stores_mrope_positions_for_qwen(tmp_path, backbones, clip):
    from mmkv_cli.pack import PackReader

    pack = tmp_path / "q.kvpack"
    encode_pack(clip, pack, method="full", backbone=backbones["tiny-qwen2-vl"], max_frames=4)
    reader = PackReader(pack)
    layout = reader.header.layout
    block = reader.span(reader.blocks[1]["name"])
    assert layout.position_dims == 3 and block.positions[0].shape[0] == 3
    # The second temporal step sits one step later on the temporal axis; rows/cols span the grid.
    first = reader.span(reader.blocks[0]["name"]).positions[0]
    assert int(block.positions[0][0, 0]) == int(first[0, 0]) + 1
    assert (
        layout.next_position
        < reader.spans_meta["prefix"]["layer_counts"][0] + reader.header.visual_tokens_total + 1
    )  # M-RoPE compresses positions: not the physical length
    assert layout.rope_deltas < 0


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("positions", ["keep", "reindex"])
def test_question_at_a_moment_sees_the_stream_up_to_it(tmp_path, backbones, name, positions):
    """Asked at image 1 of 4, a full pack answers as a live forward over images 0-1 alone: the
    question follows the last image shown by then, in both position modes."""
    backbone = backbones[name]
    source = str(SAMPLES / "images")
    pack = tmp_path / "full.kvpack"
    encode_pack(source, pack, method="full", backbone=backbone)
    answer = ask_pack(
        pack,
        QUESTION,
        backbone=backbone,
        keep_logits=True,
        max_new_tokens=1,
        at=1.0,
        positions=positions,
    )
    frames = load_media(source)
    with torch.inference_mode():
        live = backbone.model(
            **reference_inputs(backbone, frames.read(0, 2), QUESTION, frames.timestamps[:2])
        )
    assert (answer.first_logits - live.logits[0, -1].float()).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kv_bits", [16, 4])
def test_an_asked_context_is_held_once(tmp_path, backbones, monkeypatch, kv_bits):
    """At an hour a full context is GBs: each layer's gathered KV is let go as soon as it is
    joined with the prompt around it, and the cache holds the joined tensors themselves (it used
    to hold a third copy, the gather and the join alive beside it)."""
    import gc
    import weakref

    from mmkv_cli.ask.answer import build_cache
    from mmkv_cli.pack import PackReader

    backbone = backbones[TINY[0]]
    pack = tmp_path / "full.kvpack"
    encode_pack(
        SAMPLES / "clip.mp4",
        pack,
        method="full",
        backbone=backbone,
        max_frames=4,
        kv_bits=kv_bits,
        kv_group=16,
    )
    reader = PackReader(pack)
    gathered, seen = [], {}
    gather, holding = PackReader.gather, type(backbone).cache_from_layers

    def gather_watched(self, *args, **kwargs):
        out = gather(self, *args, **kwargs)
        gathered.extend(weakref.ref(t) for part in out[:2] for t in part)
        return out

    def holding_watched(self, keys, values, batch=1, adopt=False):
        gc.collect()
        seen["gathered alive"] = sum(ref() is not None for ref in gathered)
        cache = holding(self, keys, values, batch, adopt)
        seen["held as given"] = all(
            entry.keys.data_ptr() == k.data_ptr() for entry, k in zip(cache.layers, keys)
        )
        return cache

    monkeypatch.setattr(PackReader, "gather", gather_watched)
    monkeypatch.setattr(type(backbone), "cache_from_layers", holding_watched)
    names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
    cache, tokens, *_ = build_cache(backbone, reader, names)
    assert gathered and seen == {"gathered alive": 0, "held as given": True}
    spans = reader.span("prefix").layer_counts[0] + reader.span("suffix").layer_counts[0]
    assert (
        tokens
        == cache.layers[0].keys.shape[2]
        == spans + int(reader.blocks.layer_totals()[:, 0].sum())
    )
