"""`mmkv.Live`: a source still arriving followed into a pack on a thread of its own, answering
questions from the memory at their moments (mmkv_cli.api.live.Follow underneath)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import TracebackType

from mmkv._results import LiveAnswer, LiveResult
from mmkv_cli.api.live import Follow, LiveQuestion
from mmkv_cli.core.options import GenerationOptions


class Live:
    """A live source being followed: iterate it for the answers to the questions it was started
    with, `ask` it for more, `wait` for the source to end, or leave its `with` block to stop it
    (the memory so far becomes the pack). Built by `mmkv.live`."""

    def __init__(self, follow: Follow) -> None:
        self.follow = follow
        self._answers: queue.Queue[LiveAnswer | None] = queue.Queue()
        self._result: LiveResult | None = None
        self._failure: BaseException | None = None
        follow.on_answer = lambda record: self._answers.put(LiveAnswer.from_record(record))
        self._thread = threading.Thread(target=self._run, name="mmkv-live", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        moment = self.follow.encoder.moment
        state = "running" if self._thread.is_alive() else "ended"
        return f"Live({self.follow.source.spec!r}, {state}, moment={moment})"

    def _run(self) -> None:
        try:
            self._result = LiveResult.from_record(self.follow.run())
        except BaseException as err:  # noqa: BLE001 (raised again on the caller's thread)
            self._failure = err
        finally:
            self._answers.put(None)

    def ask(
        self, question: str, *, at: float | None = None, max_new_tokens: int | None = None
    ) -> Future[LiveAnswer]:
        """Queue `question`: answered from the memory when it arrives, or when the stream reaches
        `at` seconds (from the final memory if the stream ends first). The future holds the
        answer; one that could not be given says why in `.error`."""
        reply: Future[LiveAnswer] = Future()
        generation = None if max_new_tokens is None else GenerationOptions(max_new_tokens)
        self.follow.ask(
            LiveQuestion(
                question,
                at=at,
                generation=generation,
                reply=lambda record: reply.set_result(LiveAnswer.from_record(record)),
            )
        )
        return reply

    def __iter__(self) -> Iterator[LiveAnswer]:
        """The answers to the questions `mmkv.live` was given, as they are answered, until the
        source ends."""
        while (answer := self._answers.get()) is not None:
            yield answer
        self._answers.put(None)  # a second iteration ends at once too
        self._raise()

    def wait(self, timeout: float | None = None) -> LiveResult:
        """Wait for the source to end (or `stop`); how it ended and the pack it left."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.follow.source.spec} is still arriving after {timeout} s")
        self._raise()
        assert self._result is not None
        return self._result

    def stop(self) -> LiveResult:
        """Stop following at the next frame; the memory so far becomes the final pack."""
        self.follow.stop()
        return self.wait()

    def _raise(self) -> None:
        if self._failure is not None:
            raise self._failure

    def __enter__(self) -> Live:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.follow.stop()
        self._thread.join()
        if error is None:
            self._raise()
