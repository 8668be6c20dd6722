"""Every Python block of the README and the docs runs, as a user would copy it, in a fresh process
in a folder of its own (the samples beside it); the answers it prints are the demo clip's truth.
The serving guide's block runs against a real `mmkv serve` (issue 52)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import encode_pack, serving

BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# lines each block prints, in this order (others may come between): the demo clip shows a red
# circle first
TRUTH = {
    "README.md#0": ["circle"],
    "warm.md#0": ["red", "circle"],
    "python.md#0": [r"0\.4 Smoothing\(", r"hermes 24 \d+ ", "circle", "red"],
    "python.md#1": [r"method hermes\.deep_share: 2\.0 is above the maximum 1", "MuKV 3"],
    "python.md#2": [
        r"what color is the circle \? -> red at ",
        r"which shape appeared first \? -> circle at 2\.0",
        "ended",
    ],
}


def blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, match in enumerate(BLOCK.finditer(page.read_text())):
            found.append((f"{page.name}#{i}", match.group(1)))
    return found


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[w for w, _ in blocks()])
def test_a_python_block_of_the_docs_runs_and_tells_the_truth(tmp_path, where, code):
    (tmp_path / "samples").symlink_to(ROOT / "samples")
    served = "127.0.0.1:8000" in code
    if served:
        packs = tmp_path / "packs"
        packs.mkdir()
        encode_pack(ROOT / "samples" / "clip.mp4", packs / "clip.kvpack", model="demo")
    script = tmp_path / "block.py"

    def run(base: str | None) -> subprocess.CompletedProcess:
        script.write_text(code.replace("http://127.0.0.1:8000", base) if base else code)
        return subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=300,
        )

    if served:
        with serving(str(packs)) as base:
            done = run(base)
    else:
        done = run(None)
        again = run(None)  # copied twice: a rerun replaces what the first wrote (force=True)
        assert again.returncode == 0, again.stderr
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines, "the block printed nothing"
    shown = iter(lines)
    for want in TRUTH.get(where, []):
        assert any(re.fullmatch(want + ".*", line) for line in shown), (want, lines)
