"""The synthetic world's training batches for scripts/train_demo_model.py: clips rendered in memory
from the same seeded generators `mmkv synth` writes to disk, in the exact prompt layout the LLaVA-OV
adapter uses at encode/ask time. A stage-2 batch depends on (seed, step) alone, so worker processes
can make batches ahead of the trainer without changing what it sees."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmkv_cli.backbones.demo import FRAME_SIDE, GRID_SIDE  # noqa: E402
from mmkv_cli.backbones.llava_onevision import PROMPT  # noqa: E402
from mmkv_cli.study.synth import make_clip, render_frames  # noqa: E402
from mmkv_cli.study.synth.world import Clip, Event  # noqa: E402

# world -> (frame side the vision tower sees, tokens a frame becomes)
WORLD_SHAPES = {"demo": (FRAME_SIDE, 4), "grid": (GRID_SIDE, 16)}
IGNORE = -100  # padding of answers shorter than the batch's longest


class Batches:
    """Prompt ids, pixels and answer ids for clips drawn from a seeded stream."""

    def __init__(self, tokenizer, processor, video_id: int, world: str = "demo"):
        self.tokenizer, self.processor, self.video_id = tokenizer, processor, video_id
        self.world = world
        self.per_frame = WORLD_SHAPES[world][1]
        self.prefix = self.ids(PROMPT.prefix)
        self.end = self.ids("<|im_end|>")

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, specs: list[tuple[int, int, int, str]], rng: np.random.Generator):
        """specs: (seed, index, frames, kind); all the same frame count. One random question per
        clip.

        A moment question sees the clip up to its moment, so the clip is cut there (and moved later
        by blank frames, so every clip of the batch still has `frames` frames).
        """
        frames = specs[0][2]
        videos, rows, answers, types = [], [], [], []
        for seed, index, count, kind in specs:
            clip, qa = make_clip(seed, index, count, kind, self.world)
            q = qa[int(rng.integers(len(qa)))]
            if q["type"] == "moment":  # cut at the moment, blank frames first: same batch length
                clip = truncated(clip, q["frame"] + 1)
                clip = shifted(clip, count - clip.frames)
            videos.append(render_frames(clip, self.world))
            answer = self.ids(q["answer"]) + self.end  # answers are one or two words
            rows.append(
                self.prefix
                + [self.video_id] * (frames * self.per_frame + 1)
                + self.ids(PROMPT.question.format(question=q["question"]))
                + answer
            )
            answers.append(answer)
            types.append(q["type"])
        pixels = self.processor(videos=videos, return_tensors="pt")["pixel_values_videos"]
        # Questions differ in length: pad after the end token (causal attention never looks right),
        # and remember where each row's answer is predicted from.
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        where = torch.tensor([len(r) - len(a) - 1 for r, a in zip(rows, answers)])
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        longest = max(len(a) for a in answers)
        padded = torch.tensor([a + [IGNORE] * (longest - len(a)) for a in answers])
        return ids, pixels, padded, types, where

    def make_multi(self, specs: list[tuple[int, int, int, str]], rng: np.random.Generator):
        """Every question of each clip in one row: [prompt | video | q1 a1 | q2 a2 | ...], each
        question seeing the video and itself only (a 4-D mask) and starting at the same position, as
        if asked alone. One forward supervises all of a clip's answers. Moment questions need a cut
        clip: a clip drawn for one of those carries only it."""
        frames = specs[0][2]
        video_len = len(self.prefix) + frames * self.per_frame + 1
        videos, rows, blocks, targets, types = [], [], [], [], []
        for seed, index, count, kind in specs:
            clip, qa = make_clip(seed, index, count, kind, self.world)
            if kind == "normal" and rng.random() < 1 / 6:
                q = next(x for x in qa if x["type"] == "moment")
                clip = shifted(truncated(clip, q["frame"] + 1), count - q["frame"] - 1)
                asked = [q]
            else:
                asked = [x for x in qa if x["type"] != "moment"]
            videos.append(render_frames(clip, self.world))
            row = self.prefix + [self.video_id] * (frames * self.per_frame + 1)
            spans = []
            for q in asked:
                asking = self.ids(PROMPT.question.format(question=q["question"]))
                answer = self.ids(q["answer"]) + self.end
                turn = asking + answer
                spans.append((len(row), len(row) + len(turn)))
                # every answer token and the end, each predicted from the position before it
                first = len(row) + len(asking) - 1
                targets += [(len(rows), first + t, token) for t, token in enumerate(answer)]
                types.append(q["type"])
                row = row + turn
            rows.append(row)
            blocks.append(spans)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        for r, (row, spans) in enumerate(zip(rows, blocks)):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, 0, :video_len, :video_len] = causal[:video_len, :video_len]
            positions[r, :video_len] = torch.arange(video_len)
            for a, b in spans:
                mask[r, 0, a:b, :video_len] = True
                mask[r, 0, a:b, a:b] = causal[: b - a, : b - a]
                positions[r, a:b] = torch.arange(video_len, video_len + b - a)
            mask[r, 0, len(row) :, :] = causal[len(row) :, :]  # padding rows: anything valid
        pixels = self.processor(videos=videos, return_tensors="pt")["pixel_values_videos"]
        return ids, pixels, mask, positions, torch.tensor(targets), types


def truncated(clip: Clip, frames: int) -> Clip:
    """The clip as seen up to (not including) frame `frames`: what a question asked at that moment
    sees."""
    kept = tuple(
        Event(e.shape, e.colour, e.start, min(e.stop, frames), e.x0, e.y0, e.vx, e.vy)
        for e in clip.events
        if e.start < frames
    )
    return Clip(clip.kind, frames, kept)


def shifted(clip, frames: int):
    """The clip with `frames` empty frames before it."""
    events = tuple(
        Event(e.shape, e.colour, e.start + frames, e.stop + frames, e.x0, e.y0, e.vx, e.vy)
        for e in clip.events
    )
    return Clip(clip.kind, clip.frames + frames, events)


def vision_example(rng: np.random.Generator, world: str, per_frame: int):
    """One frame and, for each of its tokens, (shape, colour) or "none" (the last index of each):
    the demo world's shape fills every token; a grid shape only those it covers."""
    from mmkv_cli.study.synth import grid
    from mmkv_cli.study.synth.world import COLOURS, SHAPES, render

    empty = rng.random() < 0.1
    none = (len(SHAPES), len(COLOURS))
    if world == "grid":
        s, c = int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS)))
        event = grid.placed(rng, SHAPES[s], list(COLOURS)[c], 0, 1)
        clip = Clip("normal", 1, () if empty else (event,))
        covered = set() if empty else set(grid.covered_tokens(event, 0))
        labels = [(s, c) if k in covered else none for k in range(per_frame)]
        return grid.render_grid(clip, 0), labels
    if empty:
        return render(Clip("normal", 1, ()), 0), [none] * per_frame
    s, c = int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS)))
    x, y = float(rng.uniform(0.35, 0.65)), float(rng.uniform(0.35, 0.65))
    event = Event(SHAPES[s], list(COLOURS)[c], 0, 1, x, y, 0.0, 0.0)
    return render(Clip("normal", 1, (event,)), 0), [(s, c)] * per_frame


def stage2_batch(batches: Batches, plan: dict, step: int):
    """(frames, tensors) of stage 2's batch for `step`: it depends on the seed and the step alone,
    so a resumed run, or a worker making it ahead, sees the same batch. plan: seed, steps, batch,
    lengths, curriculum, needle_share, one_question."""
    rng = np.random.default_rng([plan["seed"], step])
    # Curriculum: short clips first (visual features and lookups are learnt cheaply), then longer.
    grown = min(1.0, step / max(1, plan["curriculum"] * plan["steps"]))
    lengths = plan["lengths"]
    allowed = lengths[: max(1, math.ceil(grown * len(lengths)))]
    frames = int(rng.choice(allowed))
    specs = [
        (
            plan["seed"] * 1_000_003 + step,
            b,
            frames,
            "needle" if frames >= 16 and rng.random() < plan["needle_share"] else "normal",
        )
        for b in range(plan["batch"])
    ]
    if plan["one_question"]:
        return frames, batches.make(specs, rng)
    return frames, batches.make_multi(specs, rng)


_AHEAD: tuple[Batches, dict] | None = None  # a worker's (batches, plan), set before the fork


def _ahead_batch(step: int):
    return stage2_batch(*_AHEAD, step)


def stage2_batches(batches: Batches, plan: dict, steps: range, workers: int):
    """Stage 2's batches for `steps`, in order: made here, or by `workers` forked processes a
    few steps ahead (a GPU trains faster than one core renders clips). At most 2 x workers batches
    wait, so memory stays bounded however far the trainer falls behind."""
    if workers <= 0:
        for step in steps:
            yield stage2_batch(batches, plan, step)
        return
    import collections

    import torch.multiprocessing as mp

    global _AHEAD
    _AHEAD = (batches, plan)
    # the workers share the cores: one torch thread each
    with mp.get_context("fork").Pool(workers, torch.set_num_threads, (1,)) as pool:
        todo = iter(steps)
        waiting = collections.deque(
            pool.apply_async(_ahead_batch, (s,)) for s, _ in zip(todo, range(2 * workers))
        )
        while waiting:
            yield waiting.popleft().get()
            following = next(todo, None)
            if following is not None:
                waiting.append(pool.apply_async(_ahead_batch, (following,)))
