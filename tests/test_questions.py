"""Many questions per load: parsing lines and JSONL, and `ask` answering them all with one model
load, each as a single ask would."""

import json

import pytest
from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from mmkv_cli.cli.questions import Question, gather, parse_lines
from mmkv_cli.core.errors import UsageError
from tests.conftest import SAMPLES
from tests.helpers import ask_pack, encode_pack

runner = CliRunner()


def test_lines_are_questions_or_json_objects():
    lines = [
        "what color ?",
        "",
        '{"question": " where ? ", "at": 2, "id": "q7"}',
        '{"question": "when ?", "id": 3}',
    ]
    assert parse_lines(lines, "f") == [
        Question("what color ?"),
        Question("where ?", 2.0, "q7"),
        Question("when ?", None, 3),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "a", ', "f:1: not valid JSON"),
        ('{"q": "a"}', "f:1: unknown key 'q'"),
        ('{"question": ""}', "'question' must be non-empty text"),
        ('{"question": "a", "at": -1}', "'at' must be a number of seconds >= 0"),
        ('{"question": "a", "at": "soon"}', "'at' must be a number"),
        ('{"question": "a", "id": true}', "'id' must be text of at most 256"),
        ('{"question": "a", "id": "%s"}' % ("i" * 257), "'id' must be text of at most 256"),
        ('{"question": "a", "id": ' + str(2**63) + "}", "or a 64-bit integer"),
        ('{"question": "a", "id": "%s"}' % ("i" * 200_000), "a line longer than"),
        ("[1, 2]", None),  # not an object: a plain question that happens to look like JSON
        ("x" * 20_001, "longer than 20000 characters"),
    ],
)
def test_bad_lines_are_refused_with_where_they_are(line, message):
    if message is None:
        assert parse_lines([line], "f") == [Question(line)]
        return
    with pytest.raises(UsageError, match=message):
        parse_lines([line], "f")


def test_stdin_is_read_once_and_something_must_be_asked(tmp_path):
    with pytest.raises(UsageError, match="stdin can be read once"):
        gather(["-"], "-")
    with pytest.raises(UsageError, match="no question given"):
        gather([], None)
    with pytest.raises(UsageError, match="no such questions file"):
        gather([], str(tmp_path / "nope.txt"))
    (tmp_path / "q.txt").write_text("a ?\n\nb ?\n")
    assert [q.text for q in gather(["first ?"], str(tmp_path / "q.txt"))] == [
        "first ?",
        "a ?",
        "b ?",
    ]


@pytest.fixture(scope="module")
def pack(tmp_path_factory, backbones):
    path = tmp_path_factory.mktemp("many") / "p.kvpack"
    encode_pack(
        SAMPLES / "clip.mp4", path, method="full", backbone=backbones["tiny-llava-ov"], max_frames=8
    )
    return path


def test_one_ask_answers_every_question_as_single_asks_would(
    pack, backbones, monkeypatch, tmp_path
):
    import mmkv_cli.backbones.loading as backbones_module

    loads = []
    backbone = backbones["tiny-llava-ov"]
    monkeypatch.setattr(
        backbones_module, "load_backbone", lambda load: loads.append(load) or backbone
    )
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        '{"question": "what shape ?", "at": 1.0, "id": "b"}\nwhat happened first ?\n'
    )
    result = runner.invoke(
        app,
        [
            "ask",
            str(pack),
            "what color is the circle ?",
            "--questions",
            str(questions),
            "--json",
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(loads) == 1  # the model loaded once for all three
    assert [r["question"] for r in rows] == [
        "what color is the circle ?",
        "what shape ?",
        "what happened first ?",
    ]
    assert rows[1]["id"] == "b" and rows[1]["at"] == 1.0 and "id" not in rows[0]
    for row in rows:
        alone = ask_pack(pack, row["question"], backbone=backbone, at=row["at"], max_new_tokens=4)
        assert row["answer"] == alone.answer and row["context_tokens"] == alone.context_tokens
    assert rows[1]["context_tokens"] < rows[0]["context_tokens"]  # asked at 1 s: fewer blocks


def test_multi_line_stdin_is_one_question_per_line_and_a_failure_does_not_stop_the_rest(
    pack, backbones, monkeypatch
):
    import mmkv_cli.backbones.loading as backbones_module

    monkeypatch.setattr(backbones_module, "load_backbone", lambda load: backbones["tiny-llava-ov"])
    result = runner.invoke(
        app,
        ["ask", str(pack), "-", "--max-new-tokens", "2", "--json"],
        input="what color ?\nwhat shape ?\n",
    )
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["question"] for line in result.stdout.splitlines()] == [
        "what color ?",
        "what shape ?",
    ]
    # an empty prompt after tokenisation fails alone: the others answer, the exit says so
    monkeypatch.setattr(
        backbones["tiny-llava-ov"].__class__,
        "question_ids",
        lambda self, text, template=None: [] if text == "boom" else [5, 6, 7],
    )
    result = runner.invoke(
        app, ["ask", str(pack), "what ?", "boom", "why ?", "--max-new-tokens", "2", "--json"]
    )
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 1 and "1 of 3 questions failed" in result.stderr
    assert [("error" in r) for r in rows] == [False, True, False]
    assert "empty after tokenisation" in rows[1]["error"]


def _demo_packs(tmp_path):
    """Two demo packs of the sample clip, full and recency: answers differ between them."""
    packs = {}
    for method in ("full", "recency"):
        packs[method] = tmp_path / f"{method}.kvpack"
        encode_pack(SAMPLES / "clip.mp4", packs[method], "demo", method, max_frames=8)
    return packs


def test_a_questions_file_naming_packs_is_answered_pack_by_pack_in_file_order(tmp_path):
    """Issue 41: each pack opened once, every answer in the file's order, a missing pack failing
    only its own lines; the same answers as asking each pack alone."""
    packs = _demo_packs(tmp_path)
    lines = [
        {"question": "what color is the circle ?", "pack": str(packs["full"]), "id": 1},
        {"question": "which shape appeared first ?", "pack": str(packs["recency"])},
        {"question": "which shape appeared last ?", "pack": str(tmp_path / "gone.kvpack")},
        {"question": "which shape appeared first ?", "pack": str(packs["full"]), "at": 1.0},
    ]
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["ask", "--questions", str(questions), "--max-new-tokens", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "1 of 4 questions failed" in result.stderr, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["question"] for r in rows] == [line["question"] for line in lines]
    assert rows[0]["id"] == 1 and "no such pack" in rows[2]["error"]
    for line, row in zip(lines, rows):
        if "error" in row:
            continue
        alone = ask_pack(line["pack"], line["question"], at=line.get("at"), max_new_tokens=4)
        assert row["answer"] == alone.answer and row["pack"] == line["pack"]
    unnamed = tmp_path / "plain.jsonl"
    unnamed.write_text('{"question": "what color ?"}\n{"question": "x ?", "pack": "p.kvpack"}\n')
    refused = runner.invoke(app, ["ask", "--questions", str(unnamed)])
    assert refused.exit_code == 2 and "question 1 names no pack" in refused.stderr


def test_questions_naming_packs_on_a_local_ray_answer_as_here(tmp_path):
    pytest.importorskip("ray")
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    packs = _demo_packs(tmp_path)
    asked = ["what color is the circle ?", "which shape appeared first ?"]
    lines = [{"question": q, "pack": str(p)} for p in packs.values() for q in asked]
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["ask", "--questions", str(questions), "--max-new-tokens", "4"]
    here = runner.invoke(app, args)
    assert here.exit_code == 0, here.stderr
    done = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args, "--ray", "local", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]

    def answers(out):
        return [(r["pack"], r["question"], r["answer"]) for r in map(json.loads, out.splitlines())]

    assert answers(done.stdout) == answers(here.stdout)
    assert "packs in" in done.stderr  # the per-worker summary


def test_ask_reads_synths_question_files_and_says_what_it_left_out(tmp_path):
    """Issue 75, row 9: a file of synth's or eval's lines (with their answers and types) is asked;
    the keys ask does not read are named once, with the file as it was given."""
    import json

    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app
    from tests.conftest import SAMPLES
    from tests.helpers import encode_pack

    pack = tmp_path / "p.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", "full")
    folder = tmp_path / "syn"
    folder.mkdir()
    lines = [
        {"question": "what color is the circle ?", "answer": "red", "type": "color"},
        {"question": "which shape appeared first ?", "answer": "circle", "type": "first", "at": 2},
    ]
    (folder / "qa.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = CliRunner().invoke(
        app, ["ask", str(pack), "--questions", str(folder / "qa.jsonl"), "--json", "--no-server"]
    )
    assert done.exit_code == 0, done.output
    assert [json.loads(line)["question"] for line in done.stdout.splitlines()] == [
        line["question"] for line in lines
    ]
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning")]
    assert warned == [
        f"warning: {folder / 'qa.jsonl'}: ignored the key(s) answer, type (ask reads question, at, "
        "id and pack)"
    ]
