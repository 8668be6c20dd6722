"""The synthetic world: deterministic, answerable, and what the videos show is what the questions
assume."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from mmkv_cli.media import load_media
from mmkv_cli.study.synth import make_clip
from mmkv_cli.study.synth.world import COLOURS, NEEDLE, SHAPES, render


@pytest.mark.parametrize("index", range(12))
def test_questions_follow_from_the_clip(index):
    clip, qa = make_clip(3, index, 48, "mixed")
    by_type = {q["type"]: q for q in qa}
    if clip.kind == "needle":
        stars = [e for e in clip.events if e.shape == NEEDLE]
        assert len(stars) == 1 and 1 <= stars[0].stop - stars[0].start <= 2
        assert by_type["needle"]["answer"] == stars[0].colour
        assert any(e.shape == "cross" for e in clip.events)  # the look-alike distractor is there
        return
    shapes = [e.shape for e in clip.events]
    colours = [e.colour for e in clip.events]
    # every question has one answer
    assert len(set(shapes)) == len(shapes) and len(set(colours)) == len(colours)
    colour_q = by_type["color"]
    assert COLOURS and colour_q["answer"] == colours[shapes.index(colour_q["question"].split()[-2])]
    assert (
        by_type["shape"]["answer"]
        == shapes[colours.index(by_type["shape"]["question"].split()[-2])]
    )
    assert by_type["first"]["answer"] == shapes[0] and by_type["last"]["answer"] == shapes[-1]
    moment = by_type["moment"]
    assert clip.shown_at(moment["frame"]).shape == moment["answer"]
    seen = [e for e in clip.events if e.start <= moment["frame"]]  # shown by the moment
    assert seen[-1].shape == moment["answer"]
    # one shape at a time
    assert all(a.stop <= b.start for a, b in zip(clip.events, clip.events[1:]))


def test_shapes_render_differently():
    from mmkv_cli.study.synth.world import Clip, Event

    frames = [
        render(Clip("normal", 1, (Event(s, "red", 0, 1, 0.5, 0.5, 0, 0),)), 0) for s in SHAPES
    ]
    masks = [(f != f[0, 0]).any(-1) for f in frames]
    for i in range(len(SHAPES)):
        for j in range(i + 1, len(SHAPES)):
            assert (masks[i] != masks[j]).sum() > 100, (SHAPES[i], SHAPES[j])


def test_synth_writes_the_same_set_twice_and_videos_show_the_render(tmp_path):
    runner = CliRunner()
    for name in ("a", "b"):
        result = runner.invoke(
            app,
            [
                "synth",
                str(tmp_path / name),
                "--clips",
                "2",
                "--frames",
                "16",
                "--seed",
                "9",
                "--json",
            ],
        )
        assert result.exit_code == 0, result.output
    qa = (tmp_path / "a" / "qa.jsonl").read_text()
    assert qa == (tmp_path / "b" / "qa.jsonl").read_text()
    rows = [json.loads(line) for line in qa.splitlines()]
    assert {r["type"] for r in rows} == {
        "color",
        "shape",
        "first",
        "last",
        "count",
        "moment",
        "needle",
    }
    moment = next(r for r in rows if r["type"] == "moment")
    assert moment["at"] == pytest.approx(int(moment["at"] * 2) / 2)
    video = load_media(str(tmp_path / "a" / rows[0]["video"]), fps=2.0, max_frames=64)
    assert video.num_frames == 16
    clip, _ = make_clip(9, 0, 16, "mixed")
    decoded = video.read(0, 16).astype(int)
    rendered = np.stack([render(clip, f) for f in range(16)]).astype(int)
    # near-lossless: the model sees what it was trained on
    assert np.abs(decoded - rendered).mean() < 2.0


def test_synth_never_overwrites_without_force(tmp_path):
    runner = CliRunner()
    args = ["synth", str(tmp_path), "--clips", "1", "--frames", "8", "--kind", "normal"]
    assert runner.invoke(app, args).exit_code == 0
    before = (tmp_path / "qa.jsonl").read_text()
    refused = runner.invoke(app, [*args, "--seed", "4"])
    assert refused.exit_code == 2 and "--force" in refused.output
    assert (tmp_path / "qa.jsonl").read_text() == before
    assert (
        runner.invoke(
            app, ["synth", str(tmp_path / "n"), "--frames", "8", "--kind", "needle"]
        ).exit_code
        == 2
    )
