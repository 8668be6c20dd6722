"""A live question is asked of the memory in place (issue 50): for every method, the answer, its
first logits and its context are those the written pack of the same memory gives, with and without
a moment, and nothing is written."""

from __future__ import annotations

import pytest
import torch

from mmkv_cli.api import PackSession
from mmkv_cli.core.options import AskOptions, GenerationOptions
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.encode.record import pack_header, write_encoded
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from mmkv_cli.methods import EncodeContext
from mmkv_cli.pack.access.memory import MemoryPack
from tests.conftest import SAMPLES
from tests.test_live import EVERY, live_choice

QUESTIONS = ("what color is the circle ?", "which shape appeared first ?")


def memories(backbone, method: str, moments: tuple[int, ...]):
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=64)
    choice = live_choice(method)
    context = EncodeContext("video")
    live = LiveEncoder(backbone, choice, context)
    frames = media.read(0, media.num_frames)
    for i, at in enumerate(media.timestamps):
        live.push(frames[i], at)
        if i + 1 in moments:
            seen = Media("video", "live", "0" * 64, media.timestamps[: i + 1], None)
            yield choice, context, seen, live.memory()


CASES = [("tiny-llava-ov", method) for method in EVERY] + [
    (family, method)
    for family in ("tiny-qwen2.5-vl", "tiny-qwen3-vl")
    for method in ("hermes", "rekv", "mukv")
]


@pytest.mark.parametrize("model, method", CASES)
def test_a_question_of_the_memory_in_place_is_the_written_packs(tmp_path, backbones, model, method):
    backbone = backbones[model]
    for choice, context, media, encoded in memories(backbone, method, (6, 13)):
        path = tmp_path / f"{method}-{media.num_frames}.kvpack"
        write_encoded(path, backbone, choice, context, media, encoded)
        header, _ = pack_header(backbone, choice, context, media, encoded)
        in_place = MemoryPack(
            header, encoded.prefix, encoded.blocks, encoded.suffix, encoded.representatives
        )
        written, held = (
            PackSession(path, backbone=backbone),
            PackSession(in_place, backbone=backbone),
        )
        for question in QUESTIONS:
            for at in (None, media.timestamps[2]):
                options = AskOptions(at=at, generation=GenerationOptions(3), keep_logits=True)
                want, got = written.ask(question, options), held.ask(question, options)
                assert got.answer == want.answer, (method, question, at)
                assert torch.equal(got.first_logits, want.first_logits), (method, question, at)
                assert got.context_tokens == want.context_tokens
                assert got.bytes_read == 0
