"""The local channel: a warm server's Unix socket, private to its user, that `mmkv ask`, `chat`,
`encode`, `ps` and `stop` (and `import mmkv`) talk to instead of loading a model themselves.

One server owns a socket: it takes the lock beside it first (a second server starting at the same
moment finds it taken and leaves the socket to the first). The socket is made 0600 under another
name and renamed into place, in a 0700 folder, and every connection's peer is checked
(SO_PEERCRED): only this user's processes are answered. Over this channel a client names packs and
media by their paths (it could read them itself); HTTP keeps its own rule (--packs only).

A server started by a client (`keep_alive` in the config) leaves after that long without a request,
as ollama's does; one started by hand stays until `mmkv stop`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
import time
from dataclasses import replace

from mmkv_cli import __version__
from mmkv_cli.core import logs
from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.serve import wire
from mmkv_cli.serve.place import Place, check_socket_path, private_folder
from mmkv_cli.serve.warm import Warm

LOG = logs.get(__name__)
_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid


class AlreadyServing(MmkvError):
    """Another server holds this place's lock."""


class LocalServer:
    def __init__(self, warm: Warm, place: Place, keep_alive: float = -1.0):
        self.warm, self.place, self.keep_alive = warm, place, keep_alive
        self.started = time.time()
        self.stopping = threading.Event()
        self.active = 0  # connections open now (a connected client keeps the server)
        self.count_lock = threading.Lock()
        self._lock_file = None
        self._sock: socket.socket | None = None
        self._identity: tuple | None = None

    def bind(self) -> None:
        """Take the place: its lock, then its socket (0600, renamed into its 0700 folder)."""
        check_socket_path(self.place.socket)
        private_folder(self.place.folder, create=True)
        lock = open(self.place.lock, "a+")  # noqa: SIM115 (held for the server's life)
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise AlreadyServing(f"a server already answers on {self.place.socket}") from None
        self._lock_file = lock
        fresh = self.place.socket.with_name(f".{self.place.socket.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)
        try:
            sock.bind(str(fresh))
        finally:
            os.umask(old_mask)
        os.chmod(fresh, 0o600)
        sock.listen(64)
        os.replace(fresh, self.place.socket)  # a socket left by a dead server is replaced
        info = os.stat(self.place.socket)
        self._identity = (info.st_dev, info.st_ino)
        self._sock = sock
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()

    def serve(self) -> None:
        """Accept connections until stopped, or idle past keep_alive (a thread per client)."""
        assert self._sock is not None
        self._sock.settimeout(0.2)
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    if self._idle_out():
                        break
                    continue
                except OSError:
                    if self.stopping.is_set():
                        break
                    raise
                conn.settimeout(None)
                threading.Thread(target=self._client, args=(conn,), daemon=True).start()
        finally:
            self.close()

    def _idle_out(self) -> bool:
        if self.keep_alive < 0 or self.active:
            return False
        return time.monotonic() - self.warm.last_used > self.keep_alive

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        """Let go of the socket (only if it is still ours) and the lock."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                info = os.stat(self.place.socket)
                if (info.st_dev, info.st_ino) == self._identity:
                    self.place.socket.unlink()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _client(self, conn: socket.socket) -> None:
        channel = wire.Channel(conn)
        with self.count_lock:
            self.active += 1
        try:
            peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size)
            _, uid, _ = _PEER.unpack(peer)
            if uid != os.getuid():
                LOG.warning("refused a connection from uid %d", uid)
                channel.send(wire.error_event(UsageError("this server answers its own user only")))
                return
            while not self.stopping.is_set():
                request = channel.receive()
                self.warm.last_used = time.monotonic()
                self._answer(channel, request)
        except wire.ChannelClosed:
            pass  # the client left (or its line broke): its question, if any, was stopped
        finally:
            with self.count_lock:
                self.active -= 1
            self.warm.last_used = time.monotonic()
            channel.close()

    def _answer(self, channel: wire.Channel, request: dict) -> None:
        op = request.get("op")
        handler = self._handlers().get(str(op))
        shown = {}
        for key in ("pack", "media", "output"):
            if isinstance(request.get(key), str) and isinstance(request.get(f"{key}_shown"), str):
                shown[request[key]] = request[f"{key}_shown"]
        try:
            if handler is None:
                raise UsageError(f"this server (mmkv {__version__}) has no request '{op}'")
            done = handler(channel, request)
        except wire.ChannelClosed:
            raise
        except MmkvError as err:
            channel.send(wire.error_event(err, _as_shown(str(err), shown)))
            return
        except Exception as err:  # a bug: one line, the server stays up
            LOG.exception("request %s failed", op)
            first = str(err).splitlines()[0] if str(err) else ""
            internal = MmkvError(
                f"internal error: {type(err).__name__}: {_as_shown(first, shown)} "
                "(run with MMKV_DEBUG=1 for a traceback)"
            )
            internal.exit_code = 70
            channel.send(wire.error_event(internal))
            return
        channel.send({"event": "done", **done})
        if op == "stop":
            self.stop()

    def _handlers(self) -> dict:
        return {
            "ping": self._ping,
            "open": self._open,
            "ask": self._ask,
            "turn_tokens": self._turn_tokens,
            "encode": self._encode,
            "ps": self._ps,
            "stop": self._ping,
        }

    def _ping(self, channel, request) -> dict:
        return {"version": __version__, "pid": os.getpid()}

    def _session(self, request: dict):
        pack = _text(request, "pack")
        return self.warm.session(pack, wire.load_from(request.get("load", {})))

    def _open(self, channel, request) -> dict:
        session = self.warm.on_model_thread(lambda: self._session(request))
        return {"media_kind": session.media_kind}

    def _turn_tokens(self, channel, request) -> dict:
        turns = tuple((str(q), str(a)) for q, a in request.get("turns") or ())
        count = self.warm.on_model_thread(lambda: self._session(request).turn_tokens(turns))
        return {"tokens": count}

    def _ask(self, channel, request) -> dict:
        question = _text(request, "question")
        options = wire.ask_from(request.get("options", {}))

        def on_token(piece: str) -> None:
            channel.send({"event": "token", "text": piece})

        def job():
            session = self._session(request)
            streamed = on_token if request.get("stream") else None
            return self.warm.ask(session, question, options, streamed)

        return {"answer": wire.answer_record(self.warm.on_model_thread(job))}

    def _encode(self, channel, request) -> dict:
        from mmkv_cli import api
        from mmkv_cli.backbones.spec import check_available, default_model

        media, output = _text(request, "media"), _text(request, "output")
        options = wire.encode_from(request.get("options", {}))
        load = wire.load_from(request.get("load", {}))
        load = replace(load, model=load.model or default_model())
        check_available(load.model)

        def on_start(frames: int, offered: int) -> None:
            channel.send({"event": "start", "frames": frames, "offered": offered})

        def progress(frames: int, tokens: int) -> None:
            channel.send({"event": "progress", "frames": frames, "tokens": tokens})

        def job():
            backbone = self.warm.backbone(load)
            return api.encode(
                media, output, options, backbone=backbone, progress=progress, on_start=on_start,
                shown_as=request.get("media_shown"),
            )  # fmt: skip

        return {"info": self.warm.on_model_thread(job)}

    def _ps(self, channel, request) -> dict:
        return {
            "pid": os.getpid(),
            "version": __version__,
            "socket": str(self.place.socket),
            "since": self.started,
            "keep_alive_s": self.keep_alive,
            "idle_s": round(time.monotonic() - self.warm.last_used, 3),
            "cache_bytes": self.warm.hot.cap,
            "hot_bytes": self.warm.hot.held(),
            "models": self.warm.models(),
            "packs": self.warm.hot.listing(),
        }


def _text(request: dict, key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str):
        raise UsageError(f"the request names no {key}")
    return value


def _as_shown(text: str, shown: dict[str, str]) -> str:
    """An error's text with the server's absolute paths put back as the client typed them."""
    for path, given in sorted(shown.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, given)
    return text


def start_beside(warm: Warm, place: Place) -> LocalServer | None:
    """The local channel on a thread beside HTTP (`mmkv serve`), sharing its warm models and hot
    packs; None when another server already owns the place."""
    server = LocalServer(warm, place)
    try:
        server.bind()
    except AlreadyServing:
        return None
    threading.Thread(target=server.serve, name="mmkv-local", daemon=True).start()
    return server
