"""A live snapshot is written while the stream goes on (issue 48, item 3): the memory cut at a
moment is written on a thread of its own while the next frames go in, it is the memory of that
moment however far the stream has gone on meanwhile, and the final pack is written after it."""

from __future__ import annotations

import logging
import threading

import pytest
from safetensors.torch import load_file

import mmkv_cli.encode.record as record
from mmkv_cli import api
from mmkv_cli.api.live import Follow
from mmkv_cli.core.errors import PackError
from mmkv_cli.core.options import EncodeOptions
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from mmkv_cli.media.live import LiveOptions
from mmkv_cli.methods import EncodeContext
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES
from tests.helpers import mpegts_bytes
from tests.test_live import EVERY, live_choice

FPS = 2.0


@pytest.mark.parametrize("method", EVERY)
def test_a_memory_cut_is_unchanged_by_the_frames_after_it(tmp_path, backbones, method):
    """Written at once or after 14 more frames went in, the memory of frame 6 is the same pack,
    tensor for tensor: nothing the stream does after a cut writes into what the cut holds."""
    backbone = backbones["tiny-llava-ov"]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=64)
    frames = media.read(0, 20)
    choice, context = live_choice(method), EncodeContext("video")
    live = LiveEncoder(backbone, choice, context)
    for i in range(6):
        live.push(frames[i], media.timestamps[i])
    early = live.memory()
    seen = Media("video", "live", "0" * 64, media.timestamps[:6], None)
    record.write_encoded(tmp_path / "now.kvpack", backbone, choice, context, seen, early)
    for i in range(6, 20):
        live.push(frames[i], media.timestamps[i])
    record.write_encoded(tmp_path / "later.kvpack", backbone, choice, context, seen, early)
    now, later = load_file(tmp_path / "now.kvpack"), load_file(tmp_path / "later.kvpack")
    assert now.keys() == later.keys() and len(now) > 3
    for name, tensor in now.items():
        assert tensor.equal(later[name]), (method, name)


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "done.ts"
    path.write_bytes(mpegts_bytes(SAMPLES / "clip.mp4"))
    return path


def follow(recording, out, backbone) -> Follow:
    return Follow(
        str(recording),
        out,
        EncodeOptions("hermes", budget_tokens=24),
        LiveOptions(fps=FPS, stall_s=0.5),
        backbone=backbone,
        snapshot_every=0.5,
    )


def test_frames_go_in_while_a_snapshot_is_written(tmp_path, backbones, recording, monkeypatch):
    """The first snapshot's write is held until four more frames have gone in. The snapshots due
    meanwhile are not queued behind it; the final pack, written after it, holds every frame."""
    real = record.write_encoded
    writes: list[tuple[str, int]] = []  # (the writing thread, frames in the memory written)
    held = threading.Event()
    pushed_while_held: list[float] = []

    def write_encoded(path, backbone, choice, context, media, encoded, quant=None, force=False):
        writes.append((threading.current_thread().name, media.num_frames))
        if len(writes) == 1:
            assert held.wait(timeout=60), "no frame went in while the snapshot was written"
        return real(path, backbone, choice, context, media, encoded, quant, force)

    monkeypatch.setattr(record, "write_encoded", write_encoded)
    out = tmp_path / "live.kvpack"
    live = follow(recording, out, backbones["tiny-llava-ov"])
    push = live.encoder.push

    def pushing(frame, at):
        push(frame, at)
        if len(writes) == 1 and not held.is_set():
            pushed_while_held.append(at)
            if len(pushed_while_held) == 4:
                held.set()

    live.encoder.push = pushing
    done = live.run()
    assert len(pushed_while_held) == 4, pushed_while_held
    first, *middle, final = writes
    assert first[0].startswith("mmkv-snapshot") and final[0] == threading.current_thread().name
    assert all(name.startswith("mmkv-snapshot") for name, _ in middle)
    # the snapshots after it are memories of when they were due once it was done, none queued
    # during it
    assert all(frames >= first[1] + 4 for _, frames in middle)
    assert done["frames"] == final[1] == 16 and done["snapshots"] == 1 + len(middle)
    assert api.verify(out)["ok"]
    assert len(PackReader(out).series("media.timestamps")) == 16


def test_a_snapshot_that_cannot_be_written_is_a_warning(
    tmp_path, backbones, recording, monkeypatch, caplog
):
    real = record.write_encoded
    calls = []

    def write_encoded(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise PackError(f"cannot write {path}: No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(record, "write_encoded", write_encoded)
    out = tmp_path / "live.kvpack"
    with caplog.at_level(logging.WARNING, logger="mmkv"):
        done = follow(recording, out, backbones["tiny-llava-ov"]).run()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("snapshot" in w and "No space left" in w for w in warned), warned
    assert done["frames"] == 16 and done["snapshots"] == len(calls) - 2
    assert api.verify(out)["ok"]
