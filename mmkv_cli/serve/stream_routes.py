"""The routes of live streams (`/v1/streams`), and a chat completion answered by a running one."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.serve.requests import ChatRequest
from mmkv_cli.serve.responses import STATUS, chunk_event
from mmkv_cli.serve.responses import error as _error
from mmkv_cli.serve.streams import StreamRequest, Streams


def stream_routes(app: FastAPI, streams: Streams) -> None:
    """Live streams: start, list, show, stop (the pack stays)."""

    @app.post("/v1/streams", status_code=201)
    async def start_stream(body: StreamRequest):
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, streams.start, body)
        except MmkvError as err:
            return _error(STATUS.get(type(err), 400), str(err))

    @app.get("/v1/streams")
    async def list_streams():
        return {"object": "list", "data": [h.state() for h in streams.hosted.values()]}

    @app.get("/v1/streams/{name}")
    async def show_stream(name: str):
        try:
            return streams.get(name).state()
        except LookupError as err:
            return _error(404, str(err), "not_found_error")

    @app.delete("/v1/streams/{name}")
    async def stop_stream(name: str):
        try:
            streams.get(name)
        except LookupError as err:
            return _error(404, str(err), "not_found_error")
        return await asyncio.get_running_loop().run_in_executor(None, streams.stop, name)


async def stream_answer(streams: Streams, body: ChatRequest):
    """A running stream's answer, from its memory when the question is taken (no earlier turns:
    the memory is the conversation's context)."""
    try:
        question, _ = body.conversation()
        options = body.options()
        record = await streams.ask(body.model, question, options.generation.max_new_tokens)
    except LookupError as err:
        return _error(404, str(err), "not_found_error")
    except UsageError as err:
        return _error(400, str(err))
    except TimeoutError:
        return _error(504, "the stream did not answer in time", "server_error")
    if "error" in record:
        return _error(422, record["error"])
    created, ident = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
    made = record["completion_tokens"]
    limit = options.generation.max_new_tokens
    extra = {"ttft_s": record["ttft_s"], "moment": record["moment"], "behind_s": record["behind_s"]}
    message = {"role": "assistant", "content": record["answer"]}
    finish = "length" if made >= limit else "stop"
    if body.stream:  # the whole answer as one chunk: the memory is cut before decoding starts

        async def events():
            role, content = {"role": "assistant", "content": ""}, {"content": record["answer"]}
            for delta, done, more in (
                (role, None, None),
                (content, None, None),
                ({}, finish, extra),
            ):
                yield chunk_event(ident, created, body.model, delta, done, more)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    return {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": record["context_tokens"],
            "completion_tokens": made,
            "total_tokens": record["context_tokens"] + made,
        },
        "mmkv": extra,
    }
