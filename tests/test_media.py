"""Media loaders: decord and PyAV agree, sampling follows fps and max-frames, stills and PDFs
load."""

from pathlib import Path

import numpy as np
import pytest

from mmkv_cli.core.errors import MediaError
from mmkv_cli.media import load_media
from mmkv_cli.media.base import sample_times
from mmkv_cli.media.video import load_video
from tests.conftest import SAMPLES


def test_sample_times_follow_fps_and_cap():
    assert sample_times(4.0, 2.0, 0) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    capped = sample_times(100.0, 1.0, 10)
    assert len(capped) == 10 and capped[0] > 0 and capped[-1] < 100
    assert sample_times(0.0, 1.0, 10) == []


def test_decord_and_pyav_read_the_same_frames(clip):
    a = load_video(Path(clip), 2.0, 0, backend="decord")
    b = load_video(Path(clip), 2.0, 0, backend="pyav")
    assert a.timestamps == b.timestamps == [i / 2 for i in range(16)]  # the 8 s sample at 2 fps
    assert np.array_equal(a.read(0, 16), b.read(0, 16))
    assert a.digest == b.digest and len(a.digest) == 64


def test_frames_differ_over_time(clip):
    media = load_media(clip, fps=1.0, max_frames=4)
    frames = media.read(0, 4)
    assert frames.shape == (4, 128, 128, 3) and frames.dtype == np.uint8
    assert np.abs(frames[0].astype(int) - frames[3]).sum() > 0  # shapes move and appear


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_a_range_past_the_last_frame_is_refused_by_its_frames(clip, backend):
    media = load_video(Path(clip), 2.0, 0, backend=backend)
    assert len(media.read(14, 99)) == 2  # stop past the end: to the last frame
    for start, stop in ((16, 18), (99, 100), (3, 3), (-1, 2)):
        with pytest.raises(ValueError, match=rf"frames \[{start}, \d+\) of .* hold none of its 16"):
            media.read(start, stop)


def test_image_folder_glob_and_pdf():
    folder = load_media(str(SAMPLES / "images"))
    glob = load_media(str(SAMPLES / "images" / "*.png"))
    assert folder.kind == "images" and folder.num_frames == glob.num_frames == 4
    assert np.array_equal(folder.read(0, 4), glob.read(0, 4))
    pdf = load_media(str(SAMPLES / "doc.pdf"))
    assert pdf.kind == "pdf" and pdf.num_frames == 3 and pdf.read(0, 3).shape[0] == 3
    assert load_media(str(SAMPLES / "images"), max_frames=2).timestamps == [0.0, 3.0]


def test_bad_media_gives_media_errors(tmp_path):
    with pytest.raises(MediaError, match="no such file"):
        load_media(str(tmp_path / "missing.mp4"))
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"this is not a video" * 10)
    with pytest.raises(MediaError, match="cannot read video"):
        load_media(str(junk))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MediaError, match="no images"):
        load_media(str(empty))
    with pytest.raises(MediaError, match="fps"):
        load_media(str(SAMPLES / "clip.mp4"), fps=0)


def _gop_video(path: Path, count: int, fps: int = 30, encoder_threads: str = "SLICE") -> np.ndarray:
    """A video with B-frames and a key frame every 12 frames, each frame's number drawn in it.
    encoder_threads: "SLICE" (PyAV's default: several slices a frame) or "FRAME" (one slice a
    frame, as the ffmpeg command line writes, which only frame threads decode in parallel)."""
    import av

    frames = np.zeros((count, 32, 48, 3), np.uint8)
    for i in range(count):
        frames[i, :, : (i % 48) + 1] = 255  # a bar whose width counts the frames
        frames[i, : (i // 48) + 1, :, 1] = 200
    with av.open(str(path), "w", format=path.suffix[1:]) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        stream.thread_type = encoder_threads
        stream.options = {"crf": "10", "g": "12", "bf": "2", "preset": "veryfast"}
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return frames


def _decode_all(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.mark.parametrize(
    ("name", "encoder_threads"),
    [("gop.mp4", "SLICE"), ("gop.h264", "SLICE"), ("gop.mp4", "FRAME"), ("gop.h264", "FRAME")],
)
def test_pyav_reads_any_order_as_a_full_decode(tmp_path, name, encoder_threads):
    """Reads decode forward, seek to key frames, and go backwards: every frame is the one a plain
    decode of the whole file gives at that time, on FFmpeg's frame threads too (each seek flushes
    the frames they hold). A raw stream (no pts, no seeks) counts frames."""
    path = tmp_path / name
    _gop_video(path, 150, encoder_threads=encoder_threads)
    truth = _decode_all(path)
    for fps, cap in [(30.0, 0), (7.0, 0), (30.0, 40)]:
        media = load_video(path, fps, cap, backend="pyav")
        wanted = np.array(media.timestamps) * 30
        picks = np.round(wanted).astype(int)
        assert np.abs(wanted - picks).max() <= 0.5
        spans = [(s, min(s + 6, media.num_frames)) for s in range(0, media.num_frames, 6)]
        order = np.random.default_rng(int(fps) + cap).permutation(len(spans))
        for i in [*range(len(spans)), *order]:  # forward first, then any order
            start, stop = spans[i]
            assert np.array_equal(media.read(start, stop), truth[picks[start:stop]]), (fps, i)


def test_pyav_converts_a_videos_frames_through_one_context(tmp_path, monkeypatch):
    """A frame's own to_ndarray sets up a swscale context for that frame alone (milliseconds
    each from PyAV 17): every read of a video shares one, and gives the same frames."""
    import av.video.reformatter as reformatter

    made, real = [], reformatter.VideoReformatter

    def counted():
        made.append(real())
        return made[-1]

    path = tmp_path / "gop.mp4"
    _gop_video(path, 90)
    truth = _decode_all(path)
    monkeypatch.setattr(reformatter, "VideoReformatter", counted)
    media = load_video(path, 30.0, 0, backend="pyav")
    spans = [(s, s + 10) for s in (0, 10, 50, 20, 80)]  # forward, then seeks both ways
    for start, stop in spans:
        assert np.array_equal(media.read(start, stop), truth[start:stop])
    assert len(made) == 1


def test_pyav_holds_one_chunk_of_frames(tmp_path):
    """Opening a long video keeps no decoded frames: a chunk's read allocates about that chunk."""
    import tracemalloc

    path = tmp_path / "long.mp4"
    _gop_video(path, 600)
    frame_bytes = 32 * 48 * 3
    load_video(path, 30.0, 0, backend="pyav").read(0, 1)  # imports done before measuring
    tracemalloc.start()
    try:
        media = load_video(path, 30.0, 0, backend="pyav")
        assert media.num_frames == 600
        opened = tracemalloc.get_traced_memory()[0]  # held (the peak is the digest's 1 MB read)
        tracemalloc.reset_peak()
        for start in range(0, 600, 20):
            media.read(start, start + 20)
        reading = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert opened < 100 * frame_bytes  # the index only (the old loader kept all 600 frames)
    assert reading < 3 * 20 * frame_bytes


def test_decord_leaves_torch_cpu_blas_alone(clip):
    """Frames read with decord before torch's first matmul: the matmul runs (decord2's CUDA preload
    would have put libnvblas in front of torch's BLAS and crashed the process)."""
    import subprocess
    import sys

    script = (
        "from pathlib import Path\n"
        "from mmkv_cli.media.video import load_video\n"
        f"load_video(Path({str(clip)!r}), 2.0, 4, backend='decord').read(0, 4)\n"
        "import torch\n"
        "print(bool(torch.nn.Linear(64, 64)(torch.ones(8, 64)).isfinite().all()))\n"
        "print(any('nvblas' in line for line in open('/proc/self/maps')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.split() == ["True", "False"]


def test_image_sets_decode_as_read(tmp_path):
    """A folder of images holds none of them after loading; a file that is no image is refused at
    load, and one whose data is cut short is one MediaError at the read that meets it."""
    import tracemalloc

    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(120):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(
            tmp_path / f"{i:03d}.png"
        )
    tracemalloc.start()
    try:
        media = load_media(str(tmp_path), max_frames=0)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert media.num_frames == 120 and held < 20 * 64 * 64 * 3  # the old loader held all 120
    assert np.array_equal(media.read(7, 8)[0], np.asarray(Image.open(tmp_path / "007.png")))
    data = (tmp_path / "050.png").read_bytes()
    (tmp_path / "050.png").write_bytes(data[: len(data) // 2])
    media = load_media(str(tmp_path), max_frames=0)
    assert media.read(0, 40).shape == (40, 64, 64, 3)
    with pytest.raises(MediaError, match="cannot read image"):
        media.read(40, 80)
    (tmp_path / "060.png").write_bytes(b"not an image at all")
    with pytest.raises(MediaError, match="cannot read image"):
        load_media(str(tmp_path), max_frames=0)


def test_pyav_decodes_from_the_start_when_a_seek_lands_late(tmp_path, monkeypatch):
    """A container whose seek lands past the wanted frame (a broken index) still gives every frame:
    the read decodes from the start instead."""
    from mmkv_cli.media.pyav_frames import FrameCursor

    path = tmp_path / "late.mp4"
    _gop_video(path, 90)
    truth = _decode_all(path)
    reach = FrameCursor._reach
    monkeypatch.setattr(FrameCursor, "_reach", lambda self, first: reach(self, first + 30))
    media = load_video(path, 30.0, 0, backend="pyav")
    assert np.array_equal(media.read(10, 20), truth[10:20])
    assert np.array_equal(media.read(0, 5), truth[0:5])


def test_auto_falls_back_to_decord_and_keeps_pyavs_error(clip, monkeypatch):
    """auto reads with PyAV; a file PyAV cannot read goes to decord, and when neither can, the
    error is PyAV's one line."""
    from mmkv_cli.media import video

    def refuse(path, fps, max_frames):
        raise MediaError(f"cannot read video {path}: pyav says no")

    expected = load_video(Path(clip), 2.0, 0, backend="decord").read(0, 16)
    monkeypatch.setattr(video, "_load_with_pyav", refuse)
    assert np.array_equal(load_video(Path(clip), 2.0, 0).read(0, 16), expected)
    monkeypatch.setattr(video, "_load_with_decord", lambda *a: 1 / 0)
    with pytest.raises(MediaError, match="pyav says no"):
        load_video(Path(clip), 2.0, 0)
