"""The CLI's verbs as Python functions: encode, ask, and inspect and verify (from
pack/access/report.py; profile lives in profile.py).

Only light modules are imported here: `inspect` of a local pack must not pay for torch. encode and
ask import the model side when they run.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mmkv_cli import logs
from mmkv_cli.ask.result import answer_record  # as `ask --json` prints an answer
from mmkv_cli.backbones.held import HeldBackbones
from mmkv_cli.errors import PackError, UsageError
from mmkv_cli.methods import METHODS
from mmkv_cli.methods.base import ContextPolicy
from mmkv_cli.methods.choice import choice_for
from mmkv_cli.methods.context import WholeContext
from mmkv_cli.options import (
    MAX_QUESTION_CHARS,
    AskOptions,
    EncodeOptions,
    LoadOptions,
    check_ask,
)
from mmkv_cli.pack import (
    PackReader,
    check_writable,
    convert_quant,
    inspect,
    is_url,
    listing,
    local_path,
    verify,
)
from mmkv_cli.reduce.choice import check_reducer
from mmkv_cli.spec import as_plain, override

if TYPE_CHECKING:
    from mmkv_cli.ask.result import Answer
    from mmkv_cli.backbones.base import Backbone
    from mmkv_cli.media.base import Media
    from mmkv_cli.pack import MemoryPack, QuantSpec

__all__ = [
    "EncodeProgress",
    "PackSession",
    "answer_record",
    "ask",
    "check_encode",
    "context_policy",
    "convert",
    "convert_quant",
    "encode",
    "inspect",
    "listing",
    "load_for",
    "pack_model",
    "refuse_input_as_output",
    "stored_method",
    "unload",
    "verify",
]
EncodeProgress = Callable[[int, int], None]  # (frames done, visual tokens done)
# backbones `mmkv.ask` / `mmkv.encode` share across calls in one process (two: a model and another)
PROCESS_BACKBONES = HeldBackbones(2)
LOG = logs.get(__name__)


def encode(
    media: str,
    output: str | Path,
    options: EncodeOptions | None = None,
    *,
    backbone: Backbone | None = None,
    load: LoadOptions | None = None,
    progress: EncodeProgress | None = None,
    on_start: Callable[[int, int], None] | None = None,
    shown_as: str | None = None,
    shared: bool = False,
) -> dict:
    """Encode `media` into a .kvpack at `output`; returns a summary (the inspect view plus
    timings). Either may be a URL (s3://...): remote media is downloaded first, a remote pack is
    written here and published whole. shown_as: the media's name in the pack (its URL). shared:
    the backbone from the process's held ones (loaded there once)."""
    options = options or EncodeOptions()
    if is_url(output) or is_url(media):
        remote = (backbone, load, progress, on_start, shared)
        return _encode_remote(media, str(output), options, *remote)
    from mmkv_cli.backbones import reuse_families, tower_families
    from mmkv_cli.media import media_kind

    output = local_path(output)
    quant, choice = _checked_before_loading(media, output, options)  # before torch loads
    if backbone is None:
        from mmkv_cli.backbones.spec import check_available, load_model_spec

        check_available((load or LoadOptions()).model)  # without torch: under a second
        preset = load_model_spec((load or LoadOptions()).model or "")
        if preset is not None and preset.family is not None:
            check_reducer(
                choice.reduce, media_kind(media), preset.family, tower_families(), reuse_families()
            )
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.encode.checkpoint import Checkpointing
    from mmkv_cli.encode.encoder import encode_media
    from mmkv_cli.encode.record import EarlyWrite, encode_identity, write_encoded
    from mmkv_cli.media import load_media
    from mmkv_cli.methods import EncodeContext

    if backbone is None and shared:
        backbone = _shared_for_encode(load)
    backbone = backbone or load_backbone(load)  # encode_media checks the reducer on its family
    kv = backbone.kv_shape()
    quant.check(kv["kv_heads"], kv["head_dim"])  # and against this model's width
    fps = options.fps if options.fps is not None else backbone.spec.fps
    max_frames = options.max_frames if options.max_frames is not None else backbone.spec.max_frames
    source = load_media(media, fps=fps, max_frames=max_frames)
    source.source = shown_as or source.source
    taken = thinned(source, max_frames, options.max_frames is not None)
    if on_start:
        on_start(source.num_frames, source.frames_offered)
    context = EncodeContext(source.kind, options.guidance_prompt)
    budget = choice.budget.label() if choice.budget else "its defaults"
    LOG.info(
        "encoding %s (%s, %d frames) with %s at %s", media, source.kind, source.num_frames,
        choice.name, budget,
    )  # fmt: skip
    identity = encode_identity(backbone, choice, source, options.guidance_prompt, fps, max_frames)
    checkpoint = Checkpointing.open(output, options.checkpoint_every, options.resume, identity)
    # where the method keeps every token as prefilled, the pack is written while encoding
    early = EarlyWrite(output, backbone, choice, context, source, quant, options.force)
    encoded = encode_media(backbone, source, choice, context, progress, checkpoint, early=early)
    write_encoded(output, backbone, choice, context, source, encoded, quant, options.force)
    checkpoint.remove()  # the pack is whole: the state it was saved for is done
    return {**inspect(output), **encoded.stats, **taken}


def thinned(source: Media, max_frames: int, asked: bool) -> dict:
    """What the summary says of the frames an encode took when it took fewer than the media offers
    (evenly spaced, to `max_frames`: the user's --max-frames, or the model's own)."""
    if source.frames_offered <= source.num_frames:
        return {}
    by = "option" if asked else "model"
    return {"frames_offered": source.frames_offered, "max_frames": max_frames, "max_frames_by": by}


def check_encode(media: str, output: str | Path, options: EncodeOptions) -> None:
    """What an encode to a local output refuses before any model loads (a client checks this
    before handing the encode to a server)."""
    _checked_before_loading(media, local_path(output), options)


def _shared_for_encode(load: LoadOptions | None) -> Backbone:
    return PROCESS_BACKBONES.get(load or LoadOptions())


def unload() -> None:
    """Let go of the backbones this process holds for `shared` calls (their memory is freed once
    nothing else refers to them)."""
    PROCESS_BACKBONES.clear()


def _checked_before_loading(media: str, output: Path, options: EncodeOptions):
    """Everything an encode can refuse before the model loads: the bits and group, the output
    (writable, not the media, no checkpoint it would overwrite), the method, budget and guidance.
    Returns (the quantization, the method chosen)."""
    from mmkv_cli.backbones import reuse_families, tower_families
    from mmkv_cli.encode.checkpoint import Checkpointing
    from mmkv_cli.media import check_media, media_kind
    from mmkv_cli.pack import QuantSpec

    choice = choice_for(options)
    quant = QuantSpec(options.bits_for(choice.method), options.kv_group)
    quant.check(1, 8)  # the bits and group alone, before the model loads
    if options.fps is not None and not (math.isfinite(options.fps) and options.fps > 0):
        raise UsageError(f"--fps must be a positive number, not {options.fps}")
    if options.max_frames is not None and options.max_frames < 0:
        raise UsageError(f"--max-frames must be >= 0, not {options.max_frames}")
    refuse_input_as_output(media, output)
    check_writable(output, options.force)  # fail before any expensive work
    Checkpointing.refuse_overwrite(output, options.checkpoint_every, options.resume)
    check_media(media)  # after the method: a preset is checked even without media
    check_reducer(
        choice.reduce, media_kind(media), None, tower_families(), reuse_families()
    )  # the media kind
    return quant, choice


def _encode_remote(media, output, options, backbone, load, progress, on_start, shared) -> dict:
    """encode with remote media, or a remote output, staged through local temporary files."""
    from contextlib import nullcontext

    from mmkv_cli.pack import local_copy, staged_upload

    if is_url(output) and (options.checkpoint_every or options.resume):
        raise UsageError(
            "--checkpoint-every and --resume need a local output (checkpoints sit beside it)"
        )
    fetched = local_copy(media) if is_url(media) else nullcontext(local_path(media))
    staged = staged_upload(output, options.force) if is_url(output) else nullcontext(output)
    with staged as target, fetched as local_media:
        done = encode(
            str(local_media),
            target,
            options,
            backbone=backbone,
            load=load,
            progress=progress,
            on_start=on_start,
            shown_as=media,
            shared=shared,
        )
    return {**done, "path": output}


def refuse_input_as_output(media: str, output: Path) -> None:
    """The output may not be the media, nor any image of a folder or glob being encoded: the same
    file by inode (a hard link, a symlink to it), not only by name. --force never overrides this."""
    from mmkv_cli.media.stills import image_paths

    if not output.exists():
        return
    inputs = [Path(media)] if Path(media).is_file() else image_paths(media)
    for source in inputs:
        try:
            same = os.path.samefile(source, output)
        except OSError:
            continue
        if same:
            raise UsageError(f"{output} is the media being encoded ({source}): pick another output")


def convert(
    source: str | Path,
    output: str | Path,
    quant: QuantSpec | None = None,
    start: float | None = None,
    stop: float | None = None,
    force: bool = False,
) -> dict:
    """`mmkv convert`: `source`'s KV re-stored at other bits (None: as stored), only the blocks in
    [start, stop], written atomically to `output` (pack/access/convert.py); the method's
    parameters are checked against its class and written as the current format stores them."""
    from mmkv_cli.pack import convert as convert_pack

    def params(reader: PackReader) -> dict:
        return as_plain(stored_method(reader)[1])

    return convert_pack(source, output, quant, start, stop, force, params)


def context_policy(reader: PackReader) -> ContextPolicy:
    """The context policy of the method a pack names, with the parameters it was encoded with."""
    chosen, params = stored_method(reader)
    return chosen.context(params) if chosen.context is not None else WholeContext()


def stored_method(reader: PackReader):
    """(the method a pack names, its typed parameters as the pack stores them)."""
    record = reader.header.method
    if record.in_code not in METHODS:
        raise PackError(f"{reader.path} names an unknown method '{record.in_code}'")
    chosen = METHODS[record.in_code]
    try:
        if record.params_exact:
            return chosen, override(chosen.params(), record.params, "method.params")
        # older packs kept other keys beside the parameters: apply those that still fit
        params = chosen.params()
        for key, value in record.params.items():
            try:
                params = override(params, {key: value}, "method.params")
            except UsageError:
                continue
        return chosen, params
    except UsageError as err:
        raise PackError(f"{reader.path}: {err}") from None


def pack_model(reader: PackReader) -> str:
    """The model a pack names, when it may be loaded on the pack's word: a preset known here, or a
    hub id already on this machine. Never a path (a stranger's pack must not point `ask` at any
    checkpoint or file here), nor a download: --model chooses either explicitly."""
    from mmkv_cli.backbones.spec import HUB_ID, in_hub_cache, model_names

    named = reader.header.fingerprint.model
    if isinstance(named, str) and named in model_names():
        return named
    if isinstance(named, str) and HUB_ID.fullmatch(named) and not Path(named).exists():
        if in_hub_cache(named):
            return named
        raise PackError(
            f"{reader.path} names the hub model '{named}', which is not on this machine: pass "
            f"--model {named} to download and use it (or --model with another checkpoint)"
        )
    raise PackError(
        f"{reader.path} names the model {str(named)[:80]!r}, which is neither a preset here nor a "
        "hub id: pass --model to choose the checkpoint"
    )


def load_for(reader: PackReader, load: LoadOptions) -> LoadOptions:
    """How to load the backbone that answers from `reader`: `load`'s model, else the pack's own. A
    rehearsal model is built at the depth the pack records (a CPU bench cuts it); a checkpoint's
    depth is its own, and ignores it. Refused before anything is built when the model's config
    makes KV of another shape than the pack holds."""
    from mmkv_cli.backbones.loading import planned_kv

    layers = load.layers or reader.header.kv.layers
    chosen = replace(load, model=load.model or pack_model(reader), layers=layers)
    planned, kv = planned_kv(chosen), reader.header.kv
    if planned is not None and (planned["kv_heads"], planned["head_dim"], planned["layers"]) != (
        kv.kv_heads,
        kv.head_dim,
        kv.layers,
    ):
        raise PackError(
            f"{reader.path} holds KV of {kv.layers} layers x {kv.kv_heads} heads x {kv.head_dim}, "
            f"and model '{chosen.model}' makes {planned['layers']} layers x {planned['kv_heads']} "
            f"heads x {planned['head_dim']}: ask with the model that encoded it (--model)"
        )
    return chosen


class PackSession:
    """One pack opened, its context policy built and its backbone loaded, for many questions: the
    process pays for torch and the model once, not per question."""

    def __init__(
        self,
        pack: str | Path | PackReader | MemoryPack,
        *,
        backbone: Backbone | None = None,
        load: LoadOptions | None = None,
        shared: bool = False,
    ):
        """shared: take the backbone from the process's held ones (`PROCESS_BACKBONES`), loading it
        there once for every later session (Python's `mmkv.ask` in a loop)."""
        from mmkv_cli.pack import check_askable

        # the pack first: a missing or broken one is refused before torch is imported
        self.reader = PackReader(pack) if isinstance(pack, str | Path) else pack
        check_askable(self.reader.header, str(self.reader.path))
        self.policy = context_policy(self.reader)
        if backbone is None:
            from mmkv_cli.backbones.loading import load_backbone

            chosen = load_for(self.reader, load or LoadOptions())
            backbone = PROCESS_BACKBONES.get(chosen) if shared else load_backbone(chosen)
        self.backbone = backbone
        self._fetched = 0  # the remote pack's bytes already charged to a question (none yet)

    @property
    def media_kind(self) -> str:
        """What the pack was made from: video, images or document (how its blocks are shown)."""
        return self.reader.header.media.kind

    def turn_tokens(self, turns: tuple[tuple[str, str], ...]) -> int:
        """How many tokens earlier (question, answer) turns take in this model's prompt."""
        return len(self.backbone.turns_ids(turns))

    def close(self) -> None:
        """Let go of the pack's file (a memory pack holds none)."""
        if isinstance(self.reader, PackReader):
            self.reader.source.close()

    def ask(
        self,
        question: str,
        options: AskOptions | None = None,
        on_token: Callable[[str], None] | None = None,
    ) -> Answer:
        """Answer `question` from the pack alone; the media is never read again.

        options.at: the question's moment (seconds, or the index of an image or page): only blocks
        whose every frame was shown by then count (a block spanning it is left out whole).
        options.prune: a method that prunes the context's visual KV by the question's attention
        before decoding, keeping options.prune_budget of it.
        """
        from mmkv_cli.ask.answer import answer_from_pack
        from mmkv_cli.ask.prune import ask_pruner

        options = options or AskOptions()
        check_ask(options)
        try:
            question.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the question is not valid UTF-8 text") from None
        if len(question) > MAX_QUESTION_CHARS:  # chat and serve too, not only ask's files
            raise UsageError(f"the question is longer than {MAX_QUESTION_CHARS} characters")
        pruner = ask_pruner(options.prune, options.prune_budget) if options.prune else None
        before = self.reader.bytes_read
        answer = answer_from_pack(
            self.backbone, self.reader, self.policy, question, options, pruner, on_token
        )
        answer.bytes_read = self.reader.bytes_read - before  # this question's reads only
        if LOG.isEnabledFor(logging.DEBUG):  # the phases are joined only when shown
            LOG.debug(
                "answered from %d blocks, %d context tokens: ttft %.3f s (%s), %d bytes read",
                len(answer.blocks_used), answer.context_tokens, answer.ttft_s,
                ", ".join(f"{k} {v:.3f}" for k, v in answer.phases_s.items()), answer.bytes_read,
            )  # fmt: skip
        fetched = self.reader.fetched or 0
        answer.bytes_fetched, self._fetched = fetched - self._fetched, fetched
        return answer


def ask(
    pack: str | Path,
    question: str,
    options: AskOptions | None = None,
    *,
    backbone: Backbone | None = None,
    load: LoadOptions | None = None,
    on_token: Callable[[str], None] | None = None,
) -> Answer:
    """One question: a PackSession used once."""
    return PackSession(pack, backbone=backbone, load=load).ask(question, options, on_token)
