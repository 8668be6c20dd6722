"""`mmkv.Pack`: one pack opened with its backbone loaded once, asked as often as you like."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from mmkv._results import PackInfo
from mmkv_cli import api
from mmkv_cli.ask.result import Answer
from mmkv_cli.core.errors import UsageError, called_from_python
from mmkv_cli.core.options import AskOptions, GenerationOptions, LoadOptions

if TYPE_CHECKING:
    from typing_extensions import TypedDict, Unpack

    class _Sampling(TypedDict, total=False):
        """The keywords every ask takes (`Pack.ask`'s, but `on_text`)."""

        at: float | None
        max_new_tokens: int
        temperature: float
        top_p: float
        seed: int | None
        stop: Sequence[str]
        prune: str | None
        prune_budget: float | None

    class AskSettings(_Sampling, total=False):
        """`Pack.ask`'s keywords, for its overloads (one question, or a list of them)."""

        on_text: Callable[[str], None] | None

    class OpenAndAskSettings(_Sampling, total=False):
        """`mmkv.ask`'s keywords: `open`'s, then `Pack.ask`'s but `on_text`."""

        model: str | None
        device: str
        dtype: str


class Pack:
    """A pack opened with its model loaded once. Use it as a context manager (or call `close`) to
    let go of the file.

    Args:
        path: the .kvpack (a path or a URL on object storage).
        model: the backbone to answer with (None: the one the pack names).
        device: auto, cpu, cuda or cuda:N.
        dtype: auto, float32, bfloat16 or float16.
    """

    @called_from_python()
    def __init__(
        self,
        path: str | Path,
        *,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        load = LoadOptions(model=model, device=device, dtype=dtype)
        self.session = api.PackSession(path, load=load, shared=True)
        self.path = str(path)
        self.closed = False

    def __repr__(self) -> str:
        header = self.session.reader.header
        model = self.session.backbone.name
        return (
            f"Pack({self.path!r}, method={header.method.name!r}, "
            f"blocks={len(self.session.reader.blocks)}, model={model!r})"
        )

    @overload
    def ask(self, question: str, **settings: Unpack[AskSettings]) -> Answer: ...

    @overload
    def ask(
        self, question: list[str] | tuple[str, ...], **settings: Unpack[AskSettings]
    ) -> list[Answer]: ...

    @called_from_python()
    def ask(
        self,
        question: str | Sequence[str],
        *,
        at: float | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        prune: str | None = None,
        prune_budget: float | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer | list[Answer]:
        """Answer `question` from the pack alone (a list of questions: each in turn, a list of
        answers).

        Args:
            question: the question, as text, or a list of them.
            at: the question's moment in seconds (an image or page index for stills); only what
                was shown by then counts (None: the end).
            max_new_tokens: the longest answer, in tokens.
            temperature: 0 decodes greedily; above 0 samples.
            top_p: the nucleus sampling mass, with temperature above 0.
            seed: the sampling seed (None: not reproducible).
            stop: stop strings: the answer ends before the first one.
            prune: a method that prunes the context's visual KV by the question (`mmkv ask
                --prune`).
            prune_budget: with prune, the share of visual KV kept (None: its default).
            on_text: called with each piece of the answer as it is decoded.
        """
        if self.closed:
            raise UsageError(f"the pack {self.path} is closed: open it again to ask it")
        asked = [question] if isinstance(question, str) else question
        if not isinstance(asked, Sequence) or not all(isinstance(q, str) for q in asked):
            raise not_questions(question)
        generation = GenerationOptions(max_new_tokens, temperature, top_p, seed, tuple(stop))
        options = AskOptions(at=at, prune=prune, prune_budget=prune_budget, generation=generation)
        answers = [self.session.ask(q, options, on_token=on_text) for q in asked]
        return answers[0] if isinstance(question, str) else answers

    def stream(
        self,
        question: str,
        *,
        at: float | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        prune: str | None = None,
        prune_budget: float | None = None,
    ) -> Iterator[str]:
        """The answer to `question` piece by piece as it is decoded (the arguments of `ask`).
        Stopping the iteration early stops the decoding."""
        settings: dict[str, Any] = dict(at=at, max_new_tokens=max_new_tokens, seed=seed, stop=stop)
        settings.update(
            temperature=temperature, top_p=top_p, prune=prune, prune_budget=prune_budget
        )
        pieces: queue.Queue[str | None] = queue.Queue()
        stopped = threading.Event()
        failure: list[BaseException] = []

        def on_text(piece: str) -> None:
            if stopped.is_set():
                raise _Stopped
            pieces.put(piece)

        def run() -> None:
            try:
                self.ask(question, on_text=on_text, **settings)
            except _Stopped:
                pass
            except BaseException as err:  # noqa: BLE001 (raised again on the caller's thread)
                failure.append(err)
            finally:
                pieces.put(None)

        worker = threading.Thread(target=run, name="mmkv-stream", daemon=True)
        worker.start()
        try:
            while (piece := pieces.get()) is not None:
                yield piece
        finally:
            stopped.set()
            worker.join()
        if failure:
            raise failure[0]

    @called_from_python()
    def info(self) -> PackInfo:
        """What the pack holds (as `mmkv inspect --json`)."""
        return PackInfo.from_record(api.inspect(self.path))

    def close(self) -> None:
        """Let go of the file (the model is freed with the object); asking after is refused."""
        if not self.closed:
            self.closed = True
            self.session.close()

    def __enter__(self) -> Pack:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def not_questions(value: object) -> UsageError:
    """What asking something other than text, or a list of texts, is refused with."""
    return UsageError(f"question must be text or a list of texts, not {value!r:.60}")


class _Stopped(Exception):
    """The consumer of a stream stopped reading it."""
