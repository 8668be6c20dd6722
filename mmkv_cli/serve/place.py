"""Where the warm local server lives: a private folder (0700, this user's) holding its socket
(0600), the lock that lets one server own it, and its log. No torch, no web stack: every client
imports this.

The folder is $XDG_RUNTIME_DIR/mmkv (the login session's own tmpfs), else /tmp/mmkv-UID. A folder
that another user owns, or that others may enter, is refused rather than used: a socket there could
be someone else's.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.core.errors import UsageError

SOCKET_NAME = "mmkv.sock"
# AF_UNIX paths are at most 107 bytes on Linux (108 with the NUL)
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Place:
    """A server's socket, and beside it its lock and log."""

    socket: Path

    @property
    def folder(self) -> Path:
        return self.socket.parent

    @property
    def lock(self) -> Path:
        return self.socket.with_suffix(".lock")

    @property
    def log(self) -> Path:
        return self.socket.with_suffix(".log")


def runtime_folder() -> Path:
    """The private folder for this user's server (not created here)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "mmkv"
    return Path("/tmp") / f"mmkv-{os.getuid()}"


def local_place(host: str | None = None) -> Place:
    """The server a client talks to: `host` (MMKV_HOST's or the config's: a socket path, with or
    without 'unix:'), else this user's own. A host that is not a socket path is one line."""
    if host:
        if host.startswith("unix:"):
            host = host[len("unix:") :]
        if "://" in host or not host.startswith(("/", "~", ".")):
            raise UsageError(
                f"MMKV_HOST must name a server's socket (unix:/path/mmkv.sock), not '{host[:200]}'"
            )
        return Place(Path(host).expanduser().absolute())
    return Place(runtime_folder() / SOCKET_NAME)


def private_folder(folder: Path, create: bool) -> bool:
    """Whether `folder` is this user's alone (0700, owned by us); created so when `create`. A
    folder that exists but is not private is refused, in one line: its socket cannot be trusted."""
    if create:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot make the server's folder {folder}: {err.strerror}") from None
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UsageError(f"{folder} is not this user's folder: the local server cannot use it")
    if info.st_mode & 0o077:
        raise UsageError(
            f"{folder} may be entered by other users (mode {stat.S_IMODE(info.st_mode):o}): "
            "chmod 700 it, or remove it"
        )
    return True


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise UsageError(
            f"the socket path {path} is longer than {MAX_SOCKET_PATH} bytes: set XDG_RUNTIME_DIR "
            "or MMKV_HOST to a shorter one"
        )
