"""The next chunk's frames decoded on a thread while this chunk runs (encode/stream.py): on a GPU
the host would otherwise decode while the device waits. On the CPU it is off (the encode keeps every
core busy); these tests turn it on there and find the same encode, frame for frame."""

from __future__ import annotations

import threading

import pytest
import torch

import mmkv_cli.encode.stream as stream
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.errors import MediaError
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext
from tests.conftest import SAMPLES
from tests.helpers import choose

CLIP = SAMPLES / "clip.mp4"


@pytest.fixture(scope="module")
def demo():
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.options import LoadOptions

    return load_backbone(LoadOptions("demo", "cpu"))


def encoded(demo, method: str, read_ahead: bool, monkeypatch, reads: list | None = None):
    monkeypatch.setattr(stream, "READ_AHEAD", read_ahead)
    media = load_media(str(CLIP), fps=4, max_frames=14)
    if reads is not None:
        real = media.read

        def read(first, stop):
            reads.append((first, stop, threading.current_thread().name))
            return real(first, stop)

        monkeypatch.setattr(media, "read", read)
    return encode_media(demo, media, choose(method, chunk_frames=4), EncodeContext(media.kind))


@pytest.mark.parametrize("method", ["full", "hermes"])
def test_frames_read_ahead_make_the_same_encode(demo, monkeypatch, method):
    plain = encoded(demo, method, False, monkeypatch)
    reads: list = []
    ahead = encoded(demo, method, True, monkeypatch, reads)
    chunks = [r for r in reads if r[2].startswith("mmkv-frames")]
    assert [(a, b) for a, b, _ in chunks] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    for got, want in zip([ahead.prefix, *ahead.blocks], [plain.prefix, *plain.blocks]):
        for part in ("keys", "values", "positions"):
            for a, b in zip(getattr(got, part), getattr(want, part)):
                assert torch.equal(a, b), (got.name, part)
    assert len(ahead.blocks) == len(plain.blocks) > 0


def test_a_read_that_fails_ahead_fails_the_encode_in_one_clear_error(demo, monkeypatch):
    monkeypatch.setattr(stream, "READ_AHEAD", True)
    media = load_media(str(CLIP), fps=4, max_frames=14)
    real = media.read

    def read(first, stop):
        if first >= 8:
            raise MediaError(f"{CLIP} ends early")
        return real(first, stop)

    monkeypatch.setattr(media, "read", read)
    with pytest.raises(MediaError, match="ends early"):
        encode_media(demo, media, choose("full", chunk_frames=4), EncodeContext(media.kind))
