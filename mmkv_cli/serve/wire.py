"""What the local channel carries: one JSON object a line, each way, and the records it turns into.

A request is `{"op": ..., ...}`; the server answers with events (`{"event": "token", "text": ...}`,
`{"event": "progress", ...}`) and ends each request with exactly one `{"event": "done", ...}` or
`{"event": "error", "message": ..., "exit_code": ...}`. A line is bounded each way: a peer that
sends more is cut off, not buffered without end. No torch here: the client imports it.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, fields
from typing import Any

from mmkv_cli.core import errors
from mmkv_cli.core.errors import MmkvError
from mmkv_cli.core.options import (
    AskOptions,
    EncodeOptions,
    GenerationOptions,
    LoadOptions,
    MethodSpec,
    Positions,
)

MAX_LINE = 16 << 20  # a request or an event: questions are bounded far below this
# the classes an error event may name: the client raises the one the in-process path would
_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.MmkvError,
        errors.UsageError,
        errors.MediaError,
        errors.PackError,
        errors.ModelError,
        errors.OutputExistsError,
        errors.StorageError,
        errors.AddressError,
        errors.SetupError,
    )
}


class ChannelClosed(Exception):
    """The peer closed the channel (or it broke) before a whole line came."""


class Channel:
    """One connection's two directions: send a dict, receive the next dict."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb")

    def send(self, message: dict) -> None:
        data = (json.dumps(message, default=str, separators=(",", ":")) + "\n").encode()
        try:
            self.sock.sendall(data)
        except OSError as err:
            raise ChannelClosed(str(err)) from None

    def receive(self) -> dict:
        try:
            line = self._reader.readline(MAX_LINE + 1)
        except OSError as err:
            raise ChannelClosed(str(err)) from None
        if not line.endswith(b"\n"):
            raise ChannelClosed("over the line limit" if len(line) > MAX_LINE else "closed")
        try:
            message = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise ChannelClosed("not JSON") from None
        if not isinstance(message, dict):
            raise ChannelClosed("not a JSON object")
        return message

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self.sock.close()


def error_event(err: MmkvError, message: str | None = None) -> dict:
    return {
        "event": "error",
        "kind": type(err).__name__,
        "message": message if message is not None else str(err),
        "exit_code": err.exit_code,
    }


def raised(event: dict) -> MmkvError:
    """An error event as the exception the in-process path raises (same class, line and code)."""
    cls = _ERRORS.get(str(event.get("kind")), MmkvError)
    err = cls(str(event.get("message", "the server failed")))
    code = event.get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256:
        err.exit_code = code
    return err


def load_record(load: LoadOptions) -> dict:
    return asdict(load)


def load_from(record: Any) -> LoadOptions:
    return LoadOptions(**_known(LoadOptions, record))


def ask_record(options: AskOptions) -> dict:
    record = asdict(options)
    record["positions"] = options.positions.value if options.positions else None
    record.pop("keep_logits")  # logits stay in the process that made them
    return record


def ask_from(record: Any) -> AskOptions:
    values = _known(AskOptions, record)
    generation = _known(GenerationOptions, values.pop("generation", {}))
    generation["stop"] = tuple(generation.get("stop") or ())
    positions = values.pop("positions", None)
    history = tuple((str(q), str(a)) for q, a in values.pop("history", ()) or ())
    return AskOptions(
        **values,
        positions=Positions(positions) if positions else None,
        generation=GenerationOptions(**generation),
        history=history,
    )


def encode_record(options: EncodeOptions) -> dict:
    record = asdict(options)
    if isinstance(options.method, MethodSpec):
        record["method"] = {"name": options.method.name, "params": dict(options.method.params)}
    return record


def encode_from(record: Any) -> EncodeOptions:
    values = _known(EncodeOptions, record)
    method = values.get("method")
    if isinstance(method, dict):
        values["method"] = MethodSpec(str(method.get("name")), dict(method.get("params") or {}))
    return EncodeOptions(**values)


def answer_record(answer) -> dict:
    """An Answer as the channel carries it (its logits stay behind)."""
    return {f.name: getattr(answer, f.name) for f in fields(answer) if f.name != "first_logits"}


def answer_from(record: dict):
    from mmkv_cli.ask.result import Answer

    return Answer(**_known(Answer, record))


def _known(cls, record: Any) -> dict:
    """The fields of dataclass `cls` that `record` sets (a request from an older or newer client
    may carry others)."""
    if not isinstance(record, dict):
        raise MmkvError(f"the request's {cls.__name__} is not an object")
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in record.items() if key in names}
