"""The CLI as users and shell pipelines see it: new-process ask, --json, and one-line errors."""

import json
import os
import subprocess
import sys

import av
import pytest
from typer.testing import CliRunner

from mmkv_cli.cli.app import app
from mmkv_cli.pack.schema.format import FORMAT_VERSION
from tests.conftest import ROOT, SAMPLES
from tests.helpers import run_mmkv

runner = CliRunner()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def mmkv(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture(scope="module")
def qwen_pack(tmp_path_factory):
    path = tmp_path_factory.mktemp("packs") / "clip.kvpack"
    result = runner.invoke(
        app,
        [
            "encode",
            str(SAMPLES / "clip.mp4"),
            "--model",
            "tiny-qwen2-vl",
            "--method",
            "full",
            "-o",
            str(path),
            "--max-frames",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return path


def test_encode_json_is_one_object(qwen_pack, tmp_path):
    result = runner.invoke(
        app,
        [
            "encode",
            str(SAMPLES / "images"),
            "-m",
            "tiny-llava-ov",
            "--method",
            "recency",
            "--budget",
            "0.5",
            "-o",
            str(tmp_path / "i.kvpack"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["method"] == "recency" and info["budget"] == 0.5
    assert info["visual_tokens_kept"] == info["visual_tokens_total"] // 2


def test_ask_in_a_new_process_and_from_stdin(qwen_pack):
    plain = mmkv("ask", str(qwen_pack), "what color is the circle ?", "--max-new-tokens", "3")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip()
    piped = mmkv("ask", str(qwen_pack), "-", "--json", stdin="what happened first ?\n")
    assert piped.returncode == 0, piped.stderr
    out = json.loads(piped.stdout)  # the whole stdout is one JSON object
    assert set(out) >= {"answer", "context_tokens", "ttft_s", "total_s"}
    assert out["question"] == "what happened first ?" and out["ttft_s"] <= out["total_s"]
    # the time to the first token, phase by phase: they add up to it
    phases = out["ttft_phases_s"]
    assert set(phases) == {"select", "read", "prefill", "first_token"}
    assert all(v >= 0 for v in phases.values())
    assert abs(sum(phases.values()) - out["ttft_s"]) < 1e-3


def test_inspect_json_fields(qwen_pack):
    result = runner.invoke(app, ["inspect", str(qwen_pack), "--json"])
    info = json.loads(result.stdout)
    assert (
        info["format_version"] == FORMAT_VERSION
        and info["model"] == "tiny-qwen2-vl"
        and info["method"] == "full"
    )
    assert (
        info["blocks"] == 4 and info["visual_tokens_total"] == info["visual_tokens_kept"] == 4 * 16
    )
    assert len(info["layers"]) == 4 and all(layer["tokens_kept"] == 64 for layer in info["layers"])
    assert info["bytes"] == os.path.getsize(qwen_pack)
    assert runner.invoke(app, ["inspect", str(qwen_pack)]).exit_code == 0


def test_methods_and_models_list(qwen_pack):
    methods = json.loads(runner.invoke(app, ["methods", "--json"]).stdout)
    assert {m["name"] for m in methods["methods"]} >= {"full", "recency"}
    models = json.loads(runner.invoke(app, ["models", "--json"]).stdout)
    assert {"tiny-llava-ov", "tiny-qwen2-vl", "llava-ov-0.5b", "qwen2.5-vl-7b"} <= {
        m["name"] for m in models["models"]
    }


def test_methods_opens_with_where_to_start_and_folds_presets_at_80_columns():
    shown = run_mmkv("methods", env={"COLUMNS": "80"}).stdout.splitlines()
    assert shown[0] == "start here"
    picks = [line.split()[0] for line in shown[1 : shown.index("")]]
    assert picks == ["full", "hermes", "mukv", "rekv"]  # methods in code that say when
    assert all(len(line) <= 80 for line in shown)
    names = [line.split()[1] for line in shown if line.startswith("│ ") and line[2] != " "]
    assert "h2o" in names and "h2o-adaptive" not in names
    assert "presets: h2o-adaptive," in " ".join(shown)
    every = run_mmkv("methods", "--all", env={"COLUMNS": "80"}).stdout
    assert "│ h2o-adaptive " in every
    assert len(shown) < 0.75 * len(every.splitlines())  # the presets folded: a shorter page


def zero_frame_video(path):
    container = av.open(str(path), "w")
    stream = container.add_stream("mpeg4", rate=8)
    stream.width = stream.height = 64
    container.start_encoding()
    container.close()
    return path


def error_cases(tmp_path, qwen_pack):
    existing = tmp_path / "existing.kvpack"
    existing.write_bytes(b"keep me")
    truncated = tmp_path / "truncated.kvpack"
    truncated.write_bytes(qwen_pack.read_bytes()[:-64])
    corrupted = tmp_path / "corrupted.kvpack"
    data = bytearray(qwen_pack.read_bytes())
    data[-200] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00garbage" * 100)
    clip, out = str(SAMPLES / "clip.mp4"), str(tmp_path / "out.kvpack")
    tiny = ["-m", "tiny-qwen2-vl"]
    return [
        (["encode", str(tmp_path / "nope.mp4"), *tiny, "-o", out], 3, "no such file"),
        (["encode", str(junk), *tiny, "-o", out], 3, "cannot read video"),
        (
            ["encode", str(zero_frame_video(tmp_path / "zero.mp4")), *tiny, "-o", out],
            3,
            "no frames",
        ),
        (["encode", clip, *tiny, "--method", "magic", "-o", out], 2, "unknown method 'magic'"),
        (
            ["encode", clip, "-m", "no-such/model", "-o", out],
            5,
            "is not on this machine and HF_HUB_OFFLINE is set: try --model demo",
        ),
        (
            ["encode", clip, *tiny, "--method", "recency", "--budget", "1.5", "-o", out],
            2,
            "budget must be in (0, 1]",
        ),
        (
            ["encode", clip, *tiny, "--method", "recency", "--budget", "0", "-o", out],
            2,
            "budget must be in (0, 1]",
        ),
        (["encode", clip, *tiny, "-o", str(existing)], 6, "already exists; pass --force"),
        (
            ["ask", str(qwen_pack), "what ?", "-m", "tiny-llava-ov"],
            4,
            "was made with model 'tiny-qwen2-vl'",
        ),
        (["ask", str(truncated), "what ?"], 4, "truncated"),
        (["ask", str(corrupted), "what ?"], 4, "corrupted"),
        (["ask", str(tmp_path / "missing.kvpack"), "what ?"], 4, "no such pack"),
        (["ask", str(qwen_pack), "   "], 2, "question is empty"),
        (["ask", str(qwen_pack), "what ?", "--budget", "0.5"], 2, "only applies with --prune"),
        (
            ["encode", clip, *tiny, "--budget-tokens", "9", "-o", out],
            2,
            "method 'full' keeps every token: --budget-tokens does not apply",
        ),
        (
            ["encode", clip, *tiny, "--method", "rekv", "--budget", "0.5", "-o", out],
            2,
            "method 'rekv' keeps every token: --budget does not apply",
        ),
        (
            ["encode", clip, *tiny, "--guidance-prompt", "what ?", "-o", out],
            2,
            "method 'full' uses no guidance prompt",
        ),
        (
            ["encode", str(existing), *tiny, "-o", str(existing), "--force"],
            2,
            "is the media being encoded",
        ),
        (["inspect", str(junk)], 4, "not a kvpack"),
        (
            ["encode", clip, "-m", "dmeo", "-o", out],
            2,
            "unknown model 'dmeo': did you mean 'demo'?",
        ),
        (["encode", clip, *tiny, "--method", "mkuv", "-o", out], 2, "did you mean 'mukv'?"),
        (["encode", clip, *tiny, "--fps", "0", "-o", out], 2, "--fps must be a positive number"),
        (["ask", str(qwen_pack), "what ?", "--at", "-1"], 2, "--at must be a finite number"),
    ]


def test_errors_are_one_line_with_exit_codes(tmp_path, qwen_pack):
    for args, code, message in error_cases(tmp_path, qwen_pack):
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.exit_code, result.stderr, result.stdout)
        assert message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, (
            result.stderr
        )
    assert (tmp_path / "existing.kvpack").read_bytes() == b"keep me"
    assert not (tmp_path / "out.kvpack").exists()


def test_error_in_a_real_process_has_no_traceback(tmp_path):
    result = mmkv("ask", str(tmp_path / "missing.kvpack"), "what ?")
    assert result.returncode == 4
    assert result.stderr.strip().splitlines() == [
        f"error: no such pack: {tmp_path / 'missing.kvpack'}"
    ]
    assert result.stdout == ""


def test_usage_errors_are_one_line_in_a_real_process(qwen_pack):
    cases = [
        (["ask", str(qwen_pack), "what ?", "--positions", "sideways"], "'sideways' is not one of"),
        (["encode", "x.mp4", "-o", "y", "--budget", "abc"], "Invalid value for '--budget'"),
        (["encode"], "Missing argument 'media'"),
        (["explode"], "No such command 'explode'"),
        (["ask", str(qwen_pack), "what ?", "--prune", "hermes"], "'hermes' does not prune at ask"),
        (["--presets", "/no/such/folder", "methods"], "--presets: no such folder"),
    ]
    for args, message in cases:
        result = mmkv(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert mmkv("--version").stdout.strip().startswith("mmkv ")
    assert mmkv("-V").stdout == mmkv("--version").stdout


@pytest.mark.parametrize(
    "preset, message",
    [
        ("extends: mukv\nparams:\n  views: sideways\n", "params.views: 'sideways' is not one of"),
        ("extends: snapkv\nparams:\n  pool_kernl: 7\n", "params: unknown key 'pool_kernl'"),
        ("extends: snapkv\nparms:\n  pool_kernel: 7\n", "unknown key 'parms'"),
        ("extends: hermes\nparams:\n  reindex: eagr\n", "params.reindex: 'eagr' is not one of"),
        ("extends: hermes\nparams:\n  summary: 3\n", "params.summary: expected true or false"),
        ("extends: snapkv\nparams:\n  pool_kernel: 0\n", "params.pool_kernel: 0 is below"),
        ("extends: snapkv\nbudget: 2\n", "budget: budget must be in (0, 1]"),
        ("extends: full\nbudget: 0.5\n", "keeps every token"),
        ("extends: typo\n", "extends itself"),
    ],
)
def test_a_wrong_preset_is_refused_before_encoding(tmp_path, monkeypatch, preset, message):
    (tmp_path / "methods").mkdir()
    path = tmp_path / "methods" / "typo.yaml"
    path.write_text(preset)
    monkeypatch.setenv("MMKV_PRESETS", str(tmp_path))
    out = tmp_path / "out.kvpack"
    args = ["encode", "no-such-video.mp4", "--model", "tiny-qwen2-vl", "--method", "typo", "-o"]
    result = runner.invoke(app, [*args, str(out)])  # no media: the preset must fail first
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], lines
    assert not out.exists()


def test_user_presets_override_the_built_in_ones_from_a_flag_or_the_environment(tmp_path):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "snapkv.yaml").write_text("budget: 0.5\nparams: {pool_kernel: 3}\n")
    (tmp_path / "methods" / "mine.yaml").write_text("extends: hermes-6k\ndescription: mine\n")
    listed = json.loads(
        runner.invoke(app, ["--presets", str(tmp_path), "methods", "--json"]).stdout
    )
    rows = {m["name"]: m for m in listed["methods"]}
    snap = {p["name"]: p["value"] for p in rows["snapkv"]["params"]}
    assert rows["snapkv"]["budget_share"] == 0.5 and snap["pool_kernel"] == 3
    assert rows["mine"]["implements"] == "hermes" and rows["mine"]["budget_tokens"] == 6144
    env = {**ENV, "MMKV_PRESETS": str(tmp_path)}
    again = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "methods", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert {m["name"] for m in json.loads(again.stdout)["methods"]} >= {"mine", "mukv-middle"}


def test_every_command_lists_a_one_line_summary():
    """`mmkv --help` shows each command's first paragraph with its line breaks kept (typer's rich
    mode): a summary wrapped in the source shows up cut mid-sentence there."""
    import typer

    group = typer.main.get_group(app)
    for name, command in group.commands.items():
        summary = (command.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, name
    listing = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    for name in group.commands:
        row = next(line for line in listing.splitlines() if line.startswith(f"│ {name} "))
        assert row.rstrip(" │").endswith((".", ")")), row


def test_help_reads_plainly_for_every_command():
    """Issue 39, item 6: usage lines name arguments in capitals (PACK, [QUESTIONS...]), not Typer's
    `{pack}`; flags carry no `<bool>`; every option says what it is for."""
    import typer

    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "100"})
        assert shown.exit_code == 0, (name, shown.output)
        usage = next(line for line in shown.output.splitlines() if "Usage:" in line)
        assert "{" not in usage and "}" not in usage, usage
        assert "<bool>" not in shown.output, name
        assert all(p.help for p in sub.params if p.param_type_name == "option"), name
    assert (
        "ask [OPTIONS] [PACK] [QUESTIONS...]"
        in runner.invoke(app, ["ask", "--help"], env={"COLUMNS": "100"}).output
    )
