"""POST /v1/chat/completions: a question to a pack (or a running stream) by name, answered whole
or streamed as server-sent events (OpenAI's shapes); a client that leaves ends the generation."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import replace

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.options import AskOptions
from mmkv_cli.serve.metrics import Metrics
from mmkv_cli.serve.packs import Busy, Packs, busy_response
from mmkv_cli.serve.requests import ChatRequest
from mmkv_cli.serve.responses import STATUS, chunk_event, usage_event
from mmkv_cli.serve.responses import error as _error
from mmkv_cli.serve.stream_routes import stream_answer
from mmkv_cli.serve.streams import Streams


def chat_route(app: FastAPI, packs: Packs, streams: Streams, metrics: Metrics) -> None:
    """A question to a pack (or a running stream) by name, answered whole or streamed."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        if streams.live(body.model):
            return await stream_answer(streams, body)
        try:
            packs.path(body.model)
            question, turns = body.conversation()
        except LookupError as err:
            return _error(404, str(err), "not_found_error", param="model", code="model_not_found")
        except UsageError as err:
            return _error(400, str(err))
        options = replace(body.options(), history=turns)
        created, ident = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return await _stream(packs, body, question, options, created, ident, metrics)
        try:
            answer = await packs.run(lambda: packs.ask(body.model, question, options))
            metrics.ttft.observe(answer.ttft_s)
        except Busy:
            return busy_response()
        except MmkvError as err:
            return _error(STATUS.get(type(err), 400), packs.shelf.hide(str(err)))
        return _completion(body, answer, created, ident)


def _finish(body: ChatRequest, answer) -> str:
    limit = body.options().generation.max_new_tokens
    return "length" if len(answer.token_ids) >= limit else "stop"


def _extra(body: ChatRequest, answer) -> dict:
    extra = {"ttft_s": answer.ttft_s, "blocks": len(answer.blocks_used)}
    if body.explain:
        extra["retrieved"] = answer.retrieved
    return extra


def _completion(body: ChatRequest, answer, created: int, ident: str) -> dict:
    return {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer.answer},
                "finish_reason": _finish(body, answer),
            }
        ],
        "usage": _usage(answer),
        "mmkv": _extra(body, answer),
    }


def _usage(answer) -> dict:
    return {
        "prompt_tokens": answer.context_tokens,
        "completion_tokens": len(answer.token_ids),
        "total_tokens": answer.context_tokens + len(answer.token_ids),
    }


class _Gone(Exception):
    """The client left: stop generating."""


async def _stream(
    packs: Packs,
    body: ChatRequest,
    question: str,
    options: AskOptions,
    created: int,
    ident: str,
    metrics: Metrics,
):
    """SSE chunks as tokens come from the model thread; a client that leaves ends the generation."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def on_token(piece: str) -> None:
        if gone.is_set():
            raise _Gone
        loop.call_soon_threadsafe(pieces.put_nowait, ("piece", piece))

    def job():
        return packs.ask(body.model, question, options, on_token)

    def chunk(delta: dict, finish: str | None = None, extra: dict | None = None) -> str:
        return chunk_event(ident, created, body.model, delta, finish, extra)

    try:
        task = asyncio.ensure_future(packs.run(job))
        await asyncio.sleep(0)  # let run() refuse at once when the line is full
        if task.done() and isinstance(task.exception(), Busy):
            raise Busy
    except Busy:
        return busy_response()
    task.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, ("done", None)))

    async def events():
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, piece = await pieces.get()
                if kind == "done":
                    break
                yield chunk({"content": piece})
            error = task.exception()
            if error is not None:
                message = (
                    packs.shelf.hide(str(error))
                    if isinstance(error, MmkvError)
                    else "internal error"
                )
                yield f"data: {json.dumps({'error': {'message': message}})}\n\n"
            else:
                answer = task.result()
                metrics.ttft.observe(answer.ttft_s)
                yield chunk({}, _finish(body, answer), _extra(body, answer))
                if body.include_usage():
                    yield usage_event(ident, created, body.model, _usage(answer))
            yield "data: [DONE]\n\n"
        finally:
            gone.set()

    return StreamingResponse(events(), media_type="text/event-stream")
