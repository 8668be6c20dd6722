"""The live verb: follow a source still arriving, answer each question from the memory as it is at
the question's moment, and publish that memory as a pack (every `snapshot_every` seconds of stream,
and whole when the stream ends, is stopped, or breaks: nothing encoded is lost).

A question without a moment is answered when it arrives, from the memory then; one with `at` is
answered when the stream reaches that moment, before the first frame after it goes in, so its
memory is exactly that of the stream cut at `at` (encode/live.py). Each answer says the moment it
saw, how long the answer took to start, and how far the encode was behind the source: how long ago
the newest frame it holds came out of the source.
"""

from __future__ import annotations

import queue
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from mmkv_cli.api import PackSession, answer_record
from mmkv_cli.core import logs
from mmkv_cli.core.errors import MediaError, MmkvError, UsageError, flag
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
from mmkv_cli.media.live import LiveOptions, LiveSource
from mmkv_cli.pack import MemoryPack, check_writable, local_path


@dataclass(frozen=True)
class LiveQuestion:
    question: str
    id: str | int | None = None
    at: float | None = None  # the stream moment to answer at (None: when it arrives)
    at_end: bool = False  # no moment, answered from the stream's final memory (a question file)
    # where this question's answer goes (a server's waiting request); None: the follow's on_answer
    reply: Callable[[dict], None] | None = field(default=None, compare=False)
    generation: GenerationOptions | None = None  # None: the follow's


LOG = logs.get("mmkv_cli.live")  # the name users filter by, as before the move
Answered = Callable[[dict], None]  # one answer record (as `ask --json` prints it, and more)
Ready = Callable[[dict], None]  # {"moment", "after_s"}: the first frame is in
T = TypeVar("T")


def here(job: Callable[[], T]) -> T:
    """Model work run on the calling thread (a follow that has its backbone to itself)."""
    return job()


def _reached(question: LiveQuestion, moment: float) -> bool:
    return question.at is not None and question.at <= moment


class Follow:
    """One live source followed into one pack, questions answered on the way."""

    def __init__(
        self,
        source: str,
        output: str | Path,
        options: EncodeOptions,
        live: LiveOptions,
        *,
        load: LoadOptions | None = None,
        backbone=None,
        load_model: Callable[[LoadOptions], Any] | None = None,
        snapshot_every: float | None = None,
        generation: GenerationOptions | None = None,
        on_answer: Answered | None = None,
        on_ready: Ready | None = None,
        on_model: Callable[[Callable[[], T]], T] = here,
    ):
        """on_model(job): runs `job` (every forward: a frame, a memory cut, an answer) where the
        backbone's work is done; a server passes its model thread, so streams and chats on one
        backbone take turns in one queue instead of running beside each other. load_model(load):
        the backbone, once everything else is checked (a server's held ones; default: loaded
        here), where `backbone` is not given."""
        from mmkv_cli.backbones.spec import model_spec
        from mmkv_cli.methods import EncodeContext
        from mmkv_cli.methods.choice import choice_for
        from mmkv_cli.pack import QuantSpec

        if snapshot_every is not None and not snapshot_every > 0:
            raise UsageError(f"{flag('snapshot_every')} must be a positive number of seconds")
        self.output = local_path(output)
        check_writable(self.output, options.force)
        choice = choice_for(options)
        self.quant = QuantSpec(options.bits_for(choice.method), options.kv_group)
        self.quant.check(1, 8)
        from mmkv_cli.methods.choice import check_live

        self.choice = check_live(choice)
        load = load or LoadOptions()
        if live.fps is None:  # the model's own rate, known before it loads
            spec = backbone.spec if backbone is not None else model_spec(load.model)
            live = replace(live, fps=spec.fps)
        self._began = time.monotonic()
        self.source = LiveSource(source, live)  # checked before the model loads
        if self.source.kind in ("pipe", "file"):  # its bytes wait: read while the model loads
            self.source.start()
        try:
            from mmkv_cli.backbones.loading import load_backbone

            self.backbone = backbone or (load_model or load_backbone)(load)
        except BaseException:
            self.source.close()
            raise
        kv = self.backbone.kv_shape()
        self.quant.check(kv["kv_heads"], kv["head_dim"])
        from mmkv_cli.encode.live import LiveEncoder

        self.context = EncodeContext("video", options.guidance_prompt)
        self.encoder = LiveEncoder(self.backbone, self.choice, self.context)
        self.snapshot_every = snapshot_every
        self.generation = generation or GenerationOptions()
        self.on_answer, self.on_ready, self.on_model = on_answer, on_ready, on_model
        self.questions: queue.Queue[LiveQuestion | None] = queue.Queue()
        self.waiting: list[LiveQuestion] = []  # questions with a moment still to come
        self.snapshots = 0
        self._snapshot_at = 0.0
        # a snapshot is written on a thread of its own while the frames after it go in
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mmkv-snapshot")
        self._writing: Future | None = None
        self.stopping = False

    def ask(self, question: LiveQuestion) -> None:
        """Queue a question (from any thread)."""
        self.questions.put(question)

    def stop(self) -> None:
        """End the follow at the next frame (from any thread or a signal handler): the memory so
        far becomes the final pack. Nothing is cut mid-chunk."""
        self.stopping = True
        self.source.close()

    def run(self) -> dict:
        """Follow the source until it ends, is stopped (Ctrl-C, SIGTERM) or breaks; the final pack
        is written in every case. Returns a summary; `error` holds a broken source's line."""
        error, stopped = None, "ended"
        try:
            for at, frame in self.source.frames():
                self.on_model(lambda at=at, frame=frame: self._step(at, frame))
        except KeyboardInterrupt:
            stopped = "interrupted"
        except MediaError as err:
            error, stopped = str(err), "broken"
        finally:
            self.source.close()
        if self.stopping:
            stopped = "stopped"
        LOG.info("%s %s after %d frames (%s)", self.source.spec, stopped, len(self.encoder.times),
                 error or self.source.ended_by)  # fmt: skip
        if self.encoder.moment is None:
            raise MediaError(error or f"{self.source.spec} gave no frame")
        size = self.on_model(self._finish)
        return {
            "path": str(self.output),
            "bytes": size,
            "stopped": stopped,
            "error": error,
            "moment": self.encoder.moment,
            "frames": len(self.encoder.times),
            "dropped": self.source.dropped,
            "ended_by": self.source.ended_by,
            "snapshots": self.snapshots,
        }

    # --- inside ---

    def _step(self, at: float, frame) -> None:
        """One frame: the questions due before it, the frame, the questions it makes due."""
        self._take_questions()
        self._answer_due(before=at)
        self.encoder.push(frame, at)
        if self.on_ready and len(self.encoder.times) == 1:
            self.on_ready({"moment": at, "after_s": time.monotonic() - self._began})
        self._answer_now()
        self._snapshot_due()

    def _finish(self) -> int:
        """The questions still waiting, from the final memory; the final pack written (after the
        snapshot still being written: an older memory never replaces it)."""
        self._take_questions()
        for question in self.waiting:  # moments past the end: from the final memory
            ended = f"the stream ended at {self.encoder.moment:.2f} s, before its moment"
            self._answer(question, note=ended if question.at is not None else None)
        self.waiting = []
        final = self.encoder.close()
        self._snapshot_done(wait=True)
        self._writer.shutdown()
        return self._write(final, self.output, self._media())

    def _take_questions(self) -> None:
        while True:
            try:
                question = self.questions.get_nowait()
            except queue.Empty:
                return
            if question is not None:
                self.waiting.append(question)

    def _answer_due(self, before: float) -> None:
        """Questions whose moment the next frame (at `before`) passes: from the memory now."""
        due = [q for q in self.waiting if q.at is not None and q.at < before]
        self.waiting = [q for q in self.waiting if q not in due]
        for question in sorted(due, key=lambda q: q.at):
            self._answer(question)

    def _answer_now(self) -> None:
        self._take_questions()
        # no moment, or one already reached (a question late for its moment gets the memory now)
        moment = self.encoder.moment
        now = [q for q in self.waiting if (q.at is None and not q.at_end) or _reached(q, moment)]
        self.waiting = [q for q in self.waiting if q not in now]
        for question in now:
            self._answer(question)

    def _answer(self, question: LiveQuestion, note: str | None = None) -> None:
        started = time.perf_counter()
        moment = self.encoder.moment
        behind = self.source.ahead_of(moment)
        generation = question.generation or self.generation
        try:
            memory = self.encoder.memory()
            if not self.quant.quantized:  # asked in place: what the written pack would give
                session = PackSession(self._in_memory(memory), backbone=self.backbone)
                snapshot_s = time.perf_counter() - started
                answer = session.ask(question.question, AskOptions(generation=generation))
            else:  # its values are what decoding the written pack makes
                with tempfile.TemporaryDirectory(prefix="mmkv-live-") as folder:
                    pack = Path(folder) / "now.kvpack"
                    self._write(memory, pack, self._media())
                    snapshot_s = time.perf_counter() - started
                    session = PackSession(pack, backbone=self.backbone)
                    answer = session.ask(question.question, AskOptions(generation=generation))
        except MmkvError as err:
            if self.on_answer:
                self.on_answer(
                    {"id": question.id, "question": question.question, "error": str(err)}
                )
            return
        self.context.turns.append((question.question, answer.answer))  # for a turn-aware memory
        record = answer_record(answer, question.question, question.at, question.id)
        record.update(
            completion_tokens=len(answer.token_ids),
            moment=moment,
            snapshot_s=round(snapshot_s, 4),
            ttft_s=round(snapshot_s + answer.ttft_s, 4),  # the question waited for both
            behind_s=round(behind, 3),
        )
        if note:
            record["note"] = note
        self._reply(question, record)

    def _reply(self, question: LiveQuestion, record: dict) -> None:
        if question.reply is not None:
            question.reply(record)
        elif self.on_answer:
            self.on_answer(record)

    def _snapshot_due(self) -> None:
        """The memory now, written as a snapshot on the writer's thread while the next frames go
        in. One is written at a time: while the last is still being written, the next waits for
        a frame that finds it done (a memory is never queued behind it)."""
        moment = self.encoder.moment
        if self.snapshot_every is None or moment - self._snapshot_at < self.snapshot_every:
            return
        if not self._snapshot_done(wait=False):
            return
        # cut here, on the model's thread: what the writer reads never changes after
        memory, media = self.encoder.memory(), self._media()
        self._writing = self._writer.submit(self._write, memory, self.output, media)
        self._snapshot_at = moment

    def _snapshot_done(self, wait: bool) -> bool:
        """Whether no snapshot is being written (wait: until none is). A snapshot that could not
        be written is a warning: the follow goes on, and the final pack is still written."""
        if self._writing is None:
            return True
        if not wait and not self._writing.done():
            return False
        writing, self._writing = self._writing, None
        try:
            writing.result()
        except MmkvError as err:
            LOG.warning("a snapshot of %s was not written: %s", self.output, err)
            return True
        self.snapshots += 1
        LOG.info("snapshot %d of %s written", self.snapshots, self.output)
        return True

    def _write(self, encoded, path: Path, media) -> int:
        """The memory as a pack at `path`, written atomically (a reader never sees part of it).
        media: the stream as that memory holds it (its frames' times)."""
        from mmkv_cli.encode.record import write_encoded

        return write_encoded(
            path, self.backbone, self.choice, self.context, media, encoded, self.quant, force=True
        )

    def _in_memory(self, encoded) -> MemoryPack:
        """The memory as `ask` would read it from its pack, nothing written."""
        from mmkv_cli.encode.record import pack_header

        header, _ = pack_header(self.backbone, self.choice, self.context, self._media(), encoded)
        prefix, blocks, suffix = encoded.prefix, encoded.blocks, encoded.suffix
        label = f"the memory of {self.source.spec} at {self.encoder.moment:.2f} s"
        return MemoryPack(header, prefix, blocks, suffix, encoded.representatives, label)

    def _media(self):
        from mmkv_cli.media.base import Media

        times = list(self.encoder.times)
        return Media("video", self.source.spec, self.source.digest, times, None)
