"""The batch loop: items handed to workers (this process, or Ray actors), each finished row written
to the ledger as it comes, so a rerun or a reader of the ledger sees every item done so far."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from mmkv_cli.batch.manifest import BatchItem
from mmkv_cli.batch.run import BatchSettings, BatchWorker, check_items
from mmkv_cli.core.errors import UsageError
from mmkv_cli.pack import is_url, local_path, read_text, write_text

LEDGER = "batch.jsonl"
REMOTE_FLUSH_S = 10.0  # a remote ledger is rewritten whole: at most this often, and at the end


class Ledger:
    """DEST/batch.jsonl: one JSON row per item run (pack, bytes, seconds, status, error), oldest
    first. Locally each row is appended and synced as it finishes; on object storage, where
    nothing appends, the whole ledger is rewritten every REMOTE_FLUSH_S seconds and at close."""

    def __init__(self, dest: str):
        self.where = f"{dest.rstrip('/')}/{LEDGER}"
        self.remote = is_url(dest)
        if not self.remote:
            folder = local_path(dest)
            if folder.exists() and not folder.is_dir():
                raise UsageError(f"--out {dest} is a file: it names the folder packs go to")
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise UsageError(f"--out: cannot make {dest}: {err.strerror or err}") from None
        before = read_text(self.where) if self.remote else _read(local_path(self.where))
        self._text = (before or "") if self.remote else ""
        self._flushed = time.monotonic()
        self.known: dict[str, dict] = {}  # media -> its last known version and digest
        for line in (before or "").splitlines():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue  # a line cut short by a crash (or junk): that item simply runs again
            if isinstance(row, dict) and row.get("media_digest") and row.get("media_version"):
                self.known[str(row.get("media"))] = {
                    "version": row["media_version"],
                    "digest": row["media_digest"],
                }

    def add(self, row: dict) -> None:
        line = json.dumps(row, sort_keys=True) + "\n"
        if self.remote:
            self._text += line
            if time.monotonic() - self._flushed >= REMOTE_FLUSH_S:
                self.flush()
            return
        with open(local_path(self.where), "a", encoding="utf-8") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

    def flush(self) -> None:
        if self.remote:
            write_text(self.where, self._text)
            self._flushed = time.monotonic()


def _read(path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None


def run_batch(
    items: list[BatchItem],
    settings: BatchSettings,
    *,
    ray: str | None = None,
    workers: int = 1,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: float = 0.0,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run every item; returns their ledger rows in the order they finished. ray: None (this
    process, one item after another), "local" (a Ray instance started here), "auto" (the cluster
    this node belongs to) or a cluster address (ray://host:10001)."""
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if cpus_per_worker <= 0 or gpus_per_worker < 0:
        raise UsageError("--cpus-per-worker must be positive and --gpus-per-worker 0 or more")
    if ray is None and workers > 1:
        raise UsageError("--workers > 1 runs on Ray: add --ray local, --ray auto or --ray ADDRESS")
    check_items(items, settings)
    ledger = Ledger(settings.dest)
    rows: list[dict] = []

    def finished(row: dict) -> None:
        ledger.add(row)
        rows.append(row)
        if on_row:
            on_row(row)

    try:
        if ray is None:
            worker = BatchWorker(settings)
            for item in items:
                finished(worker.run(item, ledger.known.get(item.media)))
        else:
            from mmkv_cli.batch.on_ray import run_on_ray

            known = ledger.known
            run_on_ray(
                items, settings, ray, workers, cpus_per_worker, gpus_per_worker, known, finished
            )
    finally:
        ledger.flush()
    return rows


def summary(rows: list[dict], items: int, seconds: float) -> dict:
    """The batch in figures: counts by status, bytes written, items encoded a minute."""
    by_status = {s: sum(r["status"] == s for r in rows) for s in ("ok", "skipped", "failed")}
    return {
        "items": items,
        **by_status,
        "not_run": items - len(rows),
        "bytes_written": sum(r.get("bytes") or 0 for r in rows if r["status"] == "ok"),
        "seconds": round(seconds, 2),
        # encodes a minute: items skipped (their pack already there) or failed took no encode
        "items_per_minute": (
            round(by_status["ok"] / seconds * 60, 2) if seconds > 0 and by_status["ok"] else None
        ),
        "failures": [
            {"media": r["media"], "error": r["error"]} for r in rows if r["status"] == "failed"
        ],
    }
