"""Every shell block of the README and the docs: each `mmkv` line parses against the CLI as it is
(no option a release renamed), and each block runs as a user would copy it, in a fresh folder with
stand-ins for the files it names (movie.mp4, questions.jsonl, ...) and the demo backbone as the
default model, unless the line above its fence says why not: `<!-- not run: REASON -->` (a hub
checkpoint, object storage, a server, a study of many minutes). `text` blocks are not commands."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import typer

from mmkv_cli.cli.app import app
from tests.conftest import ROOT

FENCE = re.compile(
    r"(?:<!-- not run: (?P<why>[^>]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S
)
SHELL = ("", "sh", "bash", "console", "shell")
REASONS = ("hub", "object storage", "server", "long", "make", "interactive", "interrupted")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = typer.main.get_command(app)


def shell_blocks() -> list[tuple[str, str, str | None]]:
    found = []
    for page in PAGES:
        for i, match in enumerate(FENCE.finditer(page.read_text())):
            if match["lang"] in SHELL:
                found.append((f"{page.name}#{i}", match["body"], match["why"]))
    return found


BLOCKS = shell_blocks()


def mmkv_lines(body: str) -> list[list[str]]:
    """The arguments of each `mmkv` command in a block (continuations joined, comments, pipes
    and redirections dropped)."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        for segment in " ".join(shlex.split(line, comments=True)).split(" | "):
            words = shlex.split(segment)
            if words[:1] == ["mmkv"]:
                commands.append(words[1 : words.index(">") if ">" in words else None])
    return commands


@pytest.mark.parametrize(("where", "body", "why"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_mmkv_line_of_the_docs_parses(where, body, why):
    for args in mmkv_lines(body):
        name, rest = args[0], args[1:]
        assert name in COMMAND.commands, f"{where}: no command '{name}'"
        with COMMAND.commands[name].make_context(name, rest):  # options and values checked
            pass


def stand_ins(folder: Path) -> None:
    """The files the docs' blocks name, made here: the samples, a 128-second movie (the cuts go
    past a minute), its copies, a question file and a question set."""
    (folder / "samples").symlink_to(ROOT / "samples")
    made = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "synth", "set", "--clips", "1", "--frames", "64"]
        + ["--fps", "0.5", "--kind", "normal"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    for name in ("movie.mp4", "hour.mp4", "talk.mp4"):
        shutil.copy(next((folder / "set" / "clips").glob("*.mp4")), folder / name)
    shutil.copy(folder / "set" / "qa.jsonl", folder / "qa.jsonl")
    (folder / "clips").symlink_to(folder / "set" / "clips")  # where qa.jsonl's videos are
    questions = '{"question": "what color is the circle ?"}\n{"question": "which shape ?"}\n'
    (folder / "questions.jsonl").write_text(questions)


RUN = [b for b in BLOCKS if b[2] is None]
PAGES_RUN = sorted({where.split("#")[0] for where, _, _ in RUN})


@pytest.mark.parametrize("page", PAGES_RUN)
def test_the_shell_blocks_of_a_page_run_in_order(tmp_path, page):
    """A page's blocks run one after another in one folder, as a reader goes down the page (a
    later block asks the pack an earlier one wrote)."""
    stand_ins(tmp_path)
    env = {**os.environ, "MMKV_MODEL": "demo", "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    venv_bin = str(Path(sys.executable).parent)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the checkout's venv, which a page may activate
    if page == "README.md":  # the front door: mmkv on the PATH only as its own lines put it there
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    else:
        env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"  # this venv's mmkv
    # a warm server a page starts is the page's own, and ends with it
    env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="mdr-", dir="/tmp")
    try:
        _run_page(tmp_path, page, env)
    finally:
        subprocess.run([sys.executable, "-m", "mmkv_cli", "stop"], env=env, capture_output=True)
        shutil.rmtree(env["XDG_RUNTIME_DIR"], ignore_errors=True)


def _run_page(tmp_path: Path, page: str, env: dict) -> None:
    sourced = ""  # one terminal: what an earlier block sourced holds in the later ones
    for where, body, _ in (b for b in RUN if b[0].split("#")[0] == page):
        script = "set -euo pipefail\n" + sourced + body.replace("/tmp/", f"{tmp_path}/")
        sourced += "".join(f"{line}\n" for line in body.splitlines() if line.startswith("source "))
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
        assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_a_block_not_run_says_why_in_few_words():
    marked = [(where, why) for where, _, why in BLOCKS if why is not None]
    assert all(why.split(" (")[0] in REASONS for _, why in marked), marked
    assert len(RUN) >= 5 and len(marked) < len(BLOCKS)
