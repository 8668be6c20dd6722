"""The public benchmarks' annotation formats, read from small fixtures written here in each
schema (tests/data/benchmarks), and scoring by answer format."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import UsageError
from mmkv_cli.study.eval_sets.items import correct, make_item, predicted
from mmkv_cli.study.eval_sets.readers import detect, load_items
from tests.conftest import ROOT, SAMPLES

DATA = ROOT / "tests" / "data" / "benchmarks"


def test_videomme_rows_by_duration_with_letters_stripped(tmp_path):
    items = load_items(DATA / "videomme.json", media=SAMPLES)
    assert detect(DATA / "videomme.json") == "videomme"
    assert [i.type for i in items] == ["short", "short", "long"]
    assert items[0].options == ("Red.", "Green.", "Blue.", "Yellow.")
    assert [i.answer for i in items] == ["C", "B", "D"]
    assert items[0].video == str(SAMPLES / "clip.mp4")  # videoID + the suffix that exists
    assert items[2].video == str(SAMPLES / "other.mp4")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = json.loads((DATA / "videomme.json").read_text())
    table = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pyarrow.Table.from_pylist(rows), table)
    assert load_items(table, media=SAMPLES) == items


def test_egoschema_keeps_only_the_publicly_answered_questions():
    questions = DATA / "egoschema" / "questions.json"
    items = load_items(questions)
    assert detect(questions) == "egoschema"
    assert len(items) == 2 and [i.answer for i in items] == ["B", "E"]
    assert len(items[0].options) == 5 and items[0].video.endswith("000000000001.mp4")


def test_egoschema_without_its_answers_file_is_refused(tmp_path):
    shutil.copy(DATA / "egoschema" / "questions.json", tmp_path / "questions.json")
    with pytest.raises(UsageError, match="subset_answers.json"):
        load_items(tmp_path / "questions.json")


def test_ovobench_realtime_is_the_questions_moment():
    items = load_items(DATA / "ovobench.json", media=SAMPLES)
    assert [i.at for i in items] == [3.5, 7.0, 7.5]
    assert [i.answer for i in items] == ["B", "C", "D"]  # a letter, an index, the option's text
    assert [i.type for i in items] == ["EPM", "STU", "OJR"]


def test_mmlongbench_doc_formats_and_scoring():
    items = load_items(DATA / "mmlongbench_samples.json", media=SAMPLES)
    assert detect(DATA / "mmlongbench_samples.json") == "mmlongbench-doc"
    by_format = {i.format: i for i in items}
    assert set(by_format) == {"int", "float", "text", "list", "none"}
    assert all(i.video == str(SAMPLES / "doc.pdf") for i in items)

    def scores(fmt, text):
        item = by_format[fmt]
        return correct(item, predicted(item, text))

    assert scores("int", "The report has 3 pages.") and not scores("int", "4")
    assert scores("float", "12.5") and scores("float", "0.125") and scores("float", "12.55%")
    assert not scores("float", "13")
    assert scores("text", "overview.") and not scores("text", "an overview of it")
    assert scores("list", "blue, red") and not scores("list", "red")
    assert scores("none", "This is not answerable.") and not scores("none", "Alice")


def test_task_overrides_detection_and_bad_records_name_the_format(tmp_path):
    with pytest.raises(UsageError, match="unknown --task"):
        load_items(DATA / "ovobench.json", task="nope")
    with pytest.raises(UsageError, match="not in videomme format"):
        load_items(DATA / "ovobench.json", task="videomme")
    (tmp_path / "odd.json").write_text('[{"something": 1}]')
    with pytest.raises(UsageError, match="--task"):
        load_items(tmp_path / "odd.json")
    with pytest.raises(UsageError, match="is not a number"):
        make_item("v", "q", "many", fmt="int")


def test_eval_scores_an_ovobench_file_at_each_questions_moment(tmp_path):
    """End to end: OVO-Bench questions over the sample clip, answered from packs at `realtime`."""
    result = CliRunner().invoke(
        app,
        [
            "eval", str(DATA / "ovobench.json"), "--media", str(SAMPLES), "-m", "demo",
            "--methods", "full", "--device", "cpu", "--out", str(tmp_path / "runs"), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout.strip().splitlines()[-1])["runs"][0]
    assert run["n"] == 3 and set(run["by_type"]) == {"EPM", "STU", "OJR"}
    assert all(t["chance"] == 0.25 for t in run["by_type"].values())
    rows = [
        json.loads(line) for line in next((tmp_path / "runs").rglob("predictions.jsonl")).open()
    ]
    assert {r["question"] for r in rows} == {i.question for i in load_items(DATA / "ovobench.json")}


def test_streamingbench_questions_at_their_time_stamp_in_their_part():
    """StreamingBench's questions_real.json / questions_omni.json shape: options lettered "A. ...",
    the answer a letter, time_stamp HH:MM:SS; each task counts in its part of the paper."""
    path = DATA / "streamingbench_real.json"
    assert detect(path) == "streamingbench"
    items = load_items(path, media=SAMPLES)
    assert [i.at for i in items] == [7.0, 3.0, 8.0]
    assert [i.answer for i in items] == ["A", "B", "D"] and items[0].options[0] == "red"
    assert [i.type for i in items] == [
        "Object Recognition",
        "Clips Summarize",
        "Scene Understanding",
    ]
    assert [i.split for i in items] == ["real-time", "real-time", "omni-source"]
    assert all(i.video == str(SAMPLES / "clip.mp4") for i in items)


def test_a_streamingbench_proactive_record_is_refused_in_one_line(tmp_path):
    record = [{"time": "x", "video_path": "clip.mp4", "questions": [
        {"task_type": "Proactive Output", "question": "Tell me when the star shows.",
         "time_stamp": "00:00:01", "ground_truth_time_stamp": "00:00:05",
         "ground_truth_output": "now"}]}]  # fmt: skip
    (tmp_path / "proactive.json").write_text(json.dumps(record))
    with pytest.raises(UsageError, match="asks when to answer, not what"):
        load_items(tmp_path / "proactive.json", media=SAMPLES)


def test_rvs_questions_are_open_ended_at_their_end_time():
    path = DATA / "rvs_ego.json"
    assert detect(path) == "rvs"
    items = load_items(path, media=SAMPLES)
    assert [(i.at, i.answer, i.format, i.options) for i in items] == [
        (7.0, "red", "text", ()),
        (8.0, "triangle", "text", ()),
    ]


def test_ovobench_tasks_count_in_its_three_parts():
    items = load_items(DATA / "ovobench.json", media=SAMPLES)
    assert [i.split for i in items] == ["backward", "real-time", "real-time"]


def test_eval_reports_streamingbench_by_its_parts(tmp_path):
    """End to end on the demo: StreamingBench's questions answered at their moments, accuracy by
    task and by the benchmark's part, in the table and in --json."""
    runs = str(tmp_path / "runs")
    args = ["eval", str(DATA / "streamingbench_real.json"), "--media", str(SAMPLES), "-m",
            "demo", "--methods", "full", "--device", "cpu", "--out", runs]  # fmt: skip
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "100"})
    assert shown.exit_code == 0, shown.output
    assert "accuracy by the benchmark's part" in shown.stdout and "omni-source" in shown.stdout
    result = CliRunner().invoke(app, [*args, "--json"])
    run = json.loads(result.stdout.strip().splitlines()[-1])["runs"][0]
    assert run["n"] == 3 and set(run["by_split"]) == {"real-time", "omni-source"}
    assert run["by_split"]["real-time"]["n"] == 2
