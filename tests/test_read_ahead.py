"""The next chunk's frames read and prepared (by the model's processor, into pinned memory on a GPU)
on a thread while this chunk runs (encode/stream.py): on a GPU the host would otherwise decode and
prepare while the device waits. On the CPU it is off (the encode keeps every core busy); these
tests turn it on there and find the same pack, tensor for tensor, for each model family, a
blockwise method and token reducers."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

import mmkv_cli.encode.stream as stream
from mmkv_cli.core.errors import MediaError
from mmkv_cli.core.options import MethodSpec
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext
from tests.conftest import SAMPLES
from tests.helpers import choose, encode_pack

CLIP = SAMPLES / "clip.mp4"
CASES = [
    ("demo", "full", None),
    ("demo", "hermes", None),
    ("demo", "mukv", None),  # blockwise: its own loop over the chunks
    ("demo", "full", "dtd"),
    ("tiny-llava-ov", "full", "visionzip"),  # the tower's attention, from the prepared inputs
    ("tiny-qwen2.5-vl", "rekv", None),
    ("tiny-qwen3-vl", "full", None),  # frames resized to the clip's pixel budget first
]
_backbones: dict = {}


def backbone(model: str):
    if model not in _backbones:
        from mmkv_cli.backbones.loading import load_backbone
        from mmkv_cli.core.options import LoadOptions

        _backbones[model] = load_backbone(LoadOptions(model, "cpu"))
    return _backbones[model]


def packed(tmp_path, monkeypatch, model, method, reduce, ahead: bool, seen: list | None = None):
    monkeypatch.setattr(stream, "READ_AHEAD", ahead)
    model_backbone = backbone(model)
    if seen is not None:
        real = model_backbone.prepare

        def prepare(frames, layout):
            seen.append(threading.current_thread().name)
            return real(frames, layout)

        monkeypatch.setattr(model_backbone, "prepare", prepare)
    out = tmp_path / f"{ahead}.kvpack"
    spec = MethodSpec(method, {"chunk_frames": 4})
    encode_pack(CLIP, out, method=spec, backbone=model_backbone, fps=4, max_frames=14,
                reduce=reduce)  # fmt: skip
    monkeypatch.undo()
    return load_file(out)


@pytest.mark.parametrize(("model", "method", "reduce"), CASES)
def test_frames_read_and_prepared_ahead_make_the_same_pack(tmp_path, monkeypatch, model, method,
                                                           reduce):  # fmt: skip
    plain = packed(tmp_path, monkeypatch, model, method, reduce, False)
    seen: list[str] = []
    ahead = packed(tmp_path, monkeypatch, model, method, reduce, True, seen)
    # every chunk's inputs made once, ahead: none made again as the chunk is embedded
    assert len(seen) == 4 and all(name.startswith("mmkv-frames") for name in seen)
    assert sorted(ahead) == sorted(plain)
    for name, tensor in plain.items():
        assert torch.equal(ahead[name], tensor), name


def test_a_read_that_fails_ahead_fails_the_encode_in_one_clear_error(monkeypatch):
    monkeypatch.setattr(stream, "READ_AHEAD", True)
    media = load_media(str(CLIP), fps=4, max_frames=14)
    real = media.read

    def read(first, stop):
        if first >= 8:
            raise MediaError(f"{CLIP} ends early")
        return real(first, stop)

    monkeypatch.setattr(media, "read", read)
    with pytest.raises(MediaError, match="ends early"):
        encode_media(
            backbone("demo"), media, choose("full", chunk_frames=4), EncodeContext(media.kind)
        )
