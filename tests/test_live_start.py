"""A live source starts and ends as a user of ffmpeg expects (issue 50): checked before the model
loads, its first frame as soon as its bytes are in (not after FFmpeg's 5 MB / 5 s probe), and a
finished file ended within `--stall` of its last byte with every frame kept."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest

from mmkv_cli.api.live import Follow
from mmkv_cli.core.errors import MediaError
from mmkv_cli.core.options import EncodeOptions, LoadOptions
from mmkv_cli.media import load_media
from mmkv_cli.media.live import LiveOptions, LiveSource, ffmpeg_line
from tests.conftest import SAMPLES
from tests.helpers import mpegts_bytes

CLIP = SAMPLES / "clip.mp4"
FPS = 2.0


@pytest.fixture(scope="module")
def stream_bytes():
    return mpegts_bytes(CLIP)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize(
    "source, words",
    [
        ("/dev/video97", "no such device: /dev/video97"),
        ("missing.ts", "no such file: missing.ts"),
        (f"http://127.0.0.1:{closed_port()}/live.ts", "connection refused"),
        (f"rtsp://127.0.0.1:{closed_port()}/cam", "connection refused"),
    ],
)
def test_a_source_is_checked_before_the_model_loads(monkeypatch, tmp_path, source, words):
    def no_model(options):
        raise AssertionError("the model was loaded before the source was checked")

    monkeypatch.setattr("mmkv_cli.backbones.loading.load_backbone", no_model)
    monkeypatch.chdir(tmp_path)
    began = time.monotonic()
    with pytest.raises(MediaError) as refused:
        Follow(
            source,
            tmp_path / "live.kvpack",
            EncodeOptions("recency", budget_tokens=16),
            LiveOptions(fps=FPS, timeout_s=1.5),
            load=LoadOptions("demo", "cpu"),
        )
    assert time.monotonic() - began < 2.0
    line = str(refused.value)
    assert words in line and "Errno" not in line and "\n" not in line, line


def test_ffmpeg_errors_read_as_words():
    import av

    try:
        av.open(f"http://127.0.0.1:{closed_port()}/x.ts", options={"timeout": "1000000"})
    except av.FFmpegError as err:
        assert ffmpeg_line(err) == "connection refused" and "Errno" in str(err)
    assert ffmpeg_line(ValueError("one\ntwo")) == "one"


def test_a_finished_file_ends_within_its_stall_with_every_frame(tmp_path, stream_bytes):
    """FFmpeg reads a file's end several times: each read once waited the whole stall again, and
    a file ended as a stalled, broken stream without its last frames."""
    recording = tmp_path / "done.ts"
    recording.write_bytes(stream_bytes)
    stall = 2.0
    source = LiveSource(str(recording), LiveOptions(fps=FPS, stall_s=stall))
    began = time.monotonic()
    taken = list(source.frames())
    elapsed = time.monotonic() - began
    media = load_media(str(CLIP), fps=FPS, max_frames=64)
    assert [at for at, _ in taken] == pytest.approx(media.timestamps)
    assert stall <= elapsed < stall + 1.5, elapsed


def test_a_file_written_at_real_time_ends_within_its_stall_of_the_last_byte(tmp_path, stream_bytes):
    growing = tmp_path / "rec.ts"
    growing.write_bytes(b"")
    last_write = []

    def record():
        for start in range(0, len(stream_bytes), 2048):
            with growing.open("ab") as fh:
                fh.write(stream_bytes[start : start + 2048])
            time.sleep(0.04)
        last_write.append(time.monotonic())

    stall = 1.5
    source = LiveSource(str(growing), LiveOptions(fps=FPS, stall_s=stall))
    writer = threading.Thread(target=record)
    writer.start()
    taken = list(source.frames())
    ended = time.monotonic()
    writer.join()
    assert len(taken) == 16 and source.ended_by is None
    assert ended - last_write[0] < stall + 1.0


def test_a_slow_pipe_gives_its_first_frame_once_its_bytes_are_in(monkeypatch, stream_bytes):
    """The clip's MPEG-TS at 6 KB/s: FFmpeg's default probe waited for 32 KB (about 5 s of it)
    before the first frame; a live source asks a few KB. Counted in bytes sent, not seconds."""
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "rb"))
    sent = [0]
    done = threading.Event()

    def pace():
        for start in range(0, len(stream_bytes), 752):  # four TS packets every 0.1 s
            if done.is_set():
                break
            os.write(write_end, stream_bytes[start : start + 752])
            sent[0] = start + 752
            time.sleep(0.1)
        os.close(write_end)

    source = LiveSource("-", LiveOptions(fps=FPS))
    feeder = threading.Thread(target=pace, daemon=True)
    feeder.start()
    frames = source.frames()
    at, _ = next(frames)
    at_first = sent[0]
    done.set()
    source.close()
    assert at == 0.0
    assert at_first <= 14 * 1024, at_first  # the default probe: about 32 KB


def test_every_forward_of_a_follow_runs_where_on_model_puts_it(tmp_path, backbones, stream_bytes):
    """A server's streams and chats share one backbone through one model thread: every forward
    of a follow (frames, memory cuts, answers, the final pack) runs there, none beside it."""
    from concurrent.futures import ThreadPoolExecutor

    from mmkv_cli.api.live import LiveQuestion
    from mmkv_cli.core.options import GenerationOptions

    recording = tmp_path / "done.ts"
    recording.write_bytes(stream_bytes)
    backbone = backbones["tiny-llava-ov"]
    threads = []
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
    real = backbone.forward

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    answers = []
    follow = Follow(
        str(recording),
        tmp_path / "live.kvpack",
        EncodeOptions("hermes", budget_tokens=24),
        LiveOptions(fps=FPS, stall_s=0.5),
        backbone=backbone,
        generation=GenerationOptions(2),
        on_answer=answers.append,
        on_model=lambda job: model_thread.submit(job).result(),
    )
    follow.ask(LiveQuestion("what color is the circle ?", "q", 2.0))
    backbone.forward = spy
    try:
        done = follow.run()
    finally:
        del backbone.forward
        model_thread.shutdown()
    assert done["frames"] == 16 and [a["id"] for a in answers] == ["q"]
    assert threads and {name.split("_")[0] for name in threads} == {"model"}, set(threads)
