"""`mmkv serve`: packs answered over HTTP, OpenAI-compatible (FastAPI + uvicorn, `mmkv[serve]`).

`model` in a request names a pack under `--packs`. Backbones stay loaded (a small LRU by the model a
pack names) and pack readers stay open, so a request costs the answer, not the load. Model calls run
one at a time on one worker thread (a device does one forward at a time anyway); a bounded count of
waiting requests answers 503 with Retry-After instead of queueing without limit. Every error is a
JSON body with the same one line the CLI would print.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.options import AskOptions, LoadOptions
from mmkv_cli.pack import inspect, is_url
from mmkv_cli.serve.metrics import Metrics
from mmkv_cli.serve.pack_routes import pack_routes
from mmkv_cli.serve.requests import ChatRequest
from mmkv_cli.serve.responses import STATUS, chunk_event, usage_event
from mmkv_cli.serve.responses import error as _error
from mmkv_cli.serve.shelf import FolderShelf, Shelf, shelf
from mmkv_cli.serve.stream_routes import stream_answer, stream_routes
from mmkv_cli.serve.streams import Streams
from mmkv_cli.serve.warm import Warm

MAX_BODY_BYTES = 1 << 20  # a chat request is text: 1 MiB is generous
# what a probe or a scraper reads without the API key: nothing about any pack
# answered without the API key: probes and what a client checks before it has one
OPEN_ROUTES = ("/health", "/version")
ACCESS = logging.getLogger("mmkv.access")  # one line a request; `mmkv serve` prints it to stderr


class Busy(Exception):
    """The waiting line is full."""


class Packs:
    """Packs by name on the shelf, answered by what the server keeps warm (serve/warm.py): every
    model call on its one thread, a bounded line of requests waiting for it."""

    def __init__(
        self,
        shelf: Shelf,
        load: LoadOptions,
        models: int = 2,
        queue: int = 16,
        warm: Warm | None = None,
    ):
        self.shelf = shelf
        self.load = load
        self.warm = warm or Warm(load, models)
        self.worker = self.warm.worker
        self.limit = max(1, queue)
        self.pending = 0
        self.lock = threading.Lock()

    @property
    def backbones(self):
        return self.warm.backbones

    def path(self, name: str) -> str | Path:
        """The pack `name` on the shelf (LookupError when there is none)."""
        return self.shelf.locate(name)[0]

    def names(self) -> list[str]:
        return self.shelf.names()

    async def run(self, job):
        """Run `job` on the model thread, or refuse at once when the line is full."""
        with self.lock:
            if self.pending >= self.limit:
                raise Busy
            self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, job)
        finally:
            with self.lock:
                self.pending -= 1

    def on_model_thread(self, job):
        """`job` run on the model thread, waited for (a stream's frames and answers take turns
        there with the chats; the waiting line's limit is for requests, not streams)."""
        return self.warm.on_model_thread(job)

    def ask(self, name: str, question: str, options: AskOptions, on_token=None):
        """Pack `name` asked (model thread only), from its hot copy while the file is unchanged."""
        path, key = self.shelf.locate(name)
        session = self.warm.session(path, self.load, key if is_url(path) else None)
        return self.warm.ask(session, question, options, on_token)

    def backbone(self, load: LoadOptions):
        return self.warm.backbone(load)

    def preload(self) -> None:
        """The server's model (`--model`), else the ones its packs name, the most named first
        (as many as it keeps), else the default: what the first question would load."""
        if self.load.model is not None:
            self.warm.preload()
            return
        for model in self.models_named()[: self.warm.backbones.capacity] or [None]:
            self.warm.preload(replace(self.load, model=model))

    def models_named(self) -> list[str]:
        """The models the packs name (the first PRELOAD_SCAN headers read), the most named first."""
        named: dict[str, int] = {}
        for name in self.names()[:PRELOAD_SCAN]:
            try:
                model = inspect(self.path(name))["model"]
            except (MmkvError, LookupError):  # a bad pack is refused when it is asked
                continue
            named[model] = named.get(model, 0) + 1
        return sorted(named, key=lambda m: -named[m])

    def usual_model(self) -> str | None:
        """What a request naming no model runs: the server's --model, else the model its packs
        name most, else None (the default model)."""
        return self.load.model or next(iter(self.models_named()), None)


PRELOAD_SCAN = 64  # packs whose header `--preload` reads for the models they name


def _busy():
    """503 with Retry-After: the line of waiting requests is full."""
    return _error(
        503, "busy: too many requests waiting, retry shortly", "server_error", {"Retry-After": "1"}
    )


def create_app(
    folder: str | Path,
    load: LoadOptions | None = None,
    *,
    api_key: str | None = None,
    models: int = 2,
    queue: int = 16,
    cors: list[str] | None = None,
    preload: bool = False,
    open_metrics: bool = False,
    warm: Warm | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over the packs in `folder`: guards, error bodies, routes, and
    for browsers the origins in `cors` (`*`: any). preload: load the model (`load`'s, else the
    default) before the server answers anything, `/health` included. open_metrics: /metrics
    answers without the key (it tells request counts, latencies and load, so it needs the key by
    default). warm: the models and hot packs kept (default: `load`'s, `models` of them)."""
    load = load or LoadOptions()
    packs = Packs(shelf(folder), load, models, queue, warm or Warm(load, models))
    metrics = Metrics(lambda: packs.pending, lambda: len(packs.backbones))
    local = packs.shelf.folder if isinstance(packs.shelf, FolderShelf) else None
    streams = Streams(local, packs.load, packs.backbone, packs.on_model_thread, packs.usual_model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if preload:  # the server takes no request, /health included, until the model is in
            await asyncio.get_running_loop().run_in_executor(packs.worker, packs.preload)
        yield
        await asyncio.get_running_loop().run_in_executor(None, streams.stop_all)  # packs kept
        for close in app.state.closing:  # what runs beside the app (the local channel)
            close()

    app = FastAPI(title="mmkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.packs, app.state.streams, app.state.metrics = packs, streams, metrics
    app.state.closing = []  # called at shutdown, before uvicorn hands the signal on
    _guard(app, api_key, metrics, OPEN_ROUTES + (("/metrics",) if open_metrics else ()))
    if cors:  # added last, so it runs first: a preflight carries no key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"]
        )
    _error_bodies(app)
    pack_routes(app, packs, streams, metrics)
    stream_routes(app, streams)
    _chat_route(app, packs, streams, metrics)
    return app


def _guard(app: FastAPI, api_key: str | None, metrics: Metrics, open_routes: tuple) -> None:
    """Every request: counted, timed and logged (one access line), a bounded body of a declared
    length, and the API key where one is set (on every route but `open_routes`)."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        began = time.perf_counter()
        response = await _guarded(request, call_next)
        seconds = time.perf_counter() - began
        route = request.scope.get("route")
        metrics.observe(route.path if route else "unmatched", response.status_code, seconds)
        client = request.client.host if request.client else "-"
        ACCESS.info(
            '%s "%s %s" %d %.3fs',
            client,
            request.method,
            request.url.path,
            response.status_code,
            seconds,
        )
        return response

    async def _guarded(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.method == "POST" and length is None:
            return _error(411, "a request body needs a Content-Length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        if api_key and request.url.path not in open_routes:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(
                    401,
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    "authentication_error",
                    code="invalid_api_key",
                )
        return await call_next(request)


def _error_bodies(app: FastAPI) -> None:
    """A bad body and an internal fault answer in OpenAI's error shape, in one line."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return _error(400, message if not where else f"{where}: {message}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return _error(
            err.status_code,
            message,
            "not_found_error" if err.status_code == 404 else "invalid_request_error",
            err.headers,
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception):
        first = str(err).splitlines()[0] if str(err) else ""
        return _error(500, f"internal error: {type(err).__name__}: {first}", "server_error")


def _chat_route(app: FastAPI, packs: Packs, streams: Streams, metrics: Metrics) -> None:
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
            return _busy()
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
        return _busy()
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
