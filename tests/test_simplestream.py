"""SimpleStream (issue 73): no memory, the newest N frames alone, prefilled fresh after the prompt
(the authors' query_recent_window feeds the last N one-frame chunks with the question)."""

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from tests.conftest import SAMPLES
from tests.helpers import choose


def newest(media: Media, count: int) -> Media:
    """The clip as a file of its last `count` frames would be, written out."""
    first = media.num_frames - count
    return Media(media.kind, media.source, media.digest, media.timestamps[first:],
                 lambda a, b: media.read(first + a, first + b))  # fmt: skip


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("frames", [4, 6])
def test_the_pack_is_a_full_encode_of_the_newest_frames_alone(backbones, model, frames):
    backbone = backbones[model]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=16)
    got = encode_media(backbone, media, choose("simplestream", frames=frames))
    want = encode_media(backbone, newest(media, frames), choose("full"))
    assert [b.time for b in got.blocks] == [b.time for b in want.blocks]
    assert got.blocks[0].time[0] == media.timestamps[-frames]  # the window's own times
    for a, b in zip(
        [got.prefix, *got.blocks, got.suffix], [want.prefix, *want.blocks, want.suffix]
    ):
        for x, y in zip(a.keys + a.values + a.positions, b.keys + b.values + b.positions):
            assert torch.equal(x, y)  # prefilled fresh after the prompt, nothing before
    whole = encode_media(backbone, media, choose("full"))
    assert got.visual_tokens_total == whole.visual_tokens_total  # what the stream gave
    assert got.stats["visual_tokens_prefilled"] == want.visual_tokens_total


def test_presets_set_the_window_and_budgets_are_refused():
    assert choose("simplestream").params.frames == 4
    assert choose("simplestream-16").params.frames == 16
    with pytest.raises(Exception, match="budget"):
        choose("simplestream", budget=0.5)
