"""The demo-grid world: small shapes, each inside one quadrant, on a textured background, and
'where' questions answered by that quadrant."""

import json

import numpy as np

from mmkv_cli.study.synth import make_clip, render_frames, write_dataset
from mmkv_cli.study.synth.grid import QUADRANTS, covered_tokens, grid_chance, shape_centre


def test_clips_are_pure_functions_of_the_seed():
    a, qa = make_clip(5, 3, 32, "normal", "grid")
    b, qb = make_clip(5, 3, 32, "normal", "grid")
    assert a == b and qa == qb
    assert np.array_equal(render_frames(a, "grid", 64), render_frames(b, "grid", 64))


def test_a_shape_stays_in_its_quadrant_and_covers_one_or_two_tokens_a_side():
    for index in range(20):
        clip, qa = make_clip(11, index, 48, "mixed", "grid")
        for event in clip.events:
            quadrants = set()
            for frame in range(event.start, event.stop):
                cx, cy = shape_centre(event, frame)
                quadrants.add(int(cx >= 0.5) + 2 * int(cy >= 0.5))
                tokens = covered_tokens(event, frame)
                assert 1 <= len(tokens) <= 4  # of 16: most of a frame is background
            assert len(quadrants) == 1
        where = [q for q in qa if q["type"] == "where"]
        assert len(where) == 1 and where[0]["answer"] in QUADRANTS


def test_where_answer_is_the_quadrant_the_pixels_show():
    clip, qa = make_clip(2, 0, 24, "normal", "grid")
    q = next(q for q in qa if q["type"] == "where")
    shape = q["question"].split()[-2]
    event = next(e for e in clip.events if e.shape == shape)
    frames = render_frames(clip, "grid", 128).astype(int)
    # the shape's pixels: saturated colour, far from the muted background
    shown = frames[event.start]
    ys, xs = np.nonzero(shown.max(axis=2) - shown.min(axis=2) > 120)
    assert len(ys)
    found = int(xs.mean() >= 64) + 2 * int(ys.mean() >= 64)
    assert QUADRANTS[found] == q["answer"]
    quiet = [f for f in range(clip.frames) if clip.shown_at(f) is None]
    assert quiet  # the spans leave gaps
    empty = frames[quiet[0]]
    assert (empty.max(axis=2) - empty.min(axis=2)).max() < 120  # no shape, texture only
    assert len(np.unique(empty.reshape(-1, 3), axis=0)) > 200  # textured, not flat
    assert grid_chance("where") == 0.25


def test_synth_writes_a_grid_set(tmp_path):
    info = write_dataset(tmp_path / "set", clips=2, frames=16, seed=1, world_name="grid")
    assert info["world"] == "grid"
    rows = [json.loads(line) for line in (tmp_path / "set" / "qa.jsonl").read_text().splitlines()]
    assert {"where", "needle"} <= {r["type"] for r in rows}
