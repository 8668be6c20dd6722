"""The demo-grid world: the shape world's events and questions, but each shape is small (about one
of the 4 x 4 tokens a demo-grid frame becomes), moves inside one quadrant, and sits on a textured,
slowly changing background with a few static blobs. Most of a frame's tokens are background, as in
real video, so a method must choose tokens inside frames, not only frames.

Pure functions of a seed, like world.py: the training script and `mmkv synth --world grid` render
the same clips.
"""

from __future__ import annotations

import zlib

import numpy as np
from PIL import Image, ImageDraw

from mmkv_cli.study.synth.world import (
    COLOURS,
    COUNT_WORDS,
    NEEDLE,
    Clip,
    Event,
    _draw,
    chance,
    needle_clip,
    normal_clip,
)

QUADRANTS = ["top left", "top right", "bottom left", "bottom right"]
GRID_QUESTION_TYPES = ["color", "shape", "first", "last", "count", "moment", "needle", "where"]
RADIUS = 0.1  # of the frame side: a shape spans about one token of a 4 x 4 grid
BLOB_COLOURS = [(96, 84, 72), (72, 92, 88), (104, 100, 80), (80, 76, 96)]  # muted: no palette hue


def _quadrant_of(event: Event) -> int:
    return int(event.x0 >= 0.5) + 2 * int(event.y0 >= 0.5)


def placed(rng: np.random.Generator, shape: str, colour: str, start: int, stop: int) -> Event:
    """A small shape in a random quadrant, drifting slowly; render() keeps it inside it."""
    quadrant = int(rng.integers(4))
    x = (quadrant % 2) * 0.5 + float(rng.uniform(0.15, 0.35))
    y = (quadrant // 2) * 0.5 + float(rng.uniform(0.15, 0.35))
    vx, vy = (float(v) for v in rng.uniform(-0.008, 0.008, size=2))
    return Event(shape, colour, start, stop, x, y, vx, vy)


def grid_normal_clip(rng: np.random.Generator, frames: int) -> Clip:
    return normal_clip(rng, frames, place=placed)


def grid_needle_clip(rng: np.random.Generator, frames: int) -> Clip:
    """Distractors fill the clip (crosses, the look-alike, often); one star shows for 1-2 frames."""
    return needle_clip(rng, frames, place=placed)


def grid_questions(clip: Clip, rng: np.random.Generator) -> list[dict]:
    """The shape world's questions for this clip, and where one of its shapes was."""
    if clip.kind == "needle":
        star = next(e for e in clip.events if e.shape == NEEDLE)
        return [
            {"question": f"what color was the {NEEDLE} ?", "answer": star.colour, "type": "needle"},
            {
                "question": f"where was the {NEEDLE} ?",
                "answer": QUADRANTS[_quadrant_of(star)],
                "type": "where",
            },
        ]
    events = list(clip.events)
    pick, other, shown, placed = (events[int(rng.integers(len(events)))] for _ in range(4))
    moment = int(rng.integers(shown.start, shown.stop))
    return [
        {"question": f"what color is the {pick.shape} ?", "answer": pick.colour, "type": "color"},
        {"question": f"which shape is {other.colour} ?", "answer": other.shape, "type": "shape"},
        {"question": "which shape appeared first ?", "answer": events[0].shape, "type": "first"},
        {"question": "which shape appeared last ?", "answer": events[-1].shape, "type": "last"},
        {
            "question": "how many shapes appeared ?",
            "answer": COUNT_WORDS[len(events)],
            "type": "count",
        },
        {
            "question": "what shape is shown now ?",
            "answer": shown.shape,
            "type": "moment",
            "frame": moment,
        },
        {
            "question": f"where was the {placed.shape} ?",
            "answer": QUADRANTS[_quadrant_of(placed)],
            "type": "where",
        },
    ]


def grid_chance(question_type: str) -> float:
    return 1 / len(QUADRANTS) if question_type == "where" else chance(question_type)


def _background(clip: Clip, size: int) -> tuple[np.ndarray, np.ndarray, list]:
    """The clip's own texture: a dim two-colour gradient, two low-frequency noise fields the
    frames blend between, and 2-3 static blobs. Seeded by the clip itself."""
    rng = np.random.default_rng(zlib.crc32(repr(clip.events).encode()))
    ends = rng.uniform(35, 95, size=(2, 3))
    angle = rng.uniform(0, 2 * np.pi)
    axis = np.linspace(-1, 1, size)
    along = np.cos(angle) * axis[None, :] + np.sin(angle) * axis[:, None]
    t = ((along - along.min()) / np.ptp(along))[..., None]
    gradient = ends[0] * (1 - t) + ends[1] * t
    noise = []
    for _ in range(2):
        coarse = Image.fromarray(rng.uniform(0, 255, size=(6, 6)).astype(np.uint8))
        field = np.asarray(coarse.resize((size, size), Image.BILINEAR), dtype=np.float32)
        noise.append((field - 127.5) / 127.5 * 14)
    blobs = [
        (
            rng.uniform(0.1, 0.9) * size,
            rng.uniform(0.1, 0.9) * size,
            rng.uniform(0.05, 0.09) * size,
            BLOB_COLOURS[int(rng.integers(len(BLOB_COLOURS)))],
        )
        for _ in range(int(rng.integers(2, 4)))
    ]
    return gradient, np.stack(noise), blobs


def render_grid(clip: Clip, frame: int, size: int = 128, background=None) -> np.ndarray:
    """uint8 [size, size, 3]: the background at `frame` and the shape on screen, if any."""
    gradient, noise, blobs = background or _background(clip, size)
    mix = 0.5 + 0.5 * np.cos(frame / 12.0)  # the texture drifts slowly between its two fields
    base = gradient + (mix * noise[0] + (1 - mix) * noise[1])[..., None]
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for x, y, r, colour in blobs:
        draw.ellipse((x - r, y - 0.7 * r, x + r, y + 0.7 * r), fill=colour)
    event = clip.shown_at(frame)
    if event is not None:
        cx, cy = shape_centre(event, frame)
        _draw(draw, event.shape, COLOURS[event.colour], cx * size, cy * size, RADIUS * size)
    return np.asarray(image)


def shape_centre(event: Event, frame: int) -> tuple[float, float]:
    """Where the shape is at `frame`, as fractions of the side: drifting, kept in its quadrant."""
    q = _quadrant_of(event)
    lo_x, lo_y = (q % 2) * 0.5 + RADIUS, (q // 2) * 0.5 + RADIUS
    t = frame - event.start
    cx = float(np.clip(event.x0 + event.vx * t, lo_x, lo_x + 0.5 - 2 * RADIUS))
    cy = float(np.clip(event.y0 + event.vy * t, lo_y, lo_y + 0.5 - 2 * RADIUS))
    return cx, cy


def covered_tokens(event: Event, frame: int, side: int = 4) -> list[int]:
    """The tokens (row-major on a side x side grid) the shape overlaps at `frame`."""
    cx, cy = shape_centre(event, frame)
    reach = 0.8 * RADIUS
    cols = range(max(0, int((cx - reach) * side)), min(side, int((cx + reach) * side) + 1))
    rows = range(max(0, int((cy - reach) * side)), min(side, int((cy + reach) * side) + 1))
    return [r * side + c for r in rows for c in cols]


def render_grid_clip(clip: Clip, size: int = 128) -> np.ndarray:
    background = _background(clip, size)
    return np.stack([render_grid(clip, f, size, background) for f in range(clip.frames)])
