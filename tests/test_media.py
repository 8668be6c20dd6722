"""Media loaders: decord and PyAV agree, sampling follows fps and max-frames, stills and PDFs
load."""

from pathlib import Path

import numpy as np
import pytest

from mmkv_cli.errors import MediaError
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
