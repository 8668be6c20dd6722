"""The server's error bodies: OpenAI's shape, with the same one line the CLI would print."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from mmkv_cli.core.errors import ModelError, OutputExistsError, PackError, UsageError

# a name a stream or a pack already holds: 409
STATUS = {UsageError: 400, OutputExistsError: 409, PackError: 422, ModelError: 503}


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers=None,
    *,
    param: str | None = None,
    code: str | None = None,
):
    """OpenAI's error body: message, type, the request field at fault (`param`) and a short code
    where one says more than the status (`invalid_api_key`, `model_not_found`), else null."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def chunk_event(
    ident: str, created: int, model: str, delta: dict, finish: str | None, extra: dict | None
) -> str:
    """One server-sent event of a streamed chat completion (OpenAI's chunk object)."""
    data = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if extra is not None:
        data["mmkv"] = extra
    return f"data: {json.dumps(data)}\n\n"


def usage_event(ident: str, created: int, model: str, usage: dict) -> str:
    """The last chunk of a stream asked for with stream_options.include_usage: no choices, the
    usage."""
    data = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return f"data: {json.dumps(data)}\n\n"
