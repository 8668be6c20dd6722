"""Packs by name on the server's shelf, answered on its one model thread, with a bounded line of
requests waiting for it: a request past the line is refused at once (503, Retry-After)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

from mmkv_cli.core.errors import MmkvError
from mmkv_cli.core.options import AskOptions, LoadOptions
from mmkv_cli.pack import inspect, is_url
from mmkv_cli.serve.responses import error as _error
from mmkv_cli.serve.shelf import Shelf
from mmkv_cli.serve.warm import Warm


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


def busy_response():
    """503 with Retry-After: the line of waiting requests is full."""
    return _error(
        503, "busy: too many requests waiting, retry shortly", "server_error", {"Retry-After": "1"}
    )
