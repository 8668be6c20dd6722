"""media -> frames: load_media(path) picks the loader by what the path is."""

from __future__ import annotations

from pathlib import Path

from mmkv_cli.errors import MediaError
from mmkv_cli.media.base import Media
from mmkv_cli.media.stills import IMAGE_SUFFIXES, load_images, load_pdf
from mmkv_cli.media.video import load_video

__all__ = ["Media", "check_media", "load_media", "media_kind"]


def check_media(spec: str) -> None:
    """What can be refused about a media path without reading it: one that is not there, or is a
    FIFO or a device (which would block or never end). A glob is checked when it is expanded."""
    path = Path(spec)
    if any(ch in spec for ch in "*?[") and not path.exists():
        return
    if not path.exists():
        raise MediaError(f"no such file or folder: {spec}")
    if not (path.is_file() or path.is_dir()):
        raise MediaError(f"{spec} is not a regular file or folder")


def media_kind(spec: str) -> str:
    """What load_media would make of `spec`, from its name alone: images, pdf or video."""
    path = Path(spec)
    if any(ch in spec for ch in "*?[") and not path.exists():
        return "images"
    if path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES:
        return "images"
    return "pdf" if path.suffix.lower() == ".pdf" else "video"


def load_media(spec: str, fps: float = 1.0, max_frames: int = 64, backend: str = "auto") -> Media:
    """A video file, a PDF, an image file, an image folder or a glob such as 'shots/*.png'."""
    if fps <= 0:
        raise MediaError(f"fps must be positive, got {fps}")
    if max_frames < 0:
        raise MediaError(f"max-frames must be >= 0, got {max_frames}")
    path = Path(spec)
    if any(ch in spec for ch in "*?[") and not path.exists():
        return load_images(spec, max_frames)
    check_media(spec)
    if path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES:
        return (
            load_images(spec, max_frames) if path.is_dir() else load_images(str(path), max_frames)
        )
    if path.suffix.lower() == ".pdf":
        return load_pdf(path, max_frames)
    return load_video(path, fps, max_frames, backend)
