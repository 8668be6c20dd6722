"""What the terminal says when a number would mislead (issue 50): an eval mixing protocols prints
one table per protocol with a standard error, and an encode whose budget keeps the whole media
says so."""

from __future__ import annotations

import math

from mmkv_cli.cli import display, study_display


def run(method: str, protocol: str, accuracy: float, n: int = 48) -> dict:
    return {
        "method": method,
        "budget": 1.0,
        "budget_tokens": 64,
        "protocol": protocol,
        "kept": 0.5,
        "n": n,
        "accuracy": accuracy,
        "by_type": {"color": {"accuracy": accuracy, "n": n, "chance": 0.25}},
    }


def test_an_eval_of_two_protocols_prints_a_table_for_each_with_standard_errors():
    runs = [run("hermes", "stream", 0.75), run("full", "replay", 0.5), run("rekv", "stream", 1.0)]
    with display.out_console.capture() as captured:
        study_display.show_eval(runs, "plot.png")
    text = captured.get()
    assert "protocols (stream: hermes, rekv; replay: full)" in text and "not comparable" in text
    assert "eval: accuracy (stream)" in text and "eval: accuracy (replay)" in text
    stream_table = text[text.index("eval: accuracy (stream)") : text.index("(replay)")]
    assert "full" not in stream_table and "hermes" in stream_table
    assert f"{math.sqrt(0.75 * 0.25 / 48):.2f}" in stream_table  # 0.06
    assert (
        study_display.standard_error(1.0, 48) == 0.0 and study_display.standard_error(0.5, 0) == 0.0
    )


def test_one_protocol_is_one_table_without_a_note():
    with display.out_console.capture() as captured:
        study_display.show_eval([run("hermes", "replay", 0.75)], "plot.png")
    text = captured.get()
    assert "not comparable" not in text and "(replay)" not in text
    assert "eval: accuracy " in text and " se" in text


def test_an_encode_whose_budget_keeps_everything_says_so():
    info = {
        "path": "a.kvpack",
        "method": "hermes",
        "budget_tokens": 4096,
        "budget": None,
        "visual_tokens_kept": 64,
        "visual_tokens_total": 64,
        "blocks": 3,
        "bytes": 1000,
        "encode_s": 0.5,
    }
    assert "its budget of 4,096 tokens a layer keeps all 64 of this media" in display.encoded_line(
        info
    )
    assert "keeps all" not in display.encoded_line({**info, "visual_tokens_kept": 40})
    assert "keeps all" not in display.budget_note({**info, "budget_tokens": None})
