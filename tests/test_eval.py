"""mmkv eval: both input formats, deterministic scoring, one run folder per method and budget,
resume."""

import json

import pytest
from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import UsageError
from mmkv_cli.study import evaluate as ev


def test_jsonl_and_mlvu_formats_load_to_the_same_items(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"video": "v.mp4", "question": "what color?", "answer": "The Red."})
        + "\n"
        + json.dumps(
            {
                "video": "v.mp4",
                "question": "pick",
                "options": ["red", "blue"],
                "answer": "blue",
                "timestamp": 3,
            }
        )
        + "\n"
    )
    (tmp_path / "b.json").write_text(
        json.dumps(
            [
                {
                    "video_id": "x",
                    "video_path": "v.mp4",
                    "conversations": [
                        {"question": "what color?", "answer": "red"},
                        {
                            "question": "pick",
                            "choices": ["red", "blue"],
                            "answer": "B",
                            "timestamp": 3,
                        },
                    ],
                }
            ]
        )
    )
    a, b = ev.load_items(tmp_path / "a.jsonl"), ev.load_items(tmp_path / "b.json")
    assert a == b
    assert a[0].answer == "red" and a[1].answer == "B" and a[1].at == 3.0
    assert a[0].video == str(tmp_path / "v.mp4")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"video": "v.mp4"}) + "\n")
    with pytest.raises(UsageError):
        ev.load_items(tmp_path / "bad.jsonl")


def test_scoring_is_exact_match_or_option_letter():
    open_item = ev.Item("v", "q", "red")
    assert ev.predicted(open_item, " Red.") == "red"
    assert ev.predicted(open_item, "dark red") != "red"
    choice = ev.Item("v", "q", "B", options=("red", "blue", "green"))
    assert ev.predicted(choice, "B. blue") == "B"
    assert ev.predicted(choice, "(b)") == "B"
    assert ev.predicted(choice, "blue") == "B"  # the option's text counts as its letter
    assert ev.predicted(choice, "D") != "B"
    assert "A . red" in ev.prompt_for(choice)
    rows = [
        {"type": "color", "options": 0, "correct": True},
        {"type": "color", "options": 0, "correct": False},
        {"type": "mc", "options": 4, "correct": True},
    ]
    m = ev.metrics(rows, ev.chance_level)
    assert m["n"] == 3 and m["accuracy"] == pytest.approx(2 / 3)
    assert m["by_type"]["color"]["accuracy"] == 0.5 and m["by_type"]["color"][
        "chance"
    ] == pytest.approx(1 / 6)
    assert m["by_type"]["mc"]["chance"] == 0.25


def test_eval_runs_each_method_once_per_budget_and_resumes(tmp_path):
    runner = CliRunner()
    assert (
        runner.invoke(
            app,
            ["synth", str(tmp_path / "set"), "--clips", "2", "--frames", "8", "--kind", "normal"],
        ).exit_code
        == 0
    )
    args = [
        "eval",
        str(tmp_path / "set" / "qa.jsonl"),
        "-m",
        "tiny-llava-ov",
        "--methods",
        "full,recency",
        "--budgets",
        "0.5,0.25",
        "-o",
        str(tmp_path / "out"),
        "--max-new-tokens",
        "2",
        "--protocol",
        "replay",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    assert [(r["method"], r["budget"]) for r in runs] == [
        ("full", 1.0),
        ("recency", 0.5),
        ("recency", 0.25),
    ]
    assert all(r["n"] == 12 for r in runs)
    # the measured share of visual KV the packs held: all of it for full, about the budget for
    # recency
    assert (
        runs[0]["kept"] == 1.0
        and abs(runs[1]["kept"] - 0.5) < 0.1
        and abs(runs[2]["kept"] - 0.25) < 0.1
    )
    root = tmp_path / "out" / "tiny-llava-ov"
    assert (root / "accuracy_vs_budget.png").stat().st_size > 0
    folder = root / "recency-b0.25"
    assert json.loads((folder / "config.json").read_text())["budget"] == 0.25
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 12
    # Interrupted mid-clip: the last two answers lost, one line cut short. A rerun asks only those
    # again.
    (folder / "predictions.jsonl").write_text("\n".join(lines[:10]) + "\n" + lines[10][:15])
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    rows = [
        json.loads(x)
        for x in (folder / "predictions.jsonl").read_text().splitlines()
        if x.endswith("}")
    ]
    assert len({r["key"] for r in rows}) == 12
    assert json.loads((folder / "metrics.json").read_text())["n"] == 12
    assert rows[:10] == [json.loads(x) for x in lines[:10]]  # earlier answers kept, not recomputed
    # other settings never reuse these answers: refused, until --fresh starts the run over
    longer = runner.invoke(app, [*args, "--max-new-tokens", "3"])
    assert longer.exit_code == 2 and "max_new_tokens" in longer.output, longer.output
    assert (folder / "predictions.jsonl").read_text().count("\n") == 12  # untouched
    fresh = runner.invoke(app, [*args, "--max-new-tokens", "3", "--fresh"])
    assert fresh.exit_code == 0, fresh.output
    assert json.loads((folder / "config.json").read_text())["max_new_tokens"] == 3
    # a corrected gold answer rescored without asking again
    qa = tmp_path / "set" / "qa.jsonl"
    items = [json.loads(line) for line in qa.read_text().splitlines()]
    items[0]["answer"] = "surely not this"
    qa.write_text("".join(json.dumps(i) + "\n" for i in items))
    again = runner.invoke(app, [*args, "--max-new-tokens", "3"])
    assert again.exit_code == 0, again.output
    rows = [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 12  # nothing asked again
    first = next(
        r
        for r in rows
        if r["video"].endswith(items[0]["video"]) and r["question"] == items[0]["question"]
    )
    before = json.loads(fresh.stdout)["runs"][2]["accuracy"]
    after = json.loads((folder / "metrics.json").read_text())["accuracy"]
    assert after == pytest.approx(before - (1 / 12 if first["correct"] else 0))
    # a quantized run has a folder of its own: its answers never mix with the 16-bit ones
    quantized = runner.invoke(app, [*args[:5], "full", *args[6:], "--kv-bits", "4"])
    assert quantized.exit_code == 0, quantized.output
    assert json.loads(quantized.stdout)["runs"][0]["n"] == 12
    assert json.loads((root / "full-b1-kv4" / "config.json").read_text())["kv_bits"] == 4


def test_the_stream_protocol_answers_each_question_from_the_memory_at_its_moment(tmp_path):
    runner = CliRunner()
    made = runner.invoke(
        app, ["synth", str(tmp_path / "set"), "--clips", "1", "--frames", "8", "--kind", "normal"]
    )
    assert made.exit_code == 0, made.output
    qa = tmp_path / "set" / "qa.jsonl"
    assert any(json.loads(line).get("at") is not None for line in qa.read_text().splitlines())
    common = ["eval", str(qa), "-m", "tiny-llava-ov", "-o", str(tmp_path / "out")]
    common += ["--max-new-tokens", "2", "--json"]
    streamed = runner.invoke(
        app, [*common, "--methods", "full,hermes", "--budget-tokens", "8", "--protocol", "stream"]
    )
    assert streamed.exit_code == 0, streamed.output
    runs = json.loads(streamed.stdout)["runs"]
    assert [(r["method"], r["budget_tokens"], r["protocol"]) for r in runs] == [
        ("full", None, "stream"),
        ("hermes", 8, "stream"),
    ]
    assert all(r["n"] == 6 for r in runs)
    root = tmp_path / "out" / "tiny-llava-ov"
    assert json.loads((root / "hermes-t8-stream" / "config.json").read_text())["budget_tokens"] == 8
    # a share of a stream's unknown length: refused before any work, in one line
    refused = runner.invoke(app, [*common, "--methods", "recency", "--protocol", "stream"])
    assert refused.exit_code == 2 and "--budget-tokens" in refused.output
    # auto: stream where the budget can follow a stream, replay where it cannot
    auto = runner.invoke(app, [*common, "--methods", "full,recency", "--budgets", "0.5"])
    assert auto.exit_code == 0, auto.output
    assert [r["protocol"] for r in json.loads(auto.stdout)["runs"]] == ["stream", "replay"]


def test_eval_errors_are_one_line(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["eval", str(tmp_path / "none.jsonl"), "-m", "tiny-llava-ov"])
    assert missing.exit_code == 2 and "no question file" in missing.output
    (tmp_path / "q.jsonl").write_text(
        json.dumps({"video": "v.mp4", "question": "q", "answer": "a"}) + "\n"
    )
    bad = runner.invoke(
        app, ["eval", str(tmp_path / "q.jsonl"), "-m", "tiny-llava-ov", "--methods", "nope"]
    )
    assert bad.exit_code == 2 and "unknown method" in bad.output
    budget = runner.invoke(
        app, ["eval", str(tmp_path / "q.jsonl"), "-m", "tiny-llava-ov", "--budgets", "2"]
    )
    assert budget.exit_code == 2 and "budget" in budget.output


def test_eval_on_a_local_ray_answers_as_in_process_and_resumes_video_by_video(tmp_path):
    """Issue 41: each video (all its questions, every run) is one item on a Ray actor; the
    predictions equal the in-process run's, and a rerun redoes only the videos not finished."""
    pytest.importorskip("ray")
    import subprocess
    import sys

    from tests.conftest import ROOT

    runner = CliRunner()
    made = runner.invoke(app, ["synth", str(tmp_path / "set"), "--clips", "3", "--frames", "8"])
    assert made.exit_code == 0, made.output
    qa = str(tmp_path / "set" / "qa.jsonl")
    common = ["eval", qa, "-m", "demo", "--methods", "full,hermes", "--budget-tokens", "16"]
    common += ["--budgets", "0.5", "--max-new-tokens", "2", "--json"]
    here = runner.invoke(app, [*common, "-o", str(tmp_path / "here")])
    assert here.exit_code == 0, here.output

    def on_ray(out):
        return subprocess.run(
            [sys.executable, "-m", "mmkv_cli", *common, "-o", str(out)]
            + ["--ray", "local", "--workers", "2"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
        )

    done = on_ray(tmp_path / "ray")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["videos"] == 3 and report["failed"] == []
    assert sum(w["videos"] for w in report["workers"].values()) == 3

    def answers(root):
        found = {}
        for path in sorted(root.glob("demo/*/predictions.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            found[path.parent.name] = {r["key"]: (r["raw"], r["correct"], r["kept"]) for r in rows}
        return found

    assert answers(tmp_path / "ray") == answers(
        tmp_path / "here"
    )  # the same code, the same answers
    assert [r["accuracy"] for r in report["runs"]] == [
        r["accuracy"] for r in json.loads(here.stdout)["runs"]
    ]
    # one video's answers lost from one run: the rerun sends only that video, for that run only
    folder = next((tmp_path / "ray" / "demo").glob("hermes-t16*"))
    rows = (folder / "predictions.jsonl").read_text().splitlines()
    lost = json.loads(rows[-1])["video"]
    kept = [r for r in rows if json.loads(r)["video"] != lost]
    (folder / "predictions.jsonl").write_text("\n".join(kept) + "\n")
    again = on_ray(tmp_path / "ray")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["videos"] == 1
    assert answers(tmp_path / "ray") == answers(tmp_path / "here")


def test_the_plots_share_axis_is_labelled_in_plain_numbers():
    """Shares within one decade (0.1 to 0.5) read 0.1, 0.2, 0.3, 0.5: no 4x10^-1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmkv_cli.study.evaluate import share_axis

    fig, ax = plt.subplots()
    ax.plot([0.1, 0.25, 0.5], [0.4, 0.6, 0.7])
    share_axis(ax)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    shown = [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    major = [t.get_text() for t in shown]
    minor = [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert major == ["0.1", "0.2", "0.3", "0.5"] and minor == []
