"""Frames from PyAV, decoded as they are read: an hour of video never sits in memory.

Opening a file demuxes its packets once (no decoding) for every frame's timestamp and the key
frames. A read decodes forward from where the last read stopped, or seeks to the key frame before
the first wanted frame when that skips decoding (or when reading backwards), and converts only the
wanted frames to RGB: memory is one chunk of frames, whatever the video's length.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from mmkv_cli.core.errors import MediaError

# How a file's frames are decoded in parallel: FFmpeg's frame threads where the codec has them, and
# its slice threads (PyAV's default alone). Most files hold one slice a frame (the ffmpeg command
# line's x264, most encoders), which slice threads decode on one core; a whole file's frames are
# decoded in order, so frame threads' latency costs nothing (a live source keeps the default)
DECODE_THREADING = "AUTO"


@dataclass(frozen=True)
class FrameIndex:
    """Every frame of a stream in presentation order, from its packets."""

    pts: np.ndarray  # int64 [n] sorted, in the stream's time base; empty when packets lack them
    times: np.ndarray  # float64 [n] seconds from the stream's first frame
    keyframes: np.ndarray  # int64 presentation indices of key frames, sorted
    duration: float  # seconds the stream spans (last frame's start plus one frame)

    @property
    def timed(self) -> bool:
        """Frames can be found by their pts (so seeks are possible)."""
        return len(self.pts) > 0


def index_stream(path: str) -> FrameIndex:
    """Demux (not decode) the first video stream once. Packets without a pts (raw streams) leave
    the index untimed: frames are then counted as one decode pass yields them."""
    import av

    pts, keys = [], []
    with av.open(path) as container:
        if not container.streams.video:
            raise MediaError(f"no frames could be read from {path}: it holds no video stream")
        stream = container.streams.video[0]
        base = float(stream.time_base or 0)
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's final flush packet
                continue
            if packet.pts is None or not base:
                return _counted_index(path)
            pts.append(packet.pts)
            if packet.is_keyframe:
                keys.append(packet.pts)
    order = np.unique(np.asarray(pts, dtype=np.int64))
    if len(order) != len(pts):  # repeated pts: frames cannot be told apart by them
        return _counted_index(path)
    times = (order - order[0]) * base if len(order) else np.zeros(0)
    keyframes = np.searchsorted(order, np.asarray(keys, dtype=np.int64))
    return FrameIndex(order, times, keyframes, _span(times))


def _counted_index(path: str) -> FrameIndex:
    """Times from one decode pass: each frame's own time, or its number over the stream's rate."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = DECODE_THREADING
        rate = float(stream.guessed_rate or stream.average_rate or 0) or 1.0
        stamps = [frame.time for frame in container.decode(stream)]
    if any(t is None for t in stamps):
        stamps = [i / rate for i in range(len(stamps))]
    times = np.asarray(stamps, dtype=np.float64)
    times = times - times[0] if len(times) else times
    return FrameIndex(np.zeros(0, np.int64), times, np.zeros(0, np.int64), _span(times))


def _span(times: np.ndarray) -> float:
    if not len(times):
        return 0.0
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
    return float(times[-1] - times[0] + step)


def nearest_frames(times: np.ndarray, wanted: list[float]) -> np.ndarray:
    """For each wanted time, the index of the frame whose time is nearest (ties: the earlier)."""
    if len(times) < 2:
        return np.zeros(len(wanted), np.int64)
    goal = np.asarray(wanted, dtype=np.float64)
    at = np.clip(np.searchsorted(times, goal), 1, len(times) - 1)
    earlier = goal - times[at - 1] <= times[at] - goal
    return np.where(earlier, at - 1, at).astype(np.int64)


def rgb_converter():
    """frame -> its RGB array [H, W, 3] uint8, through one swscale context for every frame given.
    A frame's own `to_ndarray(format="rgb24")` sets up a context for that frame alone, and since
    PyAV 17 (swscale on threads of its own) that set-up cost more than a 720p frame's conversion
    (docs/benchmarks.md). Not for two threads at once."""
    from av.video.reformatter import VideoReformatter

    reformatter = VideoReformatter()
    return lambda frame: reformatter.reformat(frame, format="rgb24").to_ndarray()


class FrameCursor:
    """Decodes one stream forward, remembering where it stopped."""

    def __init__(self, path: str, index: FrameIndex):
        self.path, self.index = path, index
        self._close = None
        self._rgb = rgb_converter()
        self._restart()

    def _restart(self) -> None:
        """Close the container (if open) and open it again at the stream's start."""
        import av

        if self._close is not None:
            self._close()  # closes the old container and drops its finalizer
        self.container = av.open(self.path)
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = DECODE_THREADING
        self.frames = None  # the decoding iterator, started on the first read
        self.next_index = 0  # presentation index of the frame the iterator yields next
        self._close = weakref.finalize(self, self.container.close)

    def read(self, picks: np.ndarray) -> np.ndarray:
        """RGB frames [len(picks), H, W, 3] for non-decreasing presentation indices."""
        out = self._read(picks, seek=True)
        if any(image is None for image in out) and self.index.timed:
            self._restart()  # a seek that landed past its key frame (a broken index)
            out = self._read(picks, seek=False)
        missing = [int(picks[s]) for s, image in enumerate(out) if image is None]
        if missing:
            raise ValueError(f"frame {missing[0]} could not be decoded")
        return np.stack(out)

    def _read(self, picks: np.ndarray, seek: bool) -> list[np.ndarray | None]:
        slots: dict[int, list[int]] = {}
        for slot, frame in enumerate(picks.tolist()):
            slots.setdefault(frame, []).append(slot)
        out: list[np.ndarray | None] = [None] * len(picks)
        if seek:
            self._reach(int(picks[0]))
        for number, frame in self._decoded():
            if number in slots:
                image = self._rgb(frame)
                for slot in slots[number]:
                    out[slot] = image
            if number >= int(picks[-1]):
                break
        return out

    def _reach(self, first: int) -> None:
        """Position the decoder so that frame `first` is still to come, decoding as little as
        possible on the way."""
        if not self.index.timed:
            if first < self.next_index:  # no seeks without pts (nor in raw streams): start over
                self._restart()
            return
        keys = self.index.keyframes
        at = int(np.searchsorted(keys, first, side="right")) - 1
        before = int(keys[at]) if at >= 0 else 0  # the last key frame at or before `first`
        if first < self.next_index or before > self.next_index or self.frames is None:
            target = int(self.index.pts[before])
            self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
            self.frames, self.next_index = None, -1  # known again at the first decoded frame

    def _decoded(self):
        if self.frames is None:
            self.frames = self.container.decode(self.stream)
        for frame in self.frames:
            number = self._number(frame)
            if number is None:
                continue
            self.next_index = number + 1
            yield number, frame

    def _number(self, frame) -> int | None:
        if not self.index.timed:
            return self.next_index if self.next_index >= 0 else None
        if frame.pts is None:
            return None
        at = int(np.searchsorted(self.index.pts, frame.pts))
        if at < len(self.index.pts) and self.index.pts[at] == frame.pts:
            return at
        return None  # a frame the index does not hold (a leading B-frame of an open GOP)
