"""profile: every method measured, ratios to full, a PNG plot."""

import json

from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from tests.conftest import SAMPLES


def test_profile_json_and_plot(tmp_path):
    png = tmp_path / "p.png"
    result = CliRunner().invoke(
        app,
        [
            "profile",
            str(SAMPLES / "clip.mp4"),
            "-m",
            "tiny-llava-ov",
            "--methods",
            "full,recency",
            "--budget",
            "0.25",
            "--max-frames",
            "8",
            "--max-new-tokens",
            "4",
            "--plot",
            str(png),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    full, recency = out["methods"]
    assert out["reference"] == "full" and full["ratio"]["bytes"] == 1.0
    assert recency["visual_tokens_kept"] == full["visual_tokens_kept"] // 4
    # one chunk holds all 8 frames, so the running cache peaks as high as full before recency evicts
    assert recency["ratio"]["bytes"] < 0.5 and recency["ratio"]["peak_kv_bytes"] <= 1.0
    for row in out["methods"]:
        assert row["encode_s"] > 0 and row["ttft_s"] > 0 and row["peak_mem_bytes"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_compares_stored_bits_side_by_side():
    result = CliRunner().invoke(
        app,
        [
            "profile",
            str(SAMPLES / "clip.mp4"),
            "-m",
            "demo",
            "--methods",
            "full",
            "--kv-bits",
            "16,8,2,1.5",
            "--max-frames",
            "8",
            "--max-new-tokens",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["methods"]
    assert [r["kv_bits"] for r in rows] == [16, 8, 2, 1.5]
    assert rows[0]["first_token_kl"] == 0 and rows[0]["top1_agrees"]
    sizes = [r["ratio"]["bytes"] for r in rows]
    assert sizes[3] < sizes[2] < sizes[1] < 1.0
    assert rows[2]["first_token_kl"] >= 0 and rows[3]["first_token_kl"] >= 0
    shown = CliRunner().invoke(
        app, ["profile", str(SAMPLES / "clip.mp4"), "-m", "demo", "--kv-bits", "16,x"]
    )
    assert shown.exit_code == 2 and "--kv-bits must be one of" in shown.output


def test_a_profile_of_one_token_answers_leaves_out_the_per_token_column(tmp_path):
    """The demo answers in one word: no decode was timed, so neither the table nor the plot has
    an empty per-token column, and a note says why."""
    png = tmp_path / "p.png"
    question = "what color is the circle ?"
    args = ["profile", str(SAMPLES / "clip.mp4"), "-m", "demo", "--methods", "full,recency",
            "--budget", "0.5", "--question", question, "--plot", str(png)]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    assert "per tok" not in result.stdout and "TTFT" in result.stdout
    assert "every answer was one token, so no decode time per token was measured" in result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
