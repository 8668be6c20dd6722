"""Abuse shared by the tests and bench/fuzz.py (issue 49): hostile names walked over every serve
route and verb, and every way out of `mmkv live -`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

HOSTILE = [
    "../escape",
    "../../tmp/x",
    "/tmp/abs",
    "a/b",
    "a\\b",
    "x\x00y",
    ".hidden",
    ".",
    "..",
    "a..b",
    "x.",
    "",
    " x",
    "x y",
    "x" * 10_000,
    "caf\u00e9",
    "\uff45vil",  # a full-width 'e': looks like "evil"
    "clip\u200b",  # a zero-width space
    "CON",
    "nul.txt",
    "com1",
    "Lpt9.kvpack",
]


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def walk_serve_routes(root: Path) -> Counter:
    """Every hostile name at every route and verb of a server over `root`/packs: (route, status)
    counts, and ("created", n) for files that appeared anywhere under `root`."""
    from fastapi.testclient import TestClient

    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.serve.app import create_app

    root.mkdir(parents=True, exist_ok=True)
    before = tree(root)
    folder = root / "packs"
    folder.mkdir(exist_ok=True)
    before.add("packs")
    client = TestClient(create_app(folder, LoadOptions("demo", "cpu")))
    seen: Counter = Counter()
    for name in HOSTILE:
        body = {"name": name, "source": str(root / "none.ts"), "model": "demo"}
        seen["POST /v1/streams", client.post("/v1/streams", json=body).status_code] += 1
        at = quote(name, safe="")
        if name not in ("", ".", ".."):  # a URL resolves these segments itself
            for verb, route in [
                ("GET", "/v1/streams/"),
                ("DELETE", "/v1/streams/"),
                ("GET", "/v1/models/"),
                ("GET", "/v1/packs/"),
            ]:
                seen[f"{verb} {route}NAME", client.request(verb, route + at).status_code] += 1
        chat = {"model": name, "messages": [{"role": "user", "content": "what ?"}]}
        seen[
            "POST /v1/chat/completions", client.post("/v1/chat/completions", json=chat).status_code
        ] += 1  # noqa: E501
    seen["created", len(tree(root) - before)] += 1
    return seen


# what the pipe gets ("all": the sample clip as MPEG-TS), the signal, the seconds after the first
# snapshot it is sent (None: 2 s after the start, before any frame), --stall, the exit code
STDIN_ENDINGS = {
    "no frame yet": (b"", signal.SIGTERM, None, "60", 3),
    "frames flowing": ("all", signal.SIGTERM, 0.0, "60", 0),
    "pipe idle": ("all", signal.SIGINT, 4.0, "60", 0),
    "stall": ("all", None, None, "2", 0),
    "junk": (b"\x00junk" * 50_000, None, None, "2", 3),
}


def end_live_from_stdin(case: str, folder: Path) -> tuple[int, list[str], bool | None]:
    """(exit code, stderr lines, whether the pack left verifies: None when there is none)."""
    from mmkv_cli import api
    from tests.conftest import SAMPLES
    from tests.helpers import mpegts_bytes

    feed, stop, after, stall, _ = STDIN_ENDINGS[case]
    feed = mpegts_bytes(SAMPLES / "clip.mp4") if feed == "all" else feed
    (folder / "q.txt").write_text("")
    out = folder / "live.kvpack"
    follow = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "live", "-", "-o", str(out), "--model", "tiny-llava-ov"]
        + ["--method", "hermes", "--budget-tokens", "24", "--fps", "2", "--stall", stall]
        + ["--questions", str(folder / "q.txt"), "--snapshot-every", "1"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        follow.stdin.write(feed)
        follow.stdin.flush()
        if stop is not None:
            deadline = time.monotonic() + 120
            while after is not None and not out.exists() and time.monotonic() < deadline:
                time.sleep(0.1)  # frames are flowing once the first snapshot is out
            time.sleep(2.0 if after is None else after)
            follow.send_signal(stop)
        _, err = follow.communicate(timeout=120)  # the pipe stays open until it ends
    finally:
        follow.kill()
    verified = api.verify(out)["ok"] if out.exists() else None
    return follow.returncode, err.decode().strip().splitlines(), verified
