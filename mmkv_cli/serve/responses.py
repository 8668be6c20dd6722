"""The server's error bodies: OpenAI's shape, with the same one line the CLI would print."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from mmkv_cli.errors import ModelError, PackError, UsageError

STATUS = {UsageError: 400, PackError: 422, ModelError: 503}


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)
