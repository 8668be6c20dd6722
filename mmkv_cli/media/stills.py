"""Still frames: an image folder or glob as a frame sequence, and PDF pages rendered to images."""

from __future__ import annotations

import glob as globlib
import math
from pathlib import Path

import numpy as np
from PIL import Image

from mmkv_cli.core.errors import MediaError
from mmkv_cli.media.base import Media, sha256_files

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}


def image_paths(spec: str) -> list[Path]:
    path = Path(spec)
    if path.is_dir():
        found = [p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
    else:
        found = [Path(p) for p in globlib.glob(spec) if Path(p).suffix.lower() in IMAGE_SUFFIXES]
    return sorted(found)


def _rgb_at(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    # A video processor wants one frame size; the first frame sets it.
    rgb = image.convert("RGB")
    return np.asarray(rgb.resize(size) if rgb.size != size else rgb)


MAX_PAGE_PIXELS = 4_000_000  # a rendered PDF page at most (2000 x 2000)


def _thin(count: int, max_frames: int) -> list[int]:
    if not max_frames or count <= max_frames:
        return list(range(count))
    return sorted({int(i) for i in np.linspace(0, count - 1, max_frames)})


def load_images(spec: str, max_frames: int) -> Media:
    """Images are decoded as they are read (a set of thousands of photos never sits in memory);
    every picked file's header is checked now, before any work."""
    paths = image_paths(spec)
    if not paths:
        raise MediaError(f"no images found at {spec}")
    picks = _thin(len(paths), max_frames)
    picked = [paths[i] for i in picks]
    size = _open_image(picked[0], lambda image: image.size)
    for path in picked[1:]:
        _open_image(path, lambda image: None)  # every header now, before any work

    def read(start: int, stop: int) -> np.ndarray:
        return np.stack([_open_image(p, lambda im: _rgb_at(im, size)) for p in picked[start:stop]])

    return Media(
        kind="images",
        source=spec,
        digest=sha256_files(paths),
        timestamps=[float(i) for i in picks],
        _read=read,
        offered=len(paths),
    )


def _open_image(path: Path, use):
    """use(image) on an opened image file; any failure is that file's MediaError."""
    try:
        with Image.open(path) as image:
            return use(image)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise MediaError(f"cannot read image {path}: {err}") from err


def page_scale(width_pt: float, height_pt: float, scale: float) -> float:
    """The render scale for a page of this size: `scale` (1: 72 dpi), less where the page would
    exceed MAX_PAGE_PIXELS (a tiny PDF can declare pages of 14,400 points a side: 6.7 GB of pixels
    at 1:1). The processors resize every page to a few hundred pixels a side anyway."""
    area = max(1.0, float(width_pt) * float(height_pt))
    return min(scale, math.sqrt(MAX_PAGE_PIXELS / area))


def load_pdf(path: Path, max_frames: int, scale: float = 1.0) -> Media:
    """Pages are rendered as they are read: a document of hundreds of pages holds one chunk."""
    import pypdfium2 as pdfium

    def render(i: int) -> Image.Image:
        return doc[picks[i]].render(scale=scales[i]).to_pil()

    try:
        doc = pdfium.PdfDocument(str(path))
        pages = len(doc)
        picks = _thin(pages, max_frames)
        scales = [page_scale(*doc[i].get_size(), scale) for i in picks]
        if not picks:
            raise MediaError(f"no pages in {path}")
        size = render(0).size  # a PDF that opens but cannot render fails now, not mid-encode
    except MediaError:
        raise
    except Exception as err:  # pdfium raises PdfiumError and plain OSError
        raise MediaError(f"cannot read PDF {path}: {err}") from err

    def read(start: int, stop: int) -> np.ndarray:
        try:
            return np.stack([_rgb_at(render(i), size) for i in range(start, stop)])
        except Exception as err:
            raise MediaError(f"cannot read PDF {path}: {err}") from err

    return Media(
        kind="pdf",
        source=str(path),
        digest=sha256_files([path]),
        timestamps=[float(i) for i in picks],
        _read=read,
        offered=pages,
    )
