"""An eval's run folders: where a run's answers live, and resuming them honestly.

A run folder (OUT/<model>/<method>-b<budget>[-kvN]/) holds predictions.jsonl, config.json and
metrics.json. A rerun reuses earlier answers only when everything that changes an answer is the
same: model fingerprint, method and its parameters, budget, fps, max frames, positions, max new
tokens, stored bits, and the questions (videos, texts, options, moments; not the gold answers,
against which every answer is scored afresh). config.json records a digest of all of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.names import name_problem, stem_from


def run_folder(
    out: Path, model: str, method: str, level: str, kv_bits: int = 16, protocol: str = "replay"
) -> Path:
    """OUT/<model>/<method>-<level>[-kvB][-stream]: level b<share> or t<tokens>."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model)  # a model may be a path or an HF id
    if name_problem(safe) is not None:  # '..', a leading '_' (a path): a plain folder name
        safe = stem_from(model, "model")
    stored = "" if kv_bits == 16 else f"-kv{kv_bits}"
    streamed = "-stream" if protocol == "stream" else ""
    return out / safe / f"{method}-{level}{stored}{streamed}"


def _done(predictions: Path) -> dict[str, dict]:
    """Answers already given. A line cut short by an interrupted run is dropped (the file rewritten
    without it, atomically, so new answers never glue onto it): that question is asked again."""
    if not predictions.exists():
        return {}
    rows, clean = {}, True
    for line in predictions.read_text().splitlines():
        try:
            row = json.loads(line)
            rows[row["key"]] = row
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            clean = False
    if not clean or not predictions.read_text().endswith("\n"):
        tmp = predictions.with_name(predictions.name + ".part")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
        tmp.replace(predictions)
    return rows


def questions_digest(items) -> str:
    """The question set as answers depend on it: each item without its gold answer, and each
    video's size and modification time (a re-rendered clip is another clip)."""
    h = hashlib.sha256()
    for item in items:
        h.update(json.dumps([item.video, item.question, item.at, list(item.options)]).encode())
    for video in sorted({item.video for item in items}):
        try:
            stat = os.stat(video)
            h.update(f"{video}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        except OSError:
            h.update(f"{video}:missing".encode())
    return h.hexdigest()


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def open_run(folder: Path, settings: dict, fresh: bool) -> dict[str, dict]:
    """The answers already in `folder` made under exactly `settings` (fresh: none, the old ones
    deleted). Answers made under other settings are never mixed in: the run is refused instead."""
    folder.mkdir(parents=True, exist_ok=True)
    predictions, config = folder / "predictions.jsonl", folder / "config.json"
    digest = settings_digest(settings)
    if fresh:
        for name in ("predictions.jsonl", "metrics.json"):
            (folder / name).unlink(missing_ok=True)
    elif predictions.exists() and predictions.stat().st_size:
        try:
            old = json.loads(config.read_text())
        except (OSError, ValueError, RecursionError):
            old = {}
        if not isinstance(old, dict) or old.get("settings_sha256") != digest:
            before = old.get("settings") if isinstance(old, dict) else None
            before = before if isinstance(before, dict) else {}
            changed = [k for k in settings if before.get(k) != settings[k]] or ["unrecorded"]
            raise UsageError(
                f"{folder} holds answers made under other settings ({', '.join(changed)}): pass "
                "--fresh to start this run over, or another --out"
            )
    record = {**settings, "settings": settings, "settings_sha256": digest}
    partial = config.with_name(config.name + ".part")
    partial.write_text(json.dumps(record, indent=1, default=str) + "\n")
    partial.replace(config)
    return _done(predictions)


@contextmanager
def work_folder(folder: Path):
    """folder/.work for a run's packs (not /tmp: a killed run leaves nothing elsewhere); whatever
    an earlier run left there is cleared first, and the folder is removed after."""
    work = folder / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
