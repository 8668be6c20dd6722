"""The synthetic world: clips of coloured shapes shown one after another, and questions with
one-word answers.

Everything is a pure function of a seed, so a clip, its frames and its questions can be rebuilt
anywhere (the training script renders in memory; `mmkv synth` writes the same clips as video files).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ["circle", "square", "triangle", "cross", "ring", "star"]
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 90, 230),
    "yellow": (240, 210, 30),
    "purple": (150, 60, 200),
    "white": (240, 240, 240),
}
BACKGROUND = (60, 60, 60)
NEEDLE = "star"  # in needle clips it appears once, briefly; crosses (the look-alike) fill the rest
COUNT_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]
QUESTION_TYPES = ["color", "shape", "first", "last", "count", "moment", "needle"]
MOMENT_QUESTION = "what shape is shown now ?"  # asked at a moment: `at` in qa.jsonl, `ask --at`


@dataclass(frozen=True)
class Event:
    shape: str
    colour: str
    start: int  # first frame shown
    stop: int  # one past the last frame shown
    x0: float  # centre at `start`, as a fraction of the frame side
    y0: float
    vx: float  # drift per frame, fraction of the side
    vy: float


@dataclass(frozen=True)
class Clip:
    kind: str  # normal | needle
    frames: int
    events: tuple[Event, ...]

    def shown_at(self, frame: int) -> Event | None:
        return next((e for e in self.events if e.start <= frame < e.stop), None)


def _drifting(rng: np.random.Generator, shape: str, colour: str, start: int, stop: int) -> Event:
    return Event(
        shape,
        colour,
        start,
        stop,
        float(rng.uniform(0.4, 0.6)),
        float(rng.uniform(0.4, 0.6)),
        float(rng.uniform(-0.01, 0.01)),
        float(rng.uniform(-0.01, 0.01)),
    )


def _spans(
    rng: np.random.Generator, frames: int, count: int, min_len: int
) -> list[tuple[int, int]]:
    """`count` ordered, non-overlapping spans of at least min_len frames, with gaps of random
    length."""
    free = frames - count * min_len
    # gap, extra length, gap, extra length, ...
    cuts = np.sort(rng.integers(0, free + 1, size=2 * count))
    spans, cursor, previous = [], 0, 0
    for i in range(count):
        gap, extra = cuts[2 * i] - previous, cuts[2 * i + 1] - cuts[2 * i]
        previous = cuts[2 * i + 1]
        start = cursor + int(gap)
        stop = start + min_len + int(extra)
        spans.append((start, stop))
        cursor = stop
    return spans


def normal_clip(
    rng: np.random.Generator, frames: int, max_events: int = 5, place=_drifting
) -> Clip:
    """2..max_events shapes, each shape and colour at most once, shown one after another.
    place(rng, shape, colour, start, stop): where an event sits and drifts (grid has its own)."""
    count = int(rng.integers(2, min(max_events, frames // 2) + 1))
    shapes = rng.choice(SHAPES, size=count, replace=False)
    colours = rng.choice(list(COLOURS), size=count, replace=False)
    events = [
        place(rng, str(s), str(c), a, b)
        for s, c, (a, b) in zip(shapes, colours, _spans(rng, frames, count, 2))
    ]
    return Clip("normal", frames, tuple(events))


def needle_clip(rng: np.random.Generator, frames: int, place=_drifting) -> Clip:
    """Distractor shapes (colours repeat) fill the clip; one star shows for 1-2 frames somewhere in
    it."""
    fillers = [s for s in SHAPES if s != NEEDLE]
    events, cursor = [], 0
    while cursor < frames:
        length = int(rng.integers(2, 9))
        shape = "cross" if rng.random() < 0.4 else str(rng.choice(fillers))
        events.append(
            place(rng, shape, str(rng.choice(list(COLOURS))), cursor, min(frames, cursor + length))
        )
        cursor += length
    length = int(rng.integers(1, 3))
    start = int(rng.integers(0, frames - length + 1))
    needle = place(rng, NEEDLE, str(rng.choice(list(COLOURS))), start, start + length)
    # The needle replaces whatever was on screen during its frames.
    kept = []
    for e in events:
        for a, b in ((e.start, min(e.stop, start)), (max(e.start, start + length), e.stop)):
            if b > a:
                kept.append(Event(e.shape, e.colour, a, b, e.x0, e.y0, e.vx, e.vy))
    return Clip("needle", frames, tuple(sorted(kept + [needle], key=lambda e: e.start)))


def questions(clip: Clip, rng: np.random.Generator) -> list[dict]:
    """One question of every type that the clip can answer: {question, answer, type}."""
    if clip.kind == "needle":
        star = next(e for e in clip.events if e.shape == NEEDLE)
        return [
            {"question": f"what color was the {NEEDLE} ?", "answer": star.colour, "type": "needle"}
        ]
    events = list(clip.events)
    pick = events[int(rng.integers(len(events)))]
    other = events[int(rng.integers(len(events)))]
    shown = events[int(rng.integers(len(events)))]
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
        {"question": MOMENT_QUESTION, "answer": shown.shape, "type": "moment", "frame": moment},
    ]


def chance(question_type: str) -> float:
    """Accuracy of a uniform guess over the answers a question of this type can have."""
    return {
        "color": 1 / len(COLOURS),
        "shape": 1 / len(SHAPES),
        "first": 1 / len(SHAPES),
        "last": 1 / len(SHAPES),
        "count": 1 / 4,
        "moment": 1 / len(SHAPES),
        "needle": 1 / len(COLOURS),
    }[question_type]


def _draw(draw: ImageDraw.ImageDraw, shape: str, fill, cx: float, cy: float, r: float) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle((cx - 0.85 * r, cy - 0.85 * r, cx + 0.85 * r, cy + 0.85 * r), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    elif shape == "cross":
        w = 0.3 * r
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    elif shape == "ring":
        draw.ellipse(box, fill=fill)
        draw.ellipse((cx - 0.55 * r, cy - 0.55 * r, cx + 0.55 * r, cy + 0.55 * r), fill=BACKGROUND)
    elif shape == "star":
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, 0.45 * r)
        draw.polygon(
            [(cx + a * np.cos(t), cy - a * np.sin(t)) for a, t in zip(radii, angles)], fill=fill
        )
    else:
        raise ValueError(f"unknown shape {shape}")


def render(clip: Clip, frame: int, size: int = 128) -> np.ndarray:
    """uint8 [size, size, 3]: the shape on screen at `frame` (or the empty background)."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    event = clip.shown_at(frame)
    if event is not None:
        t = frame - event.start
        r = 0.3 * size
        cx = np.clip(event.x0 + event.vx * t, 0.35, 0.65) * size
        cy = np.clip(event.y0 + event.vy * t, 0.35, 0.65) * size
        _draw(ImageDraw.Draw(image), event.shape, COLOURS[event.colour], cx, cy, r)
    return np.asarray(image)


def render_clip(clip: Clip, size: int = 128) -> np.ndarray:
    return np.stack([render(clip, f, size) for f in range(clip.frames)])
