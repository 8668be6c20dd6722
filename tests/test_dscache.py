"""DSCache: the past cache written out plainly as the authors' loop (one frame at a time after
everything held, the oldest frame evicted past context_len + 1, the next frame placed right after
what is held), the instant cache as the newest frames prefilled fresh after the prompt, and the
suffix after both, against mmkv's pack of the same clip."""

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from mmkv_cli.methods import dscache
from tests.conftest import SAMPLES
from tests.helpers import choose


def test_the_past_keeps_its_newest_frames_and_reads_every_nth_from_the_newest():
    steps = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    assert dscache.newest_steps(steps, 2).tolist() == [5, 6, 7]
    assert dscache.newest_steps(steps, 9).tolist() == list(range(8))
    # sample_long_cache: start = (count - stride) % stride; 5 frames, stride 2: 1, 3
    assert dscache.every_nth_step(steps, 2).tolist() == [2, 3, 5, 6]
    assert dscache.every_nth_step(steps, 3).tolist() == [4]  # start (5 - 3) % 3: step 2
    assert dscache.every_nth_step(steps, 1).tolist() == list(range(8))


def plain_past(backbone, media: Media, frames: int, keep: int):
    """The authors' past cache over the first `frames` frames of a one-frame-a-step, 1-D RoPE
    model: each frame prefilled after what the cache holds, at the places right after it; past
    `keep` frames the oldest leaves. Returns each held frame's K, V per layer."""
    prefix_ids = backbone.text_ids(backbone.prompt.prefix)
    cache = backbone.new_cache()
    backbone.forward(backbone.embed_ids(prefix_ids), backbone.text_positions(0, len(prefix_ids)),
                     cache)  # fmt: skip
    start = len(prefix_ids)
    pixels = media.read(0, frames)
    hw = tuple(pixels.shape[1:3])
    layout = backbone.stream_layout(hw, [(t, t) for t in media.timestamps[:frames]])
    held = []  # per frame: its token count
    for f in range(frames):
        embeds, extra = backbone.visual_chunk(pixels[f : f + 1], [(0.0, 0.0)], layout)
        length = cache.layers[0].keys.shape[2]
        positions = backbone.text_positions(length, embeds.shape[1])
        backbone.forward(embeds, positions, cache, **extra)
        held.append(embeds.shape[1])
        if len(held) > keep:
            gone = held.pop(0)
            for entry in cache.layers:
                entry.keys = torch.cat([entry.keys[:, :, :start], entry.keys[:, :, start + gone :]],
                                       dim=2)  # fmt: skip
                entry.values = torch.cat(
                    [entry.values[:, :, :start], entry.values[:, :, start + gone :]], dim=2
                )
    out, at = [], start
    for count in held:
        out.append([(e.keys[0, :, at : at + count], e.values[0, :, at : at + count])
                    for e in cache.layers])  # fmt: skip
        at += count
    return out


def newest(media: Media, count: int) -> Media:
    first = media.num_frames - count
    return Media(media.kind, media.source, media.digest, media.timestamps[first:],
                 lambda a, b: media.read(first + a, first + b))  # fmt: skip


@pytest.mark.parametrize("context_len", [2, 30])
def test_the_pack_is_the_past_cache_then_the_instant_cache(backbones, context_len):
    backbone = backbones["tiny-llava-ov"]  # one frame a step, 1-D RoPE
    media = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=12)
    choice = choose("dscache", context_len=context_len, frame_len=2)
    got = encode_media(backbone, media, choice)
    past = plain_past(backbone, media, 12 - 3, context_len + 1)
    assert len(got.blocks) == len(past) + 3
    for block, frame in zip(got.blocks, past):
        for layer, (keys, values) in enumerate(frame):
            assert torch.allclose(block.keys[layer], keys, atol=1e-5)
            assert torch.allclose(block.values[layer], values, atol=1e-5)
    fresh = encode_media(backbone, newest(media, 3), choose("full"))
    for block, want in zip(got.blocks[len(past) :], fresh.blocks):
        assert block.time == want.time
        for x, y in zip(block.keys + block.values + block.positions,
                        want.keys + want.values + want.positions):  # fmt: skip
            assert torch.equal(x, y)  # right after the prompt, attending to nothing before
    stored = got.prefix.layer_counts[0] + sum(b.layer_counts[0] for b in got.blocks)
    suffix = got.suffix.layer_counts[0]
    assert got.suffix.positions[0][0].tolist() == list(range(stored, stored + suffix))
    assert got.layout["next_position"] == stored + suffix
    assert got.layout["steps"] == 12 and sum(got.layout["step_lengths"]) == got.visual_tokens_total


def test_a_stride_reads_every_nth_past_frame_and_budgets_are_refused(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=12)
    got = encode_media(backbone, media, choose("dscache", context_len=4, frame_len=1,
                                               past_stride=2))  # fmt: skip
    # 10 past frames, 5 held (5..9), every 2nd from (5 - 2) % 2 = 1: 6, 8; then 10, 11
    assert [b.steps[0] for b in got.blocks] == [6, 8, 10, 11]
    with pytest.raises(Exception, match="budget"):
        choose("dscache", budget=0.5)
