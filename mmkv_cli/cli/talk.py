"""The CLI's conversational commands: chat and serve (registered on the app in cli.py)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

import typer

from mmkv_cli.cli.common import (
    DeviceOpt,
    DtypeOpt,
    PackModelOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    TopPOpt,
    load_options,
    model_names,
    run,
)
from mmkv_cli.cli.literal import plain
from mmkv_cli.cli.server import NoServerOpt, open_session
from mmkv_cli.core.errors import AddressError, UsageError
from mmkv_cli.core.options import AskOptions, Dtype, GenerationOptions, check_generation

# typed questions kept between chat sessions, as a shell keeps its commands
HISTORY = (
    Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "mmkv" / "history"
)
HISTORY_LINES = 1000


def chat(
    pack: str = typer.Argument(..., help="A .kvpack written by `mmkv encode`."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Longest answer, in tokens."),
    temperature: float = TemperatureOpt,
    top_p: float = TopPOpt,
    seed: int | None = SeedOpt,
    stop: list[str] | None = StopOpt,
    history: str = typer.Option(
        str(HISTORY),
        "--history",
        help="Where typed questions are kept between sessions ('' keeps none).",
    ),
    turns: int = typer.Option(
        8, "--turns", help="Earlier turns a follow-up sees (0: none).", min=0
    ),
    turn_tokens: int = typer.Option(
        2048, "--turn-tokens", help="At most this many tokens of earlier turns.", min=0
    ),
    model: str | None = PackModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    no_server: bool = NoServerOpt,
) -> None:
    """Ask a pack question after question; answers stream, follow-ups see earlier turns (/help)."""

    def body() -> None:
        from mmkv_cli.cli.chat import Chat, chat_loop
        from mmkv_cli.cli.display import err_console, show_retrieved
        from mmkv_cli.cli.log_lines import answer_broken, answer_end, answer_piece

        generation = GenerationOptions(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
        options = AskOptions(generation=generation, explain=True)  # /explain, any time
        check_generation(generation)  # before the model loads
        session = open_session(pack, load_options(model, device, dtype), no_server)
        interactive = sys.stdin.isatty()
        if interactive:
            err_console.print(
                f"[dim]{pack}: ask away; /help lists the commands, /quit or Ctrl-D leaves[/dim]"
            )

        def write(piece: str) -> None:  # -vv records wait for the answer's line to end
            answer_end() if piece == "\n" else answer_piece(piece)

        def note(line: str) -> None:
            answer_broken()  # a line of its own, after any answer cut short
            err_console.print(plain(line))

        chat = Chat(options, turns, turn_tokens)
        chat_loop(
            session,
            _typed_lines(history) if interactive else sys.stdin,
            chat,
            write,
            note,
            lambda answer: show_retrieved(answer.retrieved, answer.blocks_used, session.media_kind),
        )
        if chat.failed:  # as `ask` does: a script sees that some questions got no answer
            raise typer.Exit(1)

    run(body)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, handed to uvicorn: an unknown address or a
    taken port is refused here, in one line, before any work."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as err:
        why = err.strerror if isinstance(err, socket.gaierror) else "not a host name"
        raise AddressError(f"--host {host}: not an address of this machine ({why})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        what = "is taken" if err.errno == errno.EADDRINUSE else f"cannot be used ({err.strerror})"
        raise AddressError(f"{host}:{port} {what}: pick another --port or --host") from None
    return sock


def _log_access() -> None:
    """One line on stderr for each request, as web servers print them."""
    import logging

    from mmkv_cli.cli.log_lines import VisibleFormatter

    handler = logging.StreamHandler(sys.stderr)
    # a request's path and headers come from outside: their control characters shown escaped
    handler.setFormatter(VisibleFormatter("%(asctime)s %(message)s"))
    access = logging.getLogger("mmkv.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def _loopback(host: str) -> bool:
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None)
        )
    except (socket.gaierror, UnicodeError, ValueError):
        return False


def _typed_lines(history: str):
    """Lines typed at a terminal, with line editing and a history file (readline) where the
    platform has it. Ctrl-C at the prompt clears the line, as a shell's does; Ctrl-D leaves."""
    readline = None
    with contextlib.suppress(ImportError):
        import readline  # enables editing and history for input()
    if readline is not None and history:
        path = Path(history).expanduser()
        with contextlib.suppress(OSError):
            readline.read_history_file(path)
        readline.set_history_length(HISTORY_LINES)
    try:
        while True:
            try:
                yield input("> ")
            except KeyboardInterrupt:
                sys.stdout.write("\n")
            except EOFError:
                sys.stdout.write("\n")
                return
    finally:
        if readline is not None and history:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(path)


def serve(
    packs: str = typer.Option(
        ".",
        "--packs",
        help="The folder or bucket prefix (s3://b/packs/) whose *.kvpack files are served.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port.", min=0, max=65535),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="MMKV_API_KEY", help="Require 'Authorization: Bearer KEY'."
    ),
    queue: int = typer.Option(16, "--queue", help="Requests that may wait; more get 503.", min=1),
    models: int = typer.Option(2, "--models", help="Backbones kept loaded (LRU).", min=1),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Answer every pack with this model.", autocompletion=model_names
    ),
    cors: list[str] | None = typer.Option(
        None,
        "--cors",
        help="Let web pages from this origin call the API (repeatable; '*' for any).",
    ),
    preload: bool = typer.Option(
        False, "--preload", help="Load the model before answering anything, /health included."
    ),
    open_metrics: bool = typer.Option(
        False, "--open-metrics", help="Answer /metrics without the API key (for a scraper)."
    ),
    http: bool = typer.Option(
        True, "--http/--no-http", help="Answer HTTP; --no-http: the local channel alone."
    ),
    local: bool = typer.Option(
        True,
        "--local/--no-local",
        help="Also answer this user's mmkv commands on the local socket (see `mmkv ps`).",
    ),
    keep_alive: str = typer.Option(
        "-1",
        "--keep-alive",
        help="Leave after this long without a request (300, 5m, 1h; -1: never). With --no-http.",
    ),
    cache_gb: float | None = typer.Option(
        None,
        "--cache-gb",
        help="GiB of hot packs' KV kept in memory, least recently used out first (default: a "
        "quarter of RAM).",
    ),
    hot_on_device: bool = typer.Option(
        False,
        "--hot-on-device",
        help="Hold hot packs' KV on the GPU itself (under --cache-gb), not in pinned host memory.",
    ),
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
) -> None:
    """Serve packs over an OpenAI-compatible HTTP API, and keep models and packs warm for you.

    /v1/chat/completions answers the packs of --packs; this user's mmkv commands (ask, chat,
    encode) use the same warm models and hot packs over a private local socket (`mmkv ps`)."""

    def body() -> None:
        from mmkv_cli.core.config import seconds_of
        from mmkv_cli.serve.client import server_host
        from mmkv_cli.serve.place import check_socket_path, local_place
        from mmkv_cli.serve.warm import Warm

        idle = seconds_of(keep_alive, "--keep-alive")
        if cache_gb is not None and not cache_gb > 0:
            raise UsageError(f"--cache-gb must be above 0, not {cache_gb}")
        cache_bytes = None if cache_gb is None else int(cache_gb * (1 << 30))
        if not http:
            place = local_place(server_host())
            check_socket_path(place.socket)  # before the model side is imported
            warm = Warm(load_options(model, device, dtype), models, cache_bytes, hot_on_device)
            _serve_local(warm, place, idle, preload)
            return
        try:
            import uvicorn

            from mmkv_cli.serve.app import create_app
        except ImportError as err:
            raise UsageError(
                f"mmkv serve needs the serve extra: pip install 'mmkv[serve]' ({err.name})"
            ) from None
        from mmkv_cli.cli.display import err_console

        listening = listen(host, port)  # before any pack is read: a taken port is one line
        app = create_app(
            packs,
            load_options(model, device, dtype),
            api_key=api_key,
            models=models,
            queue=queue,
            cors=cors,
            open_metrics=open_metrics,
            warm=Warm(load_options(model, device, dtype), models, cache_bytes, hot_on_device),
        )
        if preload:  # before the port answers anything, and a model that cannot load is one line
            app.state.packs.on_model_thread(app.state.packs.preload)
        _log_access()
        beside = _local_beside(app.state.packs.warm) if local else None
        if beside is not None:  # its socket goes with the server, whatever ends it
            app.state.closing += [beside.stop, beside.close]
        count = len(app.state.packs.names())
        if not api_key and not _loopback(host):
            err_console.print(
                f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who can "
                "reach this port can read every pack here",
                highlight=False,
            )
        err_console.print(
            f"serving {count} packs from {packs} on http://{host}:{port}/v1", highlight=False
        )
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        server.run(sockets=[listening])

    run(body)


def _serve_local(warm, place, idle: float, preload: bool) -> None:
    """`serve --no-http`: the local channel alone (what a command starts with keep_alive set)."""
    from mmkv_cli.cli.display import err_console
    from mmkv_cli.serve.local import LocalServer

    server = LocalServer(warm, place, idle)
    server.bind()  # a second server racing this one leaves here, in one line
    # a TERM (kill, a service manager) ends it as `mmkv stop` does: its socket goes with it
    signal.signal(signal.SIGTERM, lambda signum, frame: server.stop())
    if preload:
        warm.on_model_thread(warm.preload)
    err_console.print(f"mmkv server on {server.place.socket} (pid {os.getpid()})", markup=False)
    try:
        server.serve()
    finally:
        warm.close()


def _local_beside(warm):
    """The local channel beside HTTP, or None when another server owns it (a note says so)."""
    from mmkv_cli.cli.display import err_console
    from mmkv_cli.serve.client import server_host
    from mmkv_cli.serve.local import start_beside
    from mmkv_cli.serve.place import local_place

    place = local_place(server_host())
    beside = start_beside(warm, place)
    if beside is None:
        err_console.print(
            f"note: another mmkv server answers on {place.socket}; this one serves HTTP only",
            markup=False,
        )
    return beside
