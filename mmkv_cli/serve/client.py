"""The thin side of the warm server: find it (or start it), and ask it what the in-process path
would compute. Imports neither torch nor transformers, so a question costs its answer, not a
start-up.

`RemoteSession` has the face of `api.PackSession` the CLI uses (`ask`, `turn_tokens`,
`media_kind`): the commands run the same code either way, and print the same.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mmkv_cli.core import logs
from mmkv_cli.core.config import seconds_of
from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.options import AskOptions, EncodeOptions, LoadOptions
from mmkv_cli.serve import wire
from mmkv_cli.serve.place import Place, local_place, private_folder

LOG = logs.get(__name__)
START_WAIT_S = 60.0  # a server started here has this long to open its socket


class ServerGone(MmkvError):
    """The server closed the channel before the request's end."""

    exit_code = 10


class Client:
    """One connection to a server; requests go one after another on it."""

    def __init__(self, place: Place, channel: wire.Channel):
        self.place, self.channel = place, channel

    def request(self, op: str, on_event: Callable[[dict], None] | None = None, **fields) -> dict:
        """Send one request; hand each event before its end to `on_event`; the end's fields, or
        the error the in-process path would raise."""
        # a server that refused the connection said why before closing: that is read below
        with contextlib.suppress(wire.ChannelClosed):
            self.channel.send({"op": op, **fields})
        try:
            while True:
                event = self.channel.receive()
                kind = event.get("event")
                if kind == "done":
                    return event
                if kind == "error":
                    raise wire.raised(event)
                if on_event is not None:
                    on_event(event)
        except KeyboardInterrupt:
            # Ctrl-C mid-answer (chat goes on): the rest of this answer must not reach the next
            # request, so this connection goes (the server stops generating) and a fresh one
            # takes its place
            self._reconnect()
            raise
        except wire.ChannelClosed:
            raise ServerGone(
                f"the mmkv server at {self.place.socket} stopped before answering (its log: "
                f"{self.place.log}); run again, or pass --no-server"
            ) from None

    def _reconnect(self) -> None:
        self.channel.close()
        fresh = connect(self.place)
        if fresh is not None:
            self.channel = fresh.channel

    def close(self) -> None:
        self.channel.close()


def connect(place: Place) -> Client | None:
    """A connection to the server at `place`, or None when none answers there (no socket, or one
    a dead server left)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(place.socket))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        sock.close()
        return None
    except OSError as err:
        sock.close()
        raise UsageError(
            f"cannot reach the mmkv server at {place.socket}: {err.strerror}"
        ) from None
    return Client(place, wire.Channel(sock))


def server_host() -> str | None:
    """MMKV_HOST, else the config file's `host`."""
    from mmkv_cli.core.config import config

    return os.environ.get("MMKV_HOST") or config().host


def keep_alive() -> float | None:
    """How long a server started by a client stays idle (None: clients start none)."""
    from mmkv_cli.core.config import config

    given = os.environ.get("MMKV_KEEP_ALIVE")
    if given is not None:
        seconds = seconds_of(given, "MMKV_KEEP_ALIVE")
    elif config().keep_alive is not None:
        seconds = seconds_of(config().keep_alive, "keep_alive")
    else:
        return None
    return seconds if seconds != 0 else None


def warm_client(no_server: bool = False, start: bool = True) -> Client | None:
    """The server this command should use: a running one (MMKV_HOST's, else this user's), else
    one started now when keep_alive says so; None: run in this process."""
    if no_server or os.environ.get("MMKV_NO_SERVER"):
        return None
    host = server_host()
    place = local_place(host)
    if not host:
        try:
            ours = private_folder(place.folder, create=False)
        except UsageError as err:  # not ours to trust: never connect there
            LOG.warning("%s; running here", err)
            return None
        if not ours:
            return _started(place, start)
    found = connect(place)
    if found is None and host:
        raise UsageError(
            f"no mmkv server answers at {place.socket} (MMKV_HOST, or the config's host)"
        )
    return found if found is not None else _started(place, start)


def _started(place: Place, start: bool) -> Client | None:
    """A server started for this command when keep_alive says so (None: run here)."""
    alive = keep_alive() if start else None
    return None if alive is None else start_server(place, alive)


def start_server(place: Place, alive: float) -> Client:
    """A server for this user started in the background (it leaves after `alive` seconds idle);
    when another client starts one at the same moment, the one that wins serves both."""
    private_folder(place.folder, create=True)
    status("starting the mmkv server ...")
    with open(place.log, "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "mmkv_cli", "serve", "--no-http", "--keep-alive", str(alive)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # not the terminal's: Ctrl-C in this shell leaves it running
            env={**os.environ, "MMKV_HOST": str(place.socket)},
        )
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        client = connect(place)
        if client is not None:
            return client
        time.sleep(0.05)
    raise MmkvError(f"the mmkv server did not start in {START_WAIT_S:.0f} s (its log: {place.log})")


def status(line: str) -> None:
    """A line on a terminal saying what is under way (nothing off a terminal, nothing with -q)."""
    if sys.stderr.isatty() and not os.environ.get("MMKV_QUIET"):
        sys.stderr.write(f"{line}\r")
        sys.stderr.flush()


def clear_status() -> None:
    if sys.stderr.isatty() and not os.environ.get("MMKV_QUIET"):
        sys.stderr.write("\x1b[2K\r")
        sys.stderr.flush()


class RemoteSession:
    """A pack opened in the server: as `api.PackSession`, for the members the CLI uses."""

    def __init__(self, client: Client, pack: str, load: LoadOptions):
        from mmkv_cli.pack import local_path

        shown = local_path(pack)  # as the in-process reader names it: its errors say it so
        self.client, self.load = client, load
        self.fields = {
            "pack": str(shown.absolute()),
            "pack_shown": str(shown),
            "load": wire.load_record(load),
        }
        status("loading the model in the server ...")
        try:  # the server opens and checks the pack, as PackSession does, then its model
            opened = client.request("open", **self.fields)
        finally:
            clear_status()
        self.media_kind = str(opened["media_kind"])

    def ask(
        self,
        question: str,
        options: AskOptions | None = None,
        on_token: Callable[[str], None] | None = None,
    ):
        def on_event(event: dict) -> None:
            if on_token is not None and event.get("event") == "token":
                on_token(str(event.get("text", "")))

        done = self.client.request(
            "ask",
            on_event,
            question=question,
            options=wire.ask_record(options or AskOptions()),
            stream=on_token is not None,
            **self.fields,
        )
        return wire.answer_from(done.get("answer") or {})

    def turn_tokens(self, turns: tuple[tuple[str, str], ...]) -> int:
        return int(self.client.request("turn_tokens", turns=list(turns), **self.fields)["tokens"])

    def close(self) -> None:
        self.client.close()


def remote_encode(
    client: Client,
    media: str,
    output: str,
    options: EncodeOptions,
    load: LoadOptions,
    progress: Callable[[int, int], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
) -> dict:
    """`api.encode` run in the server (media and output by their absolute paths)."""

    def on_event(event: dict) -> None:
        if event.get("event") == "start" and on_start is not None:
            frames = int(event.get("frames", 0))
            on_start(frames, int(event.get("offered", frames)))
        elif event.get("event") == "progress" and progress is not None:
            progress(int(event.get("frames", 0)), int(event.get("tokens", 0)))

    from mmkv_cli.backbones.spec import default_model

    load = LoadOptions(load.model or default_model(), load.device, load.dtype, load.layers)
    done = client.request(
        "encode",
        on_event,
        media=str(Path(media).absolute()),
        media_shown=media,
        output=str(Path(output).absolute()),
        output_shown=str(output),
        options=wire.encode_record(options),
        load=wire.load_record(load),
    )
    info = done.get("info") or {}
    with contextlib.suppress(KeyError, TypeError):
        info["path"] = (
            str(output) if Path(info["path"]) == Path(output).absolute() else info["path"]
        )
    return info
