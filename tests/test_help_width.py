"""Every command's help reads whole at 80 columns: no line longer, no word of a help text, option,
default or command summary broken across lines or cut into an ellipsis (issue 52)."""

import re

import pytest
import typer
from typer.testing import CliRunner

from mmkv_cli.cli.app import app

COMMAND = typer.main.get_command(app)
STRIP = ".,;:'()[]<>`"


def words(text: str) -> set[str]:
    return {w.strip(STRIP) for w in re.sub(r"[│╭╮╰╯─]", " ", text).split()} - {""}


def expected(command) -> set[str]:
    """What the help must show whole: its summary, and per parameter its names, help and default."""
    found = words(command.help or "")
    for param in command.params:
        found |= words(" ".join([*param.opts, *param.secondary_opts]))
        found |= words(getattr(param, "help", None) or "")
        default = getattr(param.default, "value", param.default)  # an enum's: its value
        if isinstance(default, (str, int, float)) and not isinstance(default, bool):
            found |= words(str(default))
    return found


@pytest.mark.parametrize("name", ["", *COMMAND.commands])
def test_help_at_80_columns_breaks_no_word(name):
    args = [name, "--help"] if name else ["--help"]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "80"}, terminal_width=80)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    command = COMMAND.commands[name] if name else COMMAND
    want = expected(command)
    if not name:  # the listing: every command's name and whole summary
        for sub in COMMAND.commands.values():
            want |= words(sub.name) | words(sub.get_short_help_str())
    missing = want - words(shown.output)
    assert not missing, f"mmkv {name} --help at 80 columns breaks or cuts: {sorted(missing)}"
    assert "…" not in shown.output  # nothing ends cut


def test_encode_and_profile_print_whole_lines_at_80_columns(tmp_path, monkeypatch):
    from tests.conftest import SAMPLES

    clip = str(SAMPLES / "clip.mp4")
    env, runner = {"COLUMNS": "80"}, CliRunner()
    monkeypatch.chdir(tmp_path)
    args = ["encode", clip, "--model", "demo", "--method", "pyramidkv", "-o", "p.kvpack"]
    wrote = runner.invoke(app, args, env=env, terminal_width=80)
    assert wrote.exit_code == 0 and len(wrote.stdout.splitlines()) == 2
    assert wrote.stdout.splitlines()[1].startswith("pyramidkv (budget 0.25): 15.75 of 64 visual")
    args = ["profile", clip, "--model", "demo", "--methods", "full,pyramidkv,mukv"]
    shown = runner.invoke(app, args, env=env, terminal_width=80)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in shown.stdout
    rows = [line.split() for line in lines if line.lstrip().startswith(("full", "pyramidkv"))]
    # every figure whole, one a cell (the demo's one-word answers time no decode per token)
    assert [len(row) for row in rows] == [7, 8, 7, 8]
    assert all(re.fullmatch(r"[\d.]+(B|KiB|MiB|GiB)", row[-5]) for row in rows[:2])


def test_profile_tables_fit_80_columns_with_the_widest_figures(capsys):
    from mmkv_cli.cli import display, study_display

    keys = ("encode_s", "bytes", "visual_tokens_kept", "peak_mem_bytes", "peak_kv_bytes")
    keys += ("ttft_s", "decode_s_per_token")

    def run(label: str, values: tuple) -> dict:
        budget = None if label == "full" else 0.25
        record = {"method": label, "budget": budget, "budget_tokens": None, "repeat": 1}
        return {**record, **dict(zip(keys, values)), "ratio": dict.fromkeys(keys, 12.34)}

    wide = (1234.56, 1023.9 * 2**20, 15.75, 1023.9 * 2**20, 1023.9 * 2**30, 12.3456, 1.2345)
    result = {"model": "rehearsal-llava-ov-7b", "device": "cuda:0", "reference": "full"}
    result["methods"] = [run("full", wide), run("pyramidkv", wide), run("streamingtom", wide)]
    width = display.out_console.width
    display.out_console.width = 80
    try:
        study_display.show_profile(result)
    finally:
        display.out_console.width = width
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80 and not any("…" in line for line in lines)
    rows = [line.split() for line in lines if line.startswith(("full", "pyramidkv"))]
    assert [len(row) for row in rows] == [8, 9, 8, 9], lines  # every figure whole, one a cell
    assert rows[0][1:] == ["1234.56s", "1023.9MiB", "15.75", "1023.9MiB", "1023.9GiB", "12.35s"] + [
        "1.23s"
    ]
