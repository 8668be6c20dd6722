"""`mmkv live --questions FILE` (issue 75): a question file's question without a moment is asked of
the whole stream, as eval asks it (not of the first frame); a question with one, at it. And each
answer's `behind_s` says how far the source is ahead of the memory it was answered from."""

from __future__ import annotations

import json

from tests.conftest import ROOT
from tests.helpers import run_mmkv

CLIP = str(ROOT / "samples" / "clip.mp4")  # 8 s; the demo samples 2 frames a second


def live_records(tmp_path, lines: list[dict]) -> tuple[list[dict], str]:
    questions = tmp_path / "qa.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_mmkv("live", CLIP, "-o", str(tmp_path / "l.kvpack"), "--model", "demo",
                    "--budget-tokens", "24", "--stall", "0.5", "--questions", str(questions),
                    "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def test_a_files_question_without_a_moment_is_asked_at_the_streams_end(tmp_path):
    synth_line = {"question": "which shape appeared last ?", "answer": "triangle", "id": "q0"}
    records, told = live_records(tmp_path, [synth_line, {**synth_line, "id": "q1", "at": 2}])
    by_id = {r["id"]: r for r in records}
    assert by_id["q1"]["moment"] == 2.0 and by_id["q1"]["answer"] == "circle"
    assert by_id["q0"]["moment"] == 7.5 and by_id["q0"]["answer"] == "triangle"
    assert "note" not in by_id["q0"]  # its moment is the end: nothing to excuse
    assert "note: " in told and "a question without 'at' is answered at the end" in told


def test_behind_is_how_far_the_source_is_ahead_of_the_memory(tmp_path):
    """The whole 8-second file is there from the start: a memory at 2 s is about 6 s behind it,
    not the fraction of a second since its last frame was decoded."""
    records, _ = live_records(tmp_path, [{"question": "which shape ?", "id": "a", "at": 2}])
    assert 5.0 <= records[0]["behind_s"] <= 6.5, records[0]
