"""`mmkv synth`: write seeded synthetic clips and a qa.jsonl in the eval format."""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np

from mmkv_cli.core.errors import UsageError
from mmkv_cli.study.synth import grid, world
from mmkv_cli.study.synth.world import Clip

KINDS = ("mixed", "normal", "needle")
WORLDS = ("demo", "grid")  # demo: a centred shape filling the frame; grid: small ones on texture


def make_clip(
    seed: int, index: int, frames: int, kind: str, world_name: str = "demo"
) -> tuple[Clip, list[dict]]:
    """Clip `index` of a dataset: its own generator, so any clip can be rebuilt without the
    others."""
    rng = np.random.default_rng([seed, index])
    if kind == "mixed":
        kind = "needle" if index % 2 == 1 and frames >= 16 else "normal"
    if world_name == "grid":
        make = grid.grid_needle_clip if kind == "needle" else grid.grid_normal_clip
        clip = make(rng, frames)
        return clip, grid.grid_questions(clip, rng)
    clip = world.needle_clip(rng, frames) if kind == "needle" else world.normal_clip(rng, frames)
    return clip, world.questions(clip, rng)


def render_frames(clip: Clip, world_name: str = "demo", size: int = 128) -> np.ndarray:
    """uint8 [frames, size, size, 3] of a clip in its world."""
    if world_name == "grid":
        return grid.render_grid_clip(clip, size)
    return world.render_clip(clip, size)


def write_video(path: Path, frames: np.ndarray, fps: float) -> None:
    """H.264 at near-lossless quality: colours and edges survive the round trip the model will
    see."""
    import av

    tmp = path.with_name(path.name + ".part")
    with av.open(str(tmp), "w", format="mp4") as container:
        rate = Fraction(fps).limit_denominator(1000)  # PyAV wants a rational rate (0.5 fps: 1/2)
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "4", "preset": "veryfast"}
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)


def write_dataset(
    out_dir: str | Path,
    clips: int,
    frames: int,
    seed: int = 0,
    fps: float = 2.0,
    size: int = 128,
    kind: str = "mixed",
    force: bool = False,
    world_name: str = "demo",
) -> dict:
    if world_name not in WORLDS:
        raise UsageError(f"unknown world '{world_name}' ({', '.join(WORLDS)})")
    if clips < 1 or frames < 4:
        raise UsageError("synth needs at least 1 clip of at least 4 frames")
    if kind not in KINDS:
        raise UsageError(f"unknown clip kind '{kind}' ({', '.join(KINDS)})")
    if not (math.isfinite(fps) and fps > 0):
        raise UsageError("--fps must be a positive number of frames a second")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UsageError(f"{out_dir} is a file: synth writes a folder (clips/ and qa.jsonl)")
    if kind == "needle" and frames < 16:
        raise UsageError("needle clips need at least 16 frames")
    out = Path(out_dir)
    if (out / "qa.jsonl").exists() and not force:
        raise UsageError(
            f"{out} already holds a synthetic set (qa.jsonl): pick another folder or pass --force"
        )
    (out / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(clips):
        clip, qa = make_clip(seed, index, frames, kind, world_name)
        name = f"clips/clip_{index:04d}.mp4"
        write_video(out / name, render_frames(clip, world_name, size), fps)
        for q in qa:
            row = {
                "video": name,
                **{k: v for k, v in q.items() if k != "frame"},
                "clip_kind": clip.kind,
            }
            if "frame" in q:  # asked at that frame's time: the stream is seen up to there
                row["at"] = q["frame"] / fps
            rows.append(row)
    qa_path = out / "qa.jsonl"
    qa_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "folder": str(out),
        "clips": clips,
        "frames": frames,
        "questions": len(rows),
        "world": world_name,
        "qa": str(qa_path),
    }
