"""`mmkv live` on real sources: a pipe, a file that grows while it is read, and an HTTP MPEG-TS
stream from a server started here on loopback. The frames taken are the file's, each answer comes
from the memory at its moment, and the final pack is the pack of the whole clip."""

import http.server
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from mmkv_cli import api
from mmkv_cli.api.live import Follow, LiveQuestion
from mmkv_cli.core.errors import MediaError
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.encode.record import write_encoded
from mmkv_cli.media import load_media
from mmkv_cli.media.live import LiveOptions, LiveSource, Ticks
from mmkv_cli.methods import EncodeContext
from mmkv_cli.methods.choice import resolve_method
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES
from tests.helpers import mpegts_bytes
from tests.test_live import cut

CLIP = SAMPLES / "clip.mp4"
FPS = 2.0
MODEL = "tiny-llava-ov"


@pytest.fixture(scope="module")
def stream_bytes():
    return mpegts_bytes(CLIP)


def clip_pack(backbone, frames: int | None, path, method="hermes", tokens=24):
    """The pack of the clip (cut after `frames` frames) encoded as a file, at the live settings."""
    media = load_media(str(CLIP), fps=FPS, max_frames=64)
    media = cut(media, frames) if frames else media
    choice = resolve_method(method).with_budget(tokens=tokens)
    context = EncodeContext("video")
    encoded = encode_media(backbone, media, choice, context, clip_frames=backbone.spec.max_frames)
    write_encoded(path, backbone, choice, context, media, encoded)
    return path


def same_tensors(a, b) -> None:
    ra, rb = PackReader(a), PackReader(b)
    assert [ra.blocks.name(i) for i in range(len(ra.blocks))] == [
        rb.blocks.name(i) for i in range(len(rb.blocks))
    ]
    for name in ["prefix", "suffix", *(ra.blocks.name(i) for i in range(len(ra.blocks)))]:
        x, y = ra.span(name), rb.span(name)
        for u, v in zip(x.keys + x.values + x.positions, y.keys + y.values + y.positions):
            assert u.shape == v.shape and torch.allclose(u.float(), v.float(), atol=1e-5), name


def test_ticks_take_the_frame_nearest_each_tick_as_a_file_does():
    from mmkv_cli.media.base import sample_times
    from mmkv_cli.media.pyav_frames import FrameIndex, nearest_frames

    rng = np.random.default_rng(0)
    for times in (
        [0.0, 0.25, 0.75, 1.0, 1.3],  # the tick at 0.5 ties 0.25 and 0.75: the earlier
        np.cumsum(rng.uniform(0.05, 0.4, size=40)).tolist(),
    ):
        times = [t - times[0] for t in times]
        ticks, taken = Ticks(FPS), []
        for i, at in enumerate(times):
            taken += ticks.offer(at, i)
        taken += ticks.end()
        index = FrameIndex(np.zeros(0), np.asarray(times), np.zeros(0), 0.0)
        duration = times[-1] + (times[-1] - times[0]) / (len(times) - 1)
        wanted = sample_times(duration, FPS, 10_000)
        # a live stream takes a tick once a frame reaches it; a file, knowing where it ends, leaves
        # out a tick less than a period before its end: at most that one differs
        assert len(taken) - len(wanted) in (0, 1) and taken[-1][0] <= times[-1]
        taken = taken[: len(wanted)]
        assert [t for t, _ in taken] == pytest.approx(wanted)
        assert [i for _, i in taken] == nearest_frames(index.times, wanted).tolist()


def test_a_growing_file_is_followed_and_its_final_pack_is_the_whole_clips(
    tmp_path, backbones, stream_bytes
):
    backbone = backbones[MODEL]
    growing = tmp_path / "rec.ts"
    growing.write_bytes(b"")

    def record():
        for start in range(0, len(stream_bytes), 4096):
            with growing.open("ab") as fh:
                fh.write(stream_bytes[start : start + 4096])
            time.sleep(0.01)

    writer = threading.Thread(target=record)
    writer.start()
    answers = []
    follow = Follow(
        str(growing),
        tmp_path / "live.kvpack",
        EncodeOptions("hermes", budget_tokens=24),
        LiveOptions(fps=FPS, stall_s=1.5),
        backbone=backbone,
        generation=GenerationOptions(2),
        on_answer=answers.append,
    )
    for at in (2.0, 4.5):
        follow.ask(LiveQuestion("what color is the circle ?", f"q{at}", at))
    done = follow.run()
    writer.join()
    assert done["stopped"] == "ended" and done["frames"] == 16 and done["error"] is None
    same_tensors(tmp_path / "live.kvpack", clip_pack(backbone, None, tmp_path / "file.kvpack"))
    # each answer is the one the pack of the clip cut at its moment gives
    assert [a["moment"] for a in answers] == [2.0, 4.5]
    for answer in answers:
        frames = int(answer["moment"] * FPS) + 1
        pack = clip_pack(backbone, frames, tmp_path / f"cut{frames}.kvpack")
        want = api.ask(
            pack,
            "what color is the circle ?",
            AskOptions(generation=GenerationOptions(2)),
            backbone=backbone,
        )
        assert answer["answer"] == want.answer
        assert answer["context_tokens"] == want.context_tokens


def test_an_http_stream_from_a_loopback_server_is_followed(tmp_path, backbones, stream_bytes):
    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "video/mp2t")
            self.end_headers()
            for start in range(0, len(stream_bytes), 8192):
                self.wfile.write(stream_bytes[start : start + 8192])
                self.wfile.flush()
                time.sleep(0.02)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = LiveSource(
            f"http://127.0.0.1:{server.server_address[1]}/clip.ts", LiveOptions(FPS)
        )
        assert source.behind == "drop"  # a broadcast does not wait for the encode
        taken = list(source.frames())
    finally:
        server.shutdown()
        server.server_close()
    media = load_media(str(CLIP), fps=FPS, max_frames=64)
    assert [t for t, _ in taken] == pytest.approx(media.timestamps)
    assert np.array_equal(np.stack([f for _, f in taken]), media.read(0, media.num_frames))


def test_live_on_a_pipe_answers_at_moments_and_writes_the_final_pack(
    tmp_path, backbones, stream_bytes
):
    questions = tmp_path / "q.jsonl"
    questions.write_text(  # as synth writes them: answers and types are left out, told once
        '{"question": "what color is the circle ?", "at": 3.0, "id": 1, "answer": "red"}\n'
        '{"question": 5}\n'  # a bad line: one line on stderr, the stream goes on
        '{"question": "which shape appeared last ?", "id": 2, "at": 99, "answer": "x"}\n'
    )
    out = tmp_path / "live.kvpack"
    done = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "live", "-", "-o", str(out), "--model", MODEL]
        + ["--method", "recency", "--budget-tokens", "16", "--fps", str(FPS), "--json"]
        + ["--questions", str(questions), "--max-new-tokens", "2"],
        input=stream_bytes,
        capture_output=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr.decode()
    records = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [(r["id"], r["moment"]) for r in records] == [(1, 3.0), (2, 7.5)]
    assert all(r["ttft_s"] > 0 and r["behind_s"] >= 0 for r in records)
    assert "note" not in records[0] and "ended at 7.50 s" in records[1]["note"]
    assert "'question' must be non-empty text" in done.stderr.decode()
    assert done.stderr.decode().count("ignored the key(s) answer") == 1
    info = api.inspect(out)
    assert info["method"] == "recency" and info["media"]["frames"] == 16
    assert max(layer["tokens_kept"] for layer in info["layers"]) <= 16
    file_pack = clip_pack(backbones[MODEL], None, tmp_path / "file.kvpack", "recency", 16)
    same_tensors(out, file_pack)  # the pipe's final pack is the whole clip's


def test_a_source_that_cannot_be_opened_or_stalls_is_one_clear_line(tmp_path):
    with pytest.raises(MediaError, match="no such file"):
        LiveSource(str(tmp_path / "missing.ts"))
    silent = tmp_path / "silent.ts"
    silent.write_bytes(b"")
    source = LiveSource(str(silent), LiveOptions(FPS, stall_s=0.3))
    with pytest.raises(MediaError, match="cannot read the live source"):
        list(source.frames())


def test_snapshots_are_whole_packs_and_sigterm_writes_the_final_one(tmp_path, stream_bytes):
    import signal

    growing = tmp_path / "rec.ts"
    growing.write_bytes(stream_bytes[: len(stream_bytes) // 2])
    out = tmp_path / "live.kvpack"
    follow = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "live", str(growing), "-o", str(out)]
        + ["--model", MODEL, "--method", "hermes", "--budget-tokens", "24", "--fps", str(FPS)]
        + ["--snapshot-every", "1", "--stall", "60"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        snapshot = api.verify(out)  # another process reads a whole, verified pack
        assert snapshot["ok"] and snapshot["blocks"] > 0
        seen = api.inspect(out)["media"]["frames"]
        follow.send_signal(signal.SIGTERM)
        _, err = follow.communicate(timeout=120)
    finally:
        follow.kill()
    assert follow.returncode == 0, err.decode()
    assert "(stopped;" in err.decode()
    final = api.inspect(out)
    assert api.verify(out)["ok"] and final["media"]["frames"] >= seen > 0
    assert not list(tmp_path.glob("*.mmkv-partial"))  # no litter
