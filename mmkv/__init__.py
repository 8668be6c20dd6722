"""mmkv from Python: encode media into a pack, ask it, or open it once for many questions.

    import mmkv

    mmkv.encode("clip.mp4", "clip.kvpack", model="demo", method="mukv", budget=0.5)
    print(mmkv.ask("clip.kvpack", "which shape appeared first ?").answer)
    with mmkv.open("clip.kvpack") as pack:
        for piece in pack.stream("what color is the circle ?"):
            print(piece, end="", flush=True)

Keyword arguments mirror the CLI's options; every failure is an `mmkv.MmkvError` whose text is the
CLI's one line. The options records underneath are in `mmkv_cli.options`, the verbs in
`mmkv_cli.api`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from mmkv_cli import __version__
from mmkv_cli import api as _api
from mmkv_cli.errors import REPLACE_WITH, MmkvError, OutputExistsError, PackError, UsageError
from mmkv_cli.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions

__all__ = [
    "MmkvError",
    "OutputExistsError",
    "Pack",
    "PackError",
    "UsageError",
    "__version__",
    "ask",
    "encode",
    "inspect",
    "open",
    "verify",
]

inspect = _api.inspect  # what a pack holds (no model, no torch)
verify = _api.verify  # every byte of a pack checked


def encode(
    media: str | Path,
    out: str | Path,
    *,
    model: str | None = None,
    method: str = "full",
    budget: float | None = None,
    budget_tokens: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    kv_bits: float | None = None,
    kv_group: int = EncodeOptions.kv_group,
    guidance_prompt: str | None = None,
    reduce: str | None = None,
    force: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Encode `media` (a video, an image, a folder or glob of images, a PDF) into the pack `out`
    with `method` at `budget` (a share of visual tokens) or `budget_tokens` (a count per layer).
    kv_bits None: the method's own; reduce: a token reducer before the prefill (dtd, ctr,
    visionzip; None: the method's own, 'none': none). Returns what `mmkv encode --json` prints.
    progress(frames done, visual tokens done)."""
    options = EncodeOptions(
        method=method,
        budget=budget,
        budget_tokens=budget_tokens,
        fps=fps,
        max_frames=max_frames,
        guidance_prompt=guidance_prompt,
        force=force,
        kv_bits=kv_bits,
        kv_group=kv_group,
        reduce=reduce,
    )
    load = LoadOptions(model=model, device=device, dtype=dtype)
    replacing = REPLACE_WITH.set("force=True")  # Python's words, not the CLI's --force
    try:
        return _api.encode(str(media), out, options, load=load, progress=progress)
    finally:
        REPLACE_WITH.reset(replacing)


def _ask_options(at, max_new_tokens, temperature, top_p, seed, stop, prune, prune_budget):
    generation = GenerationOptions(max_new_tokens, temperature, top_p, seed, tuple(stop))
    return AskOptions(at=at, prune=prune, prune_budget=prune_budget, generation=generation)


class Pack:
    """A pack opened with its backbone loaded once: ask it as often as you like. Use as a context
    manager (or call close) to let go of the file."""

    def __init__(self, path: str | Path, *, model=None, device="auto", dtype="auto"):
        load = LoadOptions(model=model, device=device, dtype=dtype)
        self.session = _api.PackSession(path, load=load)
        self.path = str(path)

    def ask(
        self,
        question: str,
        *,
        at: float | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] | list[str] = (),
        prune: str | None = None,
        prune_budget: float | None = None,
        on_text: Callable[[str], None] | None = None,
    ):
        """The answer (`.answer`, timings, retrieved blocks) to `question`, asked at moment `at`
        (seconds; None: the end). on_text(piece) sees the answer as it is decoded."""
        options = _ask_options(
            at, max_new_tokens, temperature, top_p, seed, stop, prune, prune_budget
        )
        return self.session.ask(question, options, on_token=on_text)

    def stream(self, question: str, **settings) -> Iterator[str]:
        """The answer to `question` piece by piece, as it is decoded (the settings of `ask`).
        Stopping the iteration early stops the decoding."""
        pieces: queue.Queue = queue.Queue()
        stopped = threading.Event()
        done = object()
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
                pieces.put(done)

        worker = threading.Thread(target=run, name="mmkv-stream", daemon=True)
        worker.start()
        try:
            while (piece := pieces.get()) is not done:
                yield piece
        finally:
            stopped.set()
            worker.join()
        if failure:
            raise failure[0]

    def info(self) -> dict:
        """What the pack holds (as `mmkv inspect --json`)."""
        return _api.inspect(self.path)

    def close(self) -> None:
        self.session.reader.source.close()

    def __enter__(self) -> Pack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Stopped(Exception):
    """The consumer of a stream stopped reading it."""


def open(pack: str | Path, *, model: str | None = None, device="auto", dtype="auto") -> Pack:  # noqa: A001
    """The pack `pack` opened for many questions, its model (the pack's own unless `model`) loaded
    once."""
    return Pack(pack, model=model, device=device, dtype=dtype)


def ask(
    pack: str | Path,
    question: str,
    *,
    model: str | None = None,
    device="auto",
    dtype="auto",
    **settings,
):
    """One question to a pack (the settings of `Pack.ask`)."""
    with open(pack, model=model, device=device, dtype=dtype) as opened:
        return opened.ask(question, **settings)
