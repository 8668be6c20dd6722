"""`mmkv ps` and `mmkv stop`: what the warm local server holds, and ending it."""

from __future__ import annotations

import typer

from mmkv_cli.cli.common import JsonOpt, emit_json, run
from mmkv_cli.core.errors import MmkvError

NoServerOpt = typer.Option(
    False,
    "--no-server",
    help="Run here even when a warm mmkv server runs (it is used by default: `mmkv ps`).",
)


class NoServer(MmkvError):
    """`ps` or `stop` with no server to ask."""

    exit_code = 1


def _request(op: str) -> dict | None:
    """A running server's answer to `op`, or None when none runs (none is started for it)."""
    from mmkv_cli.serve.client import warm_client

    client = warm_client(start=False)
    if client is None:
        return None
    try:
        return client.request(op)
    finally:
        client.close()


def _asked(op: str) -> dict:
    """The running server's answer to `op` (one line and exit 1 when none runs)."""
    from mmkv_cli.serve.client import server_host
    from mmkv_cli.serve.place import local_place

    done = _request(op)
    if done is None:
        raise NoServer(f"no mmkv server runs (none at {local_place(server_host()).socket})")
    return done


def ps(as_json: bool = JsonOpt) -> None:
    """Show the warm server: its loaded models and hot packs, with their memory."""

    def body() -> None:
        from mmkv_cli.cli.display import show_server

        state = _asked("ps")
        state.pop("event", None)
        emit_json(state) if as_json else show_server(state)

    run(body)


def stop(as_json: bool = JsonOpt) -> None:
    """Stop the warm server (its models and hot packs are let go)."""

    def body() -> None:
        from mmkv_cli.cli.display import out_console

        done = _asked("stop")
        if as_json:
            emit_json({"stopped": True, "pid": done.get("pid")})
        else:
            out_console.print(f"stopped the mmkv server (pid {done.get('pid')})", markup=False)

    run(body)


def _own_presets() -> bool:
    """Whether this command sees presets of the user's own, which a server started elsewhere may
    not: such a command runs here."""
    from mmkv_cli.core import logs
    from mmkv_cli.presets import user_folders

    if user_folders():
        logs.get(__name__).info("your own presets are in effect: running here, not in the server")
        return True
    return False


def open_session(pack: str, load, no_server: bool):
    """The pack opened for questions: in the warm server when one runs (or keep_alive starts
    one), else here. Either answers as `api.PackSession` does."""
    from mmkv_cli.pack import is_url
    from mmkv_cli.serve.client import RemoteSession, clear_status, status, warm_client

    # a pack on object storage is read here, with this command's credentials
    client = None if is_url(pack) else warm_client(no_server or _own_presets())
    if client is not None:
        return RemoteSession(client, pack, load)
    from mmkv_cli import api  # the model side: not a client's import

    status("loading the model ...")
    try:
        return api.PackSession(pack, load=load)
    finally:
        clear_status()


def encoder(media: str, output: str, options, load, no_server: bool):
    """How this encode runs: a function of (progress, on_start) giving the summary, in the warm
    server when one runs and both ends are local files, else here."""
    from mmkv_cli import api
    from mmkv_cli.pack import is_url
    from mmkv_cli.serve.client import clear_status, remote_encode, status, warm_client

    remote = is_url(media) or is_url(output)
    client = None if remote else warm_client(no_server or _own_presets())
    if client is None:

        def here(on_start=None, **hooks):
            def started(frames: int, offered: int) -> None:
                clear_status()
                if on_start is not None:
                    on_start(frames, offered)

            status("loading the model and the media ...")
            try:
                return api.encode(media, output, options, load=load, on_start=started, **hooks)
            finally:
                clear_status()

        return here
    api.check_encode(media, output, options)  # refused here, in one line, before the server

    def remote(**hooks):
        try:
            return remote_encode(client, media, output, options, load, **hooks)
        finally:
            client.close()

    return remote


def hot_state(pack: str) -> dict | None:
    """What a running warm server holds of `pack` ({bytes, spans, questions}), or None (no server
    runs, or the pack is not hot there). Never starts a server."""
    import contextlib
    import os
    from pathlib import Path

    from mmkv_cli.pack import is_url

    if is_url(pack):
        return None
    with contextlib.suppress(MmkvError):
        state = _request("ps")
        if state is None:
            return None
        here = {os.path.realpath(pack), str(Path(pack).absolute())}
        for row in state.get("packs", []):
            if row.get("path") in here or os.path.realpath(str(row.get("path"))) in here:
                return {k: row[k] for k in ("bytes", "spans", "questions") if k in row}
    return None
