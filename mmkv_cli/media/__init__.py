"""media -> frames: load_media(path) picks the loader by what the path is."""

from __future__ import annotations

from pathlib import Path

from mmkv_cli.core.errors import MediaError
from mmkv_cli.media.base import Media
from mmkv_cli.media.stills import IMAGE_SUFFIXES, load_images, load_pdf
from mmkv_cli.media.video import load_video

__all__ = ["Media", "check_media", "load_media", "media_kind"]


def _glob(spec: str) -> bool:
    """A pattern such as 'shots/*.png' (a file that is named so is not one)."""
    return any(ch in spec for ch in "*?[") and not Path(spec).exists()


def check_media(spec: str) -> None:
    """What can be refused about a media path without reading it: one that is not there, or is a
    FIFO or a device (which would block or never end). A glob is checked when it is expanded."""
    path = Path(spec)
    if _glob(spec):
        return
    if not path.exists():
        raise MediaError(f"no such file or folder: {spec}")
    if not (path.is_file() or path.is_dir()):
        raise MediaError(f"{spec} is not a regular file or folder")


def media_kind(spec: str) -> str:
    """What load_media would make of `spec`, from its name alone: images, pdf or video."""
    path = Path(spec)
    if _glob(spec) or path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES:
        return "images"
    return "pdf" if path.suffix.lower() == ".pdf" else "video"


def load_media(spec: str, fps: float = 1.0, max_frames: int = 64, backend: str = "auto") -> Media:
    """A video file, a PDF, an image file, an image folder or a glob such as 'shots/*.png'."""
    if fps <= 0:
        raise MediaError(f"fps must be positive, got {fps}")
    if max_frames < 0:
        raise MediaError(f"max-frames must be >= 0, got {max_frames}")
    path, kind = Path(spec), media_kind(spec)
    check_media(spec)
    if kind == "images":  # a glob or a folder as given, an image file by its path
        return load_images(spec if _glob(spec) or path.is_dir() else str(path), max_frames)
    if kind == "pdf":
        return load_pdf(path, max_frames)
    return load_video(path, fps, max_frames, backend)
