"""The Media type every loader returns: frames read lazily by index, with timestamps and a
digest."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Media:
    kind: str  # video | images | pdf
    source: str
    digest: str  # sha256 of the source bytes
    timestamps: list[float]  # seconds (video), index (images), page number (pdf)
    _read: Callable[[int, int], np.ndarray]  # (start, stop) -> uint8 [n, H, W, 3]
    offered: int = 0  # frames (or pages, images) there were before thinning to max_frames; 0: all

    @property
    def frames_offered(self) -> int:
        """How many frames the media offered at its rate, before thinning to max_frames."""
        return max(self.offered, self.num_frames)

    @property
    def num_frames(self) -> int:
        return len(self.timestamps)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Frames [start, stop) as uint8 [n, H, W, 3], to the last frame where stop is past it. A
        range holding no frame is refused in one line: the loaders' own errors for it named an
        index, or an empty list, not the range."""
        stop = min(stop, self.num_frames)
        if not 0 <= start < stop:
            raise ValueError(
                f"frames [{start}, {stop}) of {self.source} hold none of its {self.num_frames}"
            )
        return self._read(start, stop)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "source": self.source,
            "digest": self.digest,
            "frames": self.num_frames,
            "timestamps": [round(t, 4) for t in self.timestamps],
        }


def sha256_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def frames_at(duration: float, fps: float) -> int:
    """How many frames `fps` takes from `duration` seconds (before any thinning)."""
    if duration <= 0 or fps <= 0:
        return 0
    return max(1, int(np.floor(duration * fps + 1e-9)))


def sample_times(duration: float, fps: float, max_frames: int) -> list[float]:
    """Times at `fps` over [0, duration); uniformly thinned to `max_frames` when there are more."""
    count = frames_at(duration, fps)
    if not count:
        return []
    times = np.arange(count) / fps
    if max_frames and count > max_frames:
        times = np.linspace(0, duration, max_frames, endpoint=False) + duration / (2 * max_frames)
    return [float(t) for t in times]
