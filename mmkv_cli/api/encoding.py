"""encode and convert as Python functions: everything refusable refused before a model loads,
then the media read, encoded and written (remote media and packs staged through local files)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mmkv_cli.api.asking import stored_method
from mmkv_cli.api.process import PROCESS_BACKBONES
from mmkv_cli.core import logs
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import EncodeOptions, LoadOptions
from mmkv_cli.core.spec import as_plain
from mmkv_cli.methods.choice import choice_for
from mmkv_cli.pack import PackReader, check_writable, inspect, is_url, local_path
from mmkv_cli.reduce.choice import check_reducer

if TYPE_CHECKING:
    from mmkv_cli.backbones.base import Backbone
    from mmkv_cli.media.base import Media
    from mmkv_cli.pack import QuantSpec

EncodeProgress = Callable[[int, int], None]  # (frames done, visual tokens done)
LOG = logs.get("mmkv_cli.api")  # one name for the verbs, as users filter by it


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
