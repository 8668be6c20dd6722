"""mmkv from Python: encode media into a compressed pack, ask it, follow a live source.

    import mmkv
    from mmkv import methods

    mmkv.encode("clip.mp4", "clip.kvpack", model="demo", method=methods.MuKV(budget=0.5))
    print(mmkv.ask("clip.kvpack", "which shape appeared first ?").answer)
    with mmkv.open("clip.kvpack") as pack:
        for piece in pack.stream("what color is the circle ?"):
            print(piece, end="", flush=True)

Every name in `__all__` is the public API: the verbs take keyword arguments named as the CLI's
options and return typed records (`EncodeResult`, `Answer`, `PackInfo`, ...); `mmkv.methods` holds
a class per compression method. Every failure is an `MmkvError` whose text is the CLI's one line in
Python's words (`force=True`, not `--force`); its `exit_code` is the CLI's. The options records
underneath are in `mmkv_cli.core.options`, the verbs in `mmkv_cli.api`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from mmkv import methods
from mmkv._listing import list_methods, list_models
from mmkv._live import Live
from mmkv._pack import Pack, not_questions
from mmkv._results import (
    EncodeResult,
    EvalResult,
    LiveAnswer,
    LiveResult,
    MethodInfo,
    ModelInfo,
    PackInfo,
    ParamInfo,
    VerifyReport,
)
from mmkv._study import eval  # noqa: A004 (mmkv.eval, as `mmkv eval`)
from mmkv.methods import MethodConfig
from mmkv_cli import __version__
from mmkv_cli import api as _api
from mmkv_cli.ask.result import Answer
from mmkv_cli.core.errors import (
    AddressError,
    MediaError,
    MmkvError,
    ModelError,
    OutputExistsError,
    PackError,
    SetupError,
    StorageError,
    UsageError,
    called_from_python,
)
from mmkv_cli.core.options import EncodeOptions, LoadOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mmkv._pack import OpenAndAskSettings

__all__ = [
    "AddressError",
    "Answer",
    "EncodeResult",
    "EvalResult",
    "Live",
    "LiveAnswer",
    "LiveResult",
    "MediaError",
    "MethodConfig",
    "MethodInfo",
    "MmkvError",
    "ModelError",
    "ModelInfo",
    "OutputExistsError",
    "Pack",
    "PackError",
    "PackInfo",
    "ParamInfo",
    "SetupError",
    "StorageError",
    "UsageError",
    "VerifyReport",
    "__version__",
    "ask",
    "convert",
    "encode",
    "eval",
    "inspect",
    "list_methods",
    "list_models",
    "live",
    "methods",
    "open",
    "unload",
    "verify",
]


# the errors are mmkv's: shown as mmkv.UsageError, not where they are defined
for _error in (AddressError, MediaError, MmkvError, ModelError, OutputExistsError, PackError,
               SetupError, StorageError, UsageError):  # fmt: skip
    _error.__module__ = __name__


def __dir__() -> list[str]:
    return sorted(__all__)


def _method_options(
    method: str | MethodConfig, budget: float | None, budget_tokens: int | None, reduce: str | None
) -> dict[str, Any]:
    """An encode's method, budget and reducer from a name or a method object (whose own budget
    and reducer stand unless given here too: then the call is refused)."""
    if isinstance(method, str):
        return dict(method=method, budget=budget, budget_tokens=budget_tokens, reduce=reduce)
    own = {"budget": method.budget, "budget_tokens": method.budget_tokens, "reduce": method.reduce}
    given = {"budget": budget, "budget_tokens": budget_tokens, "reduce": reduce}
    for key, value in given.items():
        if value is not None and own[key] is not None:
            raise UsageError(f"{key} is set on the method object and given here: give it once")
        own[key] = own[key] if value is None else value
    return dict(method=method.spec(), reduce_params=method.reduce_params, **own)


@called_from_python()
def encode(
    media: str | Path,
    out: str | Path,
    *,
    model: str | None = None,
    method: str | MethodConfig = "full",
    budget: float | None = None,
    budget_tokens: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    kv_bits: float | None = None,
    kv_group: int = EncodeOptions.kv_group,
    guidance_prompt: str | None = None,
    reduce: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    force: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> EncodeResult:
    """Encode media into a compressed pack.

    Args:
        media: a video, an image, a folder or glob of images, or a PDF (a path or a URL).
        out: the .kvpack to write (a path or a URL).
        model: the backbone: a preset (`mmkv.list_models()`), an HF id or a local folder (None:
            the default).
        method: a method or preset by name, or a method object (`mmkv.methods.HERMES(...)`).
        budget: the share of visual tokens kept, in (0, 1] (None: the method's default).
        budget_tokens: visual tokens kept per layer, instead of a share.
        fps: frames taken per second of video (None: the model's).
        max_frames: at most this many frames (None: the model's).
        kv_bits: bits per stored visual K/V value: 16, 8, 4, 2 or 1.5 (None: the method's own).
        kv_group: the quantization group (tokens per key group, channels per value group).
        guidance_prompt: the prompt that scores tokens, for methods that score by one.
        reduce: a token reducer before the prefill: dtd, ctr, visionzip or 'none' (None: the
            method's own).
        checkpoint_every: save the streaming state every N chunks beside the output (0: never).
        resume: continue from the checkpoint an interrupted encode left.
        force: replace an existing output.
        device: auto, cpu, cuda or cuda:N.
        dtype: auto, float32, bfloat16 or float16.
        progress: called with (frames done, visual tokens done) as the encode goes.
    """
    options = EncodeOptions(
        **_method_options(method, budget, budget_tokens, reduce),
        fps=fps,
        max_frames=max_frames,
        guidance_prompt=guidance_prompt,
        force=force,
        kv_bits=kv_bits,
        kv_group=kv_group,
        checkpoint_every=checkpoint_every,
        resume=resume,
    )
    load = LoadOptions(model=model, device=device, dtype=dtype)
    return EncodeResult.from_record(
        _api.encode(str(media), out, options, load=load, progress=progress, shared=True)
    )


@called_from_python()
def open(  # noqa: A001 (mmkv.open, as io.open and tarfile.open)
    pack: str | Path, *, model: str | None = None, device: str = "auto", dtype: str = "auto"
) -> Pack:
    """The pack opened for many questions, its model (the pack's own unless `model`) loaded once.
    Use it as a context manager."""
    return Pack(pack, model=model, device=device, dtype=dtype)


@overload
def ask(pack: str | Path, question: str, **settings: Unpack[OpenAndAskSettings]) -> Answer: ...


@overload
def ask(
    pack: str | Path,
    question: list[str] | tuple[str, ...],
    **settings: Unpack[OpenAndAskSettings],
) -> list[Answer]: ...


@called_from_python()
def ask(
    pack: str | Path,
    question: str | Sequence[str],
    *,
    model: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    at: float | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    prune: str | None = None,
    prune_budget: float | None = None,
) -> Answer | list[Answer]:
    """A question to a pack (or a list of them, answered in turn): `open` it and `Pack.ask` (the
    arguments of both)."""
    settings: dict[str, Any] = dict(at=at, max_new_tokens=max_new_tokens, seed=seed, stop=stop)
    settings.update(temperature=temperature, top_p=top_p, prune=prune, prune_budget=prune_budget)
    with open(pack, model=model, device=device, dtype=dtype) as opened:
        if isinstance(question, str):
            return opened.ask(question, **settings)
        if not isinstance(question, list | tuple):
            raise not_questions(question)
        return opened.ask(list(question), **settings)


def unload() -> None:
    """Let go of the models `ask`, `open` and `encode` keep loaded between calls (at most two)."""
    _api.unload()


@called_from_python()
def inspect(pack: str | Path) -> PackInfo:
    """What a pack holds, read from its header and table alone (no model, no torch)."""
    return PackInfo.from_record(_api.inspect(pack))


@called_from_python()
def verify(pack: str | Path) -> VerifyReport:
    """Every byte of a pack read and checked against its checksums (no model, no torch)."""
    return VerifyReport.from_record(_api.verify(pack))


@called_from_python()
def convert(
    pack: str | Path,
    out: str | Path,
    *,
    kv_bits: float | None = None,
    kv_group: int | None = None,
    start: float | None = None,
    stop: float | None = None,
    force: bool = False,
) -> PackInfo:
    """A pack re-stored without the model: its visual KV at `kv_bits` (None: as stored), only
    the blocks in [start, stop] seconds; written whole to `out`."""
    _api.convert(pack, out, _api.convert_quant(kv_bits, kv_group), start, stop, force)
    return inspect(out)


@called_from_python()
def live(
    source: str,
    out: str | Path,
    *,
    model: str | None = None,
    method: str | MethodConfig = "hermes",
    budget_tokens: int | None = None,
    fps: float | None = None,
    kv_bits: float | None = None,
    reduce: str | None = None,
    questions: Iterable[str | tuple[str, float]] = (),
    max_new_tokens: int = 32,
    snapshot_every: float | None = None,
    behind: str | None = None,
    stall: float = 10.0,
    timeout: float = 5.0,
    force: bool = False,
    device: str = "auto",
    dtype: str = "auto",
) -> Live:
    """Follow a source still arriving into the pack `out`, on a thread of its own.

    Args:
        source: a growing or finished file, '-' for stdin, an http/rtsp/... URL or a device.
        out: the pack the memory is published to (as it goes and at the end).
        model, method, budget_tokens, fps, kv_bits, reduce, force, device, dtype: as `encode`.
        questions: asked as the stream goes: a question (answered when it is reached) or a
            (question, moment in seconds) pair; iterate the `Live` for their answers.
        max_new_tokens: the longest answer, in tokens.
        snapshot_every: publish the memory every this many seconds of stream (None: at the end).
        behind: wait or drop frames when the encode falls behind (None: by the source's kind).
        stall: seconds of silence after which the source has ended.
        timeout: seconds to wait for a network source to connect, and for each read.
    """
    from mmkv_cli.api.live import Follow, LiveQuestion
    from mmkv_cli.core.options import GenerationOptions
    from mmkv_cli.media.live import LiveOptions

    options = EncodeOptions(
        **_method_options(method, None, budget_tokens, reduce), kv_bits=kv_bits, force=force
    )
    asked = [
        LiveQuestion(q, id=i) if isinstance(q, str) else LiveQuestion(q[0], id=i, at=q[1])
        for i, q in enumerate(questions)
    ]
    follow = Follow(
        source,
        out,
        options,
        LiveOptions(fps=fps, behind=behind, stall_s=stall, timeout_s=timeout),
        load=LoadOptions(model=model, device=device, dtype=dtype),
        snapshot_every=snapshot_every,
        generation=GenerationOptions(max_new_tokens),
    )
    for question in asked:
        follow.ask(question)
    return Live(follow)
