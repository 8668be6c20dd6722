"""Video files: PyAV first, decoding as frames are read; decord (the decord2 build) for a file PyAV
cannot open."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import numpy as np

from mmkv_cli.core.errors import MediaError
from mmkv_cli.media.base import Media, frames_at, sample_times, sha256_files
from mmkv_cli.media.pyav_frames import FrameCursor, index_stream, nearest_frames


@contextlib.contextmanager
def native_stderr_silenced():
    """FFmpeg and decord print their own complaints straight to fd 2; ours is the one line the user
    sees."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded, some test runners)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def load_video(path: Path, fps: float, max_frames: int, backend: str = "auto") -> Media:
    """auto: PyAV, which holds one chunk of frames whatever the video's length, then decord2 for a
    file PyAV cannot read. decord2 came first until bench/media_read.py measured it: as fast, but
    holding far more memory over a long video (docs/measurements.md)."""
    if backend not in ("auto", "decord", "pyav"):
        raise MediaError(f"unknown video backend '{backend}'")
    if backend == "pyav":
        return _load_with_pyav(path, fps, max_frames)
    if backend == "decord":
        return _decord_or_error(path, fps, max_frames)
    try:
        return _load_with_pyav(path, fps, max_frames)
    except MediaError as first:
        try:
            return _decord_or_error(path, fps, max_frames)
        except MediaError:
            raise first from None


def _decord_or_error(path: Path, fps: float, max_frames: int) -> Media:
    try:
        return _load_with_decord(path, fps, max_frames)
    except MediaError:
        raise
    except Exception as err:  # decord raises its own error types (and may not be installed)
        raise MediaError(f"cannot read video {path}: {err}") from err


def _media(path: Path, times: list[float], read, offered: int) -> Media:
    if not times:
        raise MediaError(f"no frames could be read from {path}")
    digest = sha256_files([path])
    return Media("video", str(path), digest, times, read, offered)


def import_decord():
    """decord, imported without its CUDA preload.

    decord2 3.4 dlopens every library of the `nvidia` pip packages (torch's CUDA wheels) with
    RTLD_GLOBAL before its own. One of them is libnvblas, which then takes over the BLAS symbols
    torch's CPU kernels bind on first use: the next float32 matmul crashes the process on a host
    without a GPU (dmlc/decord#293), and the whole CUDA stack costs hundreds of MB of RSS. We read
    frames on the CPU, which needs none of it, so the package is hidden while decord loads."""
    if "decord" in sys.modules:
        return sys.modules["decord"]
    saved = sys.modules.get("nvidia")
    hidden = types.ModuleType("nvidia")
    hidden.__spec__ = None  # find_spec("nvidia") raises, and decord's preload gives up
    sys.modules["nvidia"] = hidden
    try:
        import decord
    finally:
        if saved is None:
            del sys.modules["nvidia"]
        else:
            sys.modules["nvidia"] = saved
    return decord


def _load_with_decord(path: Path, fps: float, max_frames: int) -> Media:
    decord = import_decord()

    with native_stderr_silenced():
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
    total = len(reader)
    native_fps = float(reader.get_avg_fps()) or 1.0
    times = sample_times(total / native_fps, fps, max_frames)
    indices = [min(total - 1, int(round(t * native_fps))) for t in times]
    if indices:
        # some builds open a file they cannot decode: find out now, not mid-encode
        with native_stderr_silenced():
            reader[indices[0]]

    def read(start: int, stop: int) -> np.ndarray:
        # Frame by frame: decord2's get_batch holds more (docs/measurements.md).
        return np.stack([reader[i].asnumpy() for i in indices[start:stop]])

    return _media(path, times, read, frames_at(total / native_fps, fps))


def _load_with_pyav(path: Path, fps: float, max_frames: int) -> Media:
    try:
        with native_stderr_silenced():
            index = index_stream(str(path))
        times = sample_times(index.duration, fps, max_frames)  # none when no frame was found
        if not times:
            raise MediaError(f"no frames could be read from {path}")
        picks = nearest_frames(index.times, times)
        with native_stderr_silenced():
            cursor = FrameCursor(str(path), index)
            cursor.read(picks[:1])  # a file PyAV opens but cannot decode fails now, not mid-encode
    except MediaError:
        raise
    except Exception as err:
        raise MediaError(f"cannot read video {path}: {err}") from err

    def read(start: int, stop: int) -> np.ndarray:
        try:
            with native_stderr_silenced():
                return cursor.read(picks[start:stop])
        except Exception as err:
            raise MediaError(f"cannot read video {path}: {err}") from err

    return _media(path, times, read, frames_at(index.duration, fps))
