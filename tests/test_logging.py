"""mmkv logs through the standard `logging` module under `mmkv`: silent in a library, shown by the
CLI's -v, -vv, --log-level or MMKV_LOG on stderr (rich's handler); -q leaves answers and errors."""

import logging
import subprocess
import sys

import mmkv
from tests.conftest import SAMPLES
from tests.helpers import run_mmkv as mmkv_cli

CLIP = str(SAMPLES / "clip.mp4")


def test_verbose_shows_the_steps_and_json_stays_clean(tmp_path):
    pack = str(tmp_path / "c.kvpack")
    plain = mmkv_cli("encode", CLIP, "--model", "demo", "-o", pack, "--json")
    assert plain.returncode == 0 and "mmkv." not in plain.stderr  # warnings only by default
    told = mmkv_cli("-v", "encode", CLIP, "--model", "demo", "-o", pack, "--force", "--json")
    assert told.returncode == 0, told.stderr
    assert "mmkv.backbones.loading: loaded model demo (llava_onevision) on cpu" in told.stderr
    assert "mmkv.encode.record: wrote" in told.stderr and "DEBUG" not in told.stderr
    assert mmkv.inspect(pack).path == pack and told.stdout.count("\n") == 1  # one JSON line
    question = ["ask", pack, "what color is the circle ?"]
    detailed = mmkv_cli(*question, env={"MMKV_LOG": "debug"})
    assert detailed.stdout.strip() == "red" and "DEBUG" in detailed.stderr
    assert "mmkv.api: answered from" in detailed.stderr
    assert "DEBUG" in mmkv_cli("-vv", *question).stderr
    assert (
        "INFO" not in mmkv_cli("--log-level", "warning", *question, env={"MMKV_LOG": "info"}).stderr
    )


def test_quiet_leaves_answers_and_errors(tmp_path):
    pack = str(tmp_path / "l.kvpack")
    live = ["live", CLIP, "-o", pack, "--model", "demo", "--budget-tokens", "24", "--stall", "0.5"]
    noted = mmkv_cli(*live)
    assert noted.returncode == 0 and "ready:" in noted.stderr
    hushed = mmkv_cli("-q", *live, "--force")
    assert hushed.returncode == 0 and hushed.stderr == "", hushed.stderr
    refused = mmkv_cli("-q", *live)
    assert refused.returncode == 6 and refused.stderr.startswith("error: ")
    assert "already exists" in refused.stderr and refused.stderr.count("\n") == 1
    wrong = mmkv_cli("methods", env={"MMKV_LOG": "loud"})
    assert wrong.returncode == 2
    assert wrong.stderr == (
        "error: MMKV_LOG must be one of debug, info, warning, error, critical, not 'loud'\n"
    )


def test_a_library_logs_only_where_its_user_asks(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mmkv")
    mmkv.unload()  # the model loads here, not in an earlier test of this process
    mmkv.encode(CLIP, tmp_path / "p.kvpack", model="demo", max_frames=4)
    loaded = [r for r in caplog.records if r.name == "mmkv.backbones.loading"]
    assert loaded and loaded[0].levelno == logging.INFO and "demo" in loaded[0].getMessage()
    assert any(r.name == "mmkv.encode.record" for r in caplog.records)
    script = (
        "import logging, mmkv\n"
        f"mmkv.encode({CLIP!r}, 'q.kvpack', model='demo', max_frames=4)\n"
        "logging.basicConfig(level=logging.INFO)\n"  # the user's own configuration shows them
        "mmkv.unload()\n"  # the model loads again: its record shown this time
        f"mmkv.encode({CLIP!r}, 'q.kvpack', model='demo', max_frames=4, force=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("INFO:mmkv.backbones.loading:loaded model demo") == 1, done.stderr


def test_debug_records_never_land_on_the_answers_line(tmp_path):
    """-vv with stdout and stderr on one terminal (here one pipe): the records that come while
    the answer streams wait for its line to end, so the answer is a line of its own."""
    import os

    pack = str(tmp_path / "c.kvpack")
    assert mmkv_cli("encode", CLIP, "--model", "demo", "-o", pack, "--no-server").returncode == 0
    both = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "-vv", "ask", pack, "what color is the circle ?",
         "--no-server"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert both.returncode == 0, both.stdout
    lines = both.stdout.splitlines()
    assert "red" in lines, lines  # whole, alone on its line
    assert lines.index("red") < next(i for i, line in enumerate(lines) if "answered from" in line)
    chat = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "-vv", "chat", pack, "--no-server"],
        input="what color is the circle ?\nwhich shape appeared last ?\n",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert chat.returncode == 0, chat.stdout
    assert {"red", "triangle"} <= set(chat.stdout.splitlines()), chat.stdout  # chat's too
