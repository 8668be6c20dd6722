"""Regenerate the committed samples: a short clip of moving coloured shapes, an image set and a PDF.

python samples/make_samples.py        (deterministic: same bytes for the PNGs/PDF, same frames for
the clip)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZE = 128
FPS = 8
SHAPES = [  # (shape, colour, start xy, velocity xy per second)
    ("circle", (220, 40, 40), (10, 20), (14, 6)),
    ("square", (40, 90, 230), (60, 60), (-10, -8)),
    ("triangle", (240, 210, 30), (30, 70), (8, -12)),
]


def draw_shape(
    draw: ImageDraw.ImageDraw, kind: str, colour, x: float, y: float, r: int = 10
) -> None:
    box = (x - r, y - r, x + r, y + r)
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)


def frame_at(t: float, visible: list[str] | None = None) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    for kind, colour, (x0, y0), (vx, vy) in SHAPES:
        if visible is not None and kind not in visible:
            continue
        x = (x0 + vx * t) % (SIZE - 20) + 10
        y = (y0 + vy * t) % (SIZE - 20) + 10
        draw_shape(draw, kind, colour, x, y)
    return image


# The clip is a scene of the synthetic world the demo backbone was trained on (mmkv_cli/synth): a
# red circle, then a blue square, then a yellow triangle, 16 frames at 2 fps, each written 4 times
# (an 8 fps file).
CLIP_EVENTS = (("circle", "red", 0, 6), ("square", "blue", 6, 11), ("triangle", "yellow", 11, 16))


def write_clip(path: Path) -> None:
    from mmkv_cli.study.synth import write_video
    from mmkv_cli.study.synth.world import Clip, Event, render

    events = tuple(
        Event(shape, colour, a, b, 0.45, 0.5, 0.012, -0.006) for shape, colour, a, b in CLIP_EVENTS
    )
    clip = Clip("normal", 16, events)
    frames = np.stack([render(clip, f) for f in range(clip.frames) for _ in range(FPS // 2)])
    write_video(path, frames, FPS)


def write_images(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    for i in range(4):
        frame_at(i * 0.8).save(folder / f"shot_{i:02d}.png")


def write_pdf(path: Path) -> None:
    pages = []
    for i, (kind, colour, _, _) in enumerate(SHAPES):
        page = Image.new("RGB", (120, 160), "white")
        draw = ImageDraw.Draw(page)
        draw.text((10, 10), f"page {i + 1}: {kind}", fill="black")
        draw_shape(draw, kind, colour, 60, 90, r=25)
        pages.append(page)
    pages[0].save(path, save_all=True, append_images=pages[1:], resolution=72)


if __name__ == "__main__":
    write_clip(HERE / "clip.mp4")
    write_images(HERE / "images")
    write_pdf(HERE / "doc.pdf")
    print("wrote samples/clip.mp4, samples/images/, samples/doc.pdf")
