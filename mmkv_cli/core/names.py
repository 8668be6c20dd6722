"""Names that come from outside (a request, a manifest, a file's name) and become file names: one
check, and one way to turn such a name into a path inside a folder.

A name is ASCII letters, digits, '.', '_' and '-', starts with a letter or digit, has no '..', does
not end with '.', is at most 128 characters, and is none of Windows' reserved device names (a pack
folder may be shared with one). Non-ASCII names are refused: look-alike letters would let two
different names read as one in a listing.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmkv_cli.core.errors import UsageError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RESERVED = {"con", "prn", "aux", "nul"} | {f"{d}{i}" for d in ("com", "lpt") for i in range(10)}
RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128"


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a file name here, or None."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"a name is {RULE}"
    if ".." in name or name.endswith("."):
        return "a name has no '..' and does not end with '.'"
    if name.split(".")[0].lower() in RESERVED:
        return f"'{name}' is a reserved device name"
    return None


def checked_name(name: object, what: str = "name") -> str:
    """`name` if it may be a file name, else UsageError (exit 2, HTTP 400) in one line."""
    problem = name_problem(name)
    if problem is not None:
        shown = repr(name)[:40] + ("..." if len(repr(name)) > 40 else "")
        raise UsageError(f"bad {what} {shown}: {problem}")
    return name  # type: ignore[return-value]


def inside(folder: Path, name: object, suffix: str = "", what: str = "name") -> Path:
    """The file `name` + `suffix` directly in `folder`, the name checked first."""
    path = Path(folder) / f"{checked_name(name, what)}{suffix}"
    if path.resolve().parent != Path(folder).resolve():  # belt and braces: a link in the way
        raise UsageError(f"bad {what} {name!r}: it leads out of {folder}")
    return path


def stem_from(text: str, fallback: str = "media") -> str:
    """A name made from any file's name (a batch item's media): what is not allowed becomes '_',
    leading characters that cannot start a name go, and it is cut to 80 characters."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", text).replace("..", "_")
    stem = re.sub(r"^[^A-Za-z0-9]+", "", stem)[:80].rstrip(".")
    return stem if name_problem(stem) is None else fallback
