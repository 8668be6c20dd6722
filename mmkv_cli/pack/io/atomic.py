"""Files written whole or not at all: a target checked before any work, a temporary file beside
it named by its writer's process, and the stale ones of writers that died swept away."""

from __future__ import annotations

import os
from glob import escape as glob_escape
from pathlib import Path

from mmkv_cli.core.errors import OutputExistsError, UsageError, output_exists


def check_writable(path: Path, force: bool) -> None:
    """Fail before any work is done when the target exists (and --force is off) or cannot be
    written."""
    if path.exists() and not force:
        raise output_exists(path)
    if path.exists() and path.is_dir():
        raise OutputExistsError(f"{path} is a folder, not a pack file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path}: folder {parent} does not exist")


TEMP_SUFFIX = ".mmkv-partial"  # .NAME.PID.mmkv-partial: a pack being written by process PID


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process, or unknowable: leave its file be
    return True


def sweep_stale(path: Path, prefix: str | None = None, suffix: str = TEMP_SUFFIX) -> None:
    """Remove partial files for `path` (named PREFIX.PID SUFFIX, by default .NAME.PID.mmkv-partial)
    left by writers that died (kill -9 in the write window): each names its process, and a process
    that no longer runs will never finish it."""
    parent = path.parent if str(path.parent) else Path(".")
    prefix = prefix if prefix is not None else f".{path.name}"
    for partial in parent.glob(f"{glob_escape(prefix)}.*{suffix}"):
        pid = partial.name[len(prefix) + 1 : -len(suffix)]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)
