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
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmkv_cli.core.options import LoadOptions
from mmkv_cli.serve.chat_routes import chat_route
from mmkv_cli.serve.metrics import Metrics
from mmkv_cli.serve.pack_routes import pack_routes
from mmkv_cli.serve.packs import Packs
from mmkv_cli.serve.responses import error as _error
from mmkv_cli.serve.shelf import FolderShelf, shelf
from mmkv_cli.serve.stream_routes import stream_routes
from mmkv_cli.serve.streams import Streams
from mmkv_cli.serve.warm import Warm

MAX_BODY_BYTES = 1 << 20  # a chat request is text: 1 MiB is generous
# what a probe or a scraper reads without the API key: nothing about any pack
# answered without the API key: probes and what a client checks before it has one
OPEN_ROUTES = ("/health", "/version")
ACCESS = logging.getLogger("mmkv.access")  # one line a request; `mmkv serve` prints it to stderr


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
    chat_route(app, packs, streams, metrics)
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
