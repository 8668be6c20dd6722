"""The routes about packs rather than answers: health, the packs as OpenAI models (listed, or one by
id), one pack's inspect view, and the Prometheus metrics."""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePosixPath

from fastapi import FastAPI
from fastapi.responses import Response

from mmkv_cli.core.errors import MmkvError
from mmkv_cli.serve.responses import STATUS
from mmkv_cli.serve.responses import error as _error

SUMMARY = ("model", "method", "budget", "visual_tokens_total", "visual_kv_share", "blocks", "bytes")


def pack_routes(app: FastAPI, packs, streams, metrics) -> None:
    """packs: the app's Packs; streams: its Streams; metrics: its Metrics."""

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "packs": len(packs.names()),
            "models_loaded": [load.model for load in packs.backbones],
        }

    @app.get("/version")
    async def version():
        """What answers here: mmkv's version and the pack format it writes and reads."""
        from mmkv_cli import __version__
        from mmkv_cli.pack import FORMAT_VERSION, READABLE_VERSIONS

        return {
            "mmkv": __version__,
            "format_version": FORMAT_VERSION,
            "reads_format_versions": list(READABLE_VERSIONS),
        }

    @app.get("/v1/models")
    async def list_models():
        """The running streams (a chat asks them by name, as a pack), then the packs."""
        running = {hosted.request.name: hosted for hosted in streams.running()}
        data, unreadable = [_stream_model(hosted) for hosted in running.values()], []
        for name in packs.names():
            if name in running:  # its snapshot: the stream answers by that name while it runs
                continue
            found = _model(packs, name)
            if "error" in found:
                unreadable.append({"id": name, "error": found["error"]})
            else:
                data.append(found)
        return {"object": "list", "data": data, "unreadable": unreadable}

    @app.get("/v1/models/{name}")
    async def one_model(name: str):
        found = _model(packs, name)
        if "status" in found:
            return _error(found["status"], found["error"], found["kind"])
        return found

    @app.get("/v1/packs/{name}")
    async def pack_info(name: str):
        from mmkv_cli.api import inspect

        try:
            info = inspect(packs.path(name))
        except LookupError as err:
            return _error(404, str(err), "not_found_error")
        except MmkvError as err:
            return _error(STATUS.get(type(err), 400), packs.shelf.hide(str(err)))
        return {**info, "path": packs.shelf.hide(info["path"]), "media": _media(info["media"])}

    @app.get("/metrics")
    async def scrape():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model(packs, name: str) -> dict:
    """Pack `name` as an OpenAI model object, or {"error", "status", "kind"} when it cannot be
    read (the reason in the CLI's words, the server's paths taken out)."""
    from mmkv_cli.api import inspect

    try:
        info = inspect(packs.path(name))
    except LookupError as err:
        return {"error": str(err), "status": 404, "kind": "not_found_error"}
    except MmkvError as err:
        message = packs.shelf.hide(str(err))
        return {
            "error": message,
            "status": STATUS.get(type(err), 400),
            "kind": "invalid_request_error",
        }
    summary = {key: info[key] for key in SUMMARY if key in info}
    return {
        "id": name,
        "object": "model",
        "owned_by": "mmkv",
        "created": _epoch(info.get("created")),
        "mmkv": {**summary, "media": _media(info["media"])},
    }


def _stream_model(hosted) -> dict:
    """A running stream as an OpenAI model object, its state under `mmkv.stream`."""
    return {
        "id": hosted.request.name,
        "object": "model",
        "owned_by": "mmkv",
        "created": hosted.created,
        "mmkv": {"stream": hosted.state()},
    }


def _media(media: dict) -> dict:
    """A pack's media record with its source named by file name only: the encoding machine's
    folders are not a client's business."""
    source = media.get("source")
    return {**media, "source": PurePosixPath(str(source)).name if source else source}


def _epoch(created: str | None) -> int:
    """The pack's creation time (ISO 8601) in seconds since the epoch, as OpenAI's `created`."""
    try:
        return int(datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0
