"""`mmkv live -` ends cleanly on every way out (issue 49): a signal with no frame yet, with frames
flowing, with the pipe open and idle; the stall; junk. Exit 0 with a final pack that verifies, or 3
with one line: never an abort (exit 134) from a reader thread holding stdin's buffer at shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mmkv_cli import api
from tests.conftest import SAMPLES
from tests.helpers import mpegts_bytes

CASES = {  # what the pipe gets, the signal, when (s), --stall, the exit code
    "no frame yet": (b"", signal.SIGTERM, 2.0, "60", 3),
    "frames flowing": ("all", signal.SIGTERM, 5.0, "60", 0),
    "pipe idle": ("all", signal.SIGINT, 9.0, "60", 0),
    "stall": ("all", None, 0.0, "2", 0),
    "junk": (b"\x00junk" * 50_000, None, 0.0, "2", 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_live_from_stdin_ends_cleanly(tmp_path, case):
    feed, stop, after, stall, code = CASES[case]
    feed = mpegts_bytes(SAMPLES / "clip.mp4") if feed == "all" else feed
    (tmp_path / "q.txt").write_text("")
    out = tmp_path / "live.kvpack"
    follow = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "live", "-", "-o", str(out), "--model", "tiny-llava-ov"]
        + ["--method", "hermes", "--budget-tokens", "24", "--fps", "2", "--stall", stall]
        + ["--questions", str(tmp_path / "q.txt")],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        follow.stdin.write(feed)
        follow.stdin.flush()
        if stop is not None:
            time.sleep(after)
            follow.send_signal(stop)
        _, err = follow.communicate(timeout=120)  # the pipe stays open until it ends
    finally:
        follow.kill()
    lines = err.decode().strip().splitlines()
    assert follow.returncode == code and len(lines) == 1, err.decode()
    if code == 0:
        assert api.verify(out)["ok"] and lines[0].startswith("wrote ")
    else:
        assert lines[0].startswith("error: ") and not out.exists()
