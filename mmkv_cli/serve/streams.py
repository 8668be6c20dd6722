"""Live streams hosted by `mmkv serve` beside the packs: `POST /v1/streams` starts one, a chat
completion asks it by name like a pack (from the memory at the moment the question arrives),
`GET /v1/streams/NAME` shows its state, `DELETE` stops it and keeps its pack, which the shelf then
serves as any other (NAME.kvpack in the packs folder).

Each stream follows its source on a thread of its own (live.Follow); a question waits for the
stream's next frame, then for its answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from mmkv_cli.api.live import Follow, LiveQuestion
from mmkv_cli.core.errors import MmkvError, OutputExistsError, UsageError, called_from
from mmkv_cli.core.names import inside, name_problem
from mmkv_cli.core.options import KV_BITS, EncodeOptions, GenerationOptions, LoadOptions, MethodSpec
from mmkv_cli.media.live import LiveOptions

MAX_STREAMS = 8  # each holds a memory and a decoding thread
ANSWER_WAIT_S = 600.0  # a question waits for the stream's next frame, then for its answer


class MethodRequest(BaseModel):
    """A method with parameters set over its own, as a typed method object sends it
    (`mmkv.methods.HERMES(...).spec()`): checked against the method's class when the stream
    starts."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=128)
    params: dict[str, Any] = Field(default_factory=dict, max_length=64)


class StreamRequest(BaseModel):
    """The body of `POST /v1/streams`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=128)  # becomes NAME.kvpack in the packs folder: checked below
    source: str = Field(max_length=2048)
    method: Annotated[str, Field(max_length=128)] | MethodRequest = "hermes"
    budget_tokens: int | None = Field(None, ge=1, le=1 << 24)
    fps: float | None = Field(None, gt=0, le=60)
    model: str | None = Field(None, max_length=200)
    kv_bits: Literal[KV_BITS] | None = None  # None: the method's own
    reduce: str | None = Field(None, max_length=64)  # a token reducer; None: the method's own
    snapshot_every: float | None = Field(None, gt=0)
    behind: Literal["wait", "drop"] | None = None
    # seconds of silence that end the stream: `stall` as the CLI and Python name it (stall_s read)
    stall: float = Field(10.0, gt=0, le=3600, validation_alias=AliasChoices("stall", "stall_s"))

    @property
    def method_name(self) -> str:
        return self.method if isinstance(self.method, str) else self.method.name

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name


@dataclass
class Hosted:
    request: StreamRequest
    follow: Follow
    thread: threading.Thread | None = None  # the follow, running
    done: dict | None = None  # the follow's summary once it has ended
    error: str | None = None  # what ended it, when not the source
    created: int = field(default_factory=lambda: int(time.time()))  # started, epoch seconds

    def state(self) -> dict:
        """running; then ended, stopped, interrupted or broken as the follow ended, or failed
        when it could not go on (its pack could not be written)."""
        encoder, source = self.follow.encoder, self.follow.source
        running = self.thread is not None and self.thread.is_alive()
        return {
            "name": self.request.name,
            "source": self.request.source,
            "method": self.request.method_name,
            "state": "running" if running else (self.done or {}).get("stopped", "failed"),
            "moment": encoder.moment,
            "frames": len(encoder.times),
            "dropped": source.dropped,
            "snapshots": self.follow.snapshots,
            "pack": self.follow.output.name,  # on the shelf by that name; no server folder shown
            "error": self.hide(self.error or (self.done or {}).get("error")),
        }

    def hide(self, message: str | None) -> str | None:
        """`message` without the server's packs folder (a pack write's error names its path)."""
        if message is None:
            return None
        return message.replace(str(self.follow.output.parent) + "/", "")


class Streams:
    """The streams a server hosts, by name; their packs go to the packs folder."""

    def __init__(self, folder: Path | None, load: LoadOptions, backbone_for, on_model, usual_model):
        self.folder = folder  # None: the packs are on object storage, where no stream can write
        self.load = load
        self.backbone_for = backbone_for  # LoadOptions -> a loaded backbone (the server's LRU)
        self.on_model = on_model  # job -> its result, run on the server's one model thread
        self.usual_model = usual_model  # () -> the model a stream naming none runs (or None)
        self.hosted: dict[str, Hosted] = {}
        self.lock = threading.Lock()

    def start(self, request: StreamRequest) -> dict:
        """Start `request`'s stream: everything it asks checked (and named as its JSON fields)
        before its model loads; a name taken is an OutputExistsError (409)."""
        with called_from("http"):
            return self._start(request)

    def _start(self, request: StreamRequest) -> dict:
        if self.folder is None:
            raise UsageError("live streams need a local --packs folder to write their packs to")
        with self.lock:
            running = [name for name in self.hosted if self.live(name)]
            if request.name in running:
                raise OutputExistsError(f"a stream named '{request.name}' is running")
            if len(running) >= MAX_STREAMS:
                raise UsageError(f"{MAX_STREAMS} streams are running: stop one first")
            output = inside(self.folder, request.name, ".kvpack", "stream name")
            if output.exists():
                raise OutputExistsError(f"a pack named '{request.name}' exists: pick another name")
            model = request.model or self.usual_model()
            load = LoadOptions(model, self.load.device, self.load.dtype)
            method = request.method
            options = EncodeOptions(
                method if isinstance(method, str) else MethodSpec(method.name, method.params),
                budget_tokens=request.budget_tokens,
                kv_bits=request.kv_bits,
                reduce=request.reduce,
            )
            live = LiveOptions(fps=request.fps, behind=request.behind, stall_s=request.stall)
            follow = Follow(
                request.source,
                output,
                options,
                live,
                load=load,
                load_model=lambda load: self.on_model(lambda: self.backbone_for(load)),
                snapshot_every=request.snapshot_every,
                on_model=self.on_model,
            )
            hosted = Hosted(request, follow)
            hosted.thread = threading.Thread(
                target=self._follow, args=(hosted,), name=f"mmkv-stream-{request.name}", daemon=True
            )
            self.hosted[request.name] = hosted
            hosted.thread.start()
        return hosted.state()

    def _follow(self, hosted: Hosted) -> None:
        try:
            hosted.done = hosted.follow.run()
        except MmkvError as err:
            hosted.error = str(err)

    def get(self, name: str) -> Hosted:
        hosted = self.hosted.get(name)
        if hosted is None:
            raise LookupError(f"no stream named '{name}'")
        return hosted

    def running(self) -> list[Hosted]:
        return [hosted for name, hosted in list(self.hosted.items()) if self.live(name)]

    def live(self, name: str) -> Hosted | None:
        """The running stream `name`, or None (then a pack of that name may answer)."""
        hosted = self.hosted.get(name)
        alive = hosted is not None and hosted.thread is not None and hosted.thread.is_alive()
        return hosted if alive else None

    def stop(self, name: str, wait_s: float = 60.0) -> dict:
        hosted = self.get(name)
        hosted.follow.stop()
        if hosted.thread is not None:
            hosted.thread.join(wait_s)
        return hosted.state()

    def stop_all(self) -> None:
        for name in list(self.hosted):
            self.stop(name, wait_s=10.0)

    async def ask(self, name: str, question: str, max_new_tokens: int) -> dict:
        """An answer from the running stream's memory as it is when the question is taken."""
        hosted = self.live(name)
        if hosted is None:
            raise LookupError(f"no running stream named '{name}'")
        loop = asyncio.get_running_loop()
        answered: asyncio.Future = loop.create_future()

        def reply(record: dict) -> None:
            loop.call_soon_threadsafe(
                lambda: answered.done() or answered.set_result(record)  # once
            )

        generation = GenerationOptions(max_new_tokens)
        hosted.follow.ask(LiveQuestion(question, reply=reply, generation=generation))
        return await asyncio.wait_for(answered, ANSWER_WAIT_S)
