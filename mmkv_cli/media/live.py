"""Frames from a source still arriving: a container piped on stdin ('-'), a file still being
written, a network stream FFmpeg opens (rtsp://, rtmp://, udp://, http(s):// MPEG-TS or HLS), or
a V4L2 device (/dev/video*). Frames are taken at `fps` by their timestamps, as a file's are
(the frame nearest each tick, the earlier on a tie), so a stream and its recording give the same
frames.

A thread decodes and samples; what it takes waits in a bounded queue. When the encode falls
behind, the rule is stated, never memory without bound: `wait` holds the source back (a pipe or a
file loses nothing; their default), `drop` lets the oldest waiting frame go and counts it (a
camera or a broadcast does not wait; their default).
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmkv_cli.core.errors import MediaError
from mmkv_cli.media.pyav_frames import rgb_converter

NETWORK = ("rtsp://", "rtsps://", "rtmp://", "rtmps://", "udp://", "tcp://", "http://", "https://")
_END = object()  # the reader's last word: the source ended
# FFmpeg probes 5 MB or 5 s of stream before its first frame by default: on a low-bitrate pipe that
# is many seconds of waiting. A few KB find an MPEG-TS's or a Matroska's video stream and codec.
LOW_LATENCY = {"probesize": "4096", "analyzeduration": "0"}


@dataclass(frozen=True)
class LiveOptions:
    fps: float | None = None  # frames taken per second of stream (None: the model's)
    buffer: int = 32  # taken frames that may wait for the encode
    behind: str | None = None  # wait | drop (None: wait for pipes and files, drop otherwise)
    stall_s: float = 10.0  # a source silent this long has ended (a file: stopped growing)
    timeout_s: float = 5.0  # a network source's wait to connect, and for each read


def source_kind(spec: str) -> str:
    """pipe | network | device | file: how the source is opened and how it may fall behind."""
    if spec == "-":
        return "pipe"
    if spec.lower().startswith(NETWORK):
        return "network"
    if spec.startswith("/dev/video"):
        return "device"
    return "file"


class GrowingFile(io.RawIOBase):
    """A file read as it is written: at its end, wait for more until it has been still for
    `stall_s` seconds since it last grew (then it has ended, for every later read too: FFmpeg reads
    its end several times, and each must not wait the whole stall again)."""

    def __init__(self, path: str, stall_s: float, stop: threading.Event):
        self._fh = open(path, "rb")  # noqa: SIM115 (closed with this reader)
        self.stall_s, self.stop = stall_s, stop
        self.read_bytes = 0
        self._grew = time.monotonic()
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.stop.is_set() and not self._ended:
            n = self._fh.readinto(buffer)
            if n:
                self._grew = time.monotonic()
                self.read_bytes += n
                return n
            if time.monotonic() - self._grew > self.stall_s:
                self._ended = True
                return 0
            time.sleep(0.05)
        return 0

    def unread(self) -> int:
        """Bytes written to the file that this reader has not reached yet."""
        try:
            return max(0, os.fstat(self._fh.fileno()).st_size - self.read_bytes)
        except (OSError, ValueError):  # closed
            return 0

    def close(self) -> None:
        self._fh.close()
        super().close()


class Ticks:
    """Sampling at fps by timestamps: the frame nearest each tick k / fps, the earlier on a tie,
    as a file's sampling picks them. A tick is taken once a frame reaches it; a file, knowing its
    length, leaves out a tick less than a period before its end, so the last tick of a stream may
    be one a recording of it would not take."""

    def __init__(self, fps: float):
        self.fps, self.k = fps, 0
        self.last: tuple[float, np.ndarray] | None = None
        self.first_time: float | None = None
        self.count = 0

    def offer(self, at: float, frame) -> list[tuple[float, object]]:
        """A decoded frame (its time from the first): the (tick, frame) pairs it settles."""
        out = []
        while self.k / self.fps <= at:
            tick = self.k / self.fps
            earlier = self.last is not None and tick - self.last[0] <= at - tick
            out.append((tick, self.last[1] if earlier else frame))
            self.k += 1
        self.last = (at, frame)
        self.count += 1
        self.first_time = at if self.first_time is None else self.first_time
        return out

    def end(self) -> list[tuple[float, object]]:
        """The ticks after the last frame that a file of this stream samples: whole periods of
        1 / fps within its length (the last frame's time plus one frame's)."""
        if self.last is None:
            return []
        at, frame = self.last
        step = (at - self.first_time) / (self.count - 1) if self.count > 1 else 1.0
        out = []
        while (self.k + 1) / self.fps <= at + step + 1e-9:
            out.append((self.k / self.fps, frame))
            self.k += 1
        return out


class LiveSource:
    """Sampled frames of one live source, in order, as (seconds from its first frame, RGB)."""

    def __init__(self, spec: str, options: LiveOptions | None = None):
        """Checks the source at once (a model takes seconds to load; a typo should not): a file
        or device that is not there, a network source that does not answer within the timeout."""
        self.spec, self.options = spec, options or LiveOptions()
        self.kind = source_kind(spec)
        if self.kind == "file" and not Path(spec).is_file():
            raise MediaError(f"no such file: {spec}")
        if self.kind == "device" and not Path(spec).exists():
            raise MediaError(f"no such device: {spec}")
        if self.kind == "pipe" and (sys.stdin is None or sys.stdin.closed):
            raise MediaError("stdin is closed: '-' has nothing to read (pipe a stream into it)")
        if not self.options.timeout_s > 0:
            raise MediaError(f"the timeout must be positive, got {self.options.timeout_s}")
        if self.options.fps is None or self.options.fps <= 0:
            raise MediaError(f"fps must be positive, got {self.options.fps}")
        self.behind = self.options.behind or ("wait" if self.kind in ("pipe", "file") else "drop")
        if self.behind not in ("wait", "drop"):
            raise MediaError(f"unknown rule '{self.behind}' for a source ahead (wait, drop)")
        self.dropped = 0  # frames let go because the encode fell behind
        self.ended_by: str | None = None  # how a network source closed, when it did not end cleanly
        self.reached = 0.0  # the newest frame time decoded from the source
        self._growing: GrowingFile | None = None
        self._digest = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, self.options.buffer))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.kind == "network":
            self._probe()

    def _probe(self) -> None:
        """Open a network source and let go of it: a refused, unreachable or silent address is
        one line now. The stream itself is opened again when the frames are wanted."""
        try:
            self._open().close()
        except Exception as err:  # PyAV's errors, in FFmpeg's words
            raise MediaError(f"cannot open {self.spec}: {ffmpeg_line(err)}") from None

    def start(self) -> None:
        """Begin reading now (a pipe or a file, whose bytes wait for the reader: their probe and
        first frames come in while the model loads). `frames` starts it otherwise."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name="mmkv-live-source", daemon=True)
            self._thread.start()

    @property
    def digest(self) -> str:
        """sha256 of the frames taken so far (the source's bytes are never all kept)."""
        return self._digest.hexdigest()

    def frames(self) -> Iterator[tuple[float, np.ndarray]]:
        """The sampled frames until the source ends, breaks, stalls, or `close` is called. A file
        ends when it stops growing (its reader says so); any other source silent for `stall_s`
        + 5 s has stalled, whatever its reader is waiting on."""
        self.start()
        silent_since = time.monotonic()
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                waited = time.monotonic() - silent_since
                if self.kind != "file" and waited > self.options.stall_s + 5:
                    raise MediaError(
                        f"{self.spec} sent nothing for {self.options.stall_s + 5:g} s: the stream "
                        "is taken as stalled"
                    ) from None
                continue
            silent_since = time.monotonic()
            if item is _END:
                return
            if isinstance(item, MediaError):
                raise item
            at, frame = item
            self._digest.update(frame.tobytes())
            yield at, frame

    def close(self) -> None:
        self._stop.set()

    def ahead_of(self, moment: float) -> float:
        """Seconds of stream the source holds past `moment` (a memory's newest frame): decoded and
        not yet taken, and for a file, its bytes not yet read at the rate read so far."""
        ahead = max(0.0, self.reached - moment)
        growing = self._growing
        if growing is not None and growing.read_bytes and self.reached > 0:
            ahead += growing.unread() * self.reached / growing.read_bytes
        return ahead

    # --- the reader thread ---

    def _open(self):
        import av

        timeout = str(int(self.options.timeout_s * 1e6))
        if self.kind == "pipe":  # stdin was found open when this source was made
            # its own unbuffered descriptor: a reader still waiting on the pipe when the process
            # ends holds no lock of sys.stdin's buffer, which the interpreter's shutdown takes
            # (held, it aborted with "could not acquire lock for <stdin>", exit 134)
            piped = os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0)
            return av.open(piped, mode="r", options=LOW_LATENCY)
        if self.kind == "file":
            self._growing = GrowingFile(self.spec, self.options.stall_s, self._stop)
            return av.open(self._growing, mode="r", options=LOW_LATENCY)
        if self.kind == "device":
            return av.open(self.spec, format="v4l2")
        return av.open(self.spec, options={"rw_timeout": timeout, "timeout": timeout})

    def _read(self) -> None:
        try:
            with self._open() as container:
                if not container.streams.video:
                    raise MediaError(f"{self.spec} holds no video stream")
                stream = container.streams.video[0]
                ticks, to_rgb = Ticks(self.options.fps), rgb_converter()
                self._decode(container, stream, ticks, to_rgb)
                for tick, chosen in ticks.end():
                    self._put(tick, to_rgb(chosen))
            self._queue.put(_END)
        except MediaError as err:
            self._queue.put(err)
        except Exception as err:  # PyAV's errors, as one line
            self._queue.put(
                MediaError(f"cannot read the live source {self.spec}: {ffmpeg_line(err)}")
            )

    def _decode(self, container, stream, ticks: Ticks, to_rgb) -> None:
        origin = None
        try:
            for frame in container.decode(stream):
                if self._stop.is_set():
                    return
                if frame.time is None:
                    continue
                origin = frame.time if origin is None else origin
                self.reached = frame.time - origin
                for tick, chosen in ticks.offer(frame.time - origin, frame):
                    self._put(tick, to_rgb(chosen))
        except OSError as err:
            # a broadcast ends by closing its connection, which FFmpeg reads as a broken one
            if origin is None or self.kind != "network":
                raise
            self.ended_by = str(err).splitlines()[0]

    def _put(self, tick: float, rgb: np.ndarray) -> None:
        item = (tick, rgb)
        if self.behind == "wait":
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue
            return
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()  # the oldest waiting frame goes
                    self.dropped += 1
                except queue.Empty:
                    pass


def ffmpeg_line(err: Exception) -> str:
    """An FFmpeg (PyAV) error as the words FFmpeg has for it, without its error number or the
    URL it repeats ("[Errno 1094995529] Invalid data found when processing input: 'rtsp://...'")."""
    if isinstance(err, OSError) and isinstance(err.strerror, str) and err.strerror:
        return err.strerror[0].lower() + err.strerror[1:]  # PyAV's errors are OSErrors
    return str(err).splitlines()[0] if str(err) else type(err).__name__
