"""What an encode records about itself: the pack's typed header (built once, here), the pack it
writes, and the identity a checkpoint is bound to."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmkv_cli import __version__
from mmkv_cli.core import logs
from mmkv_cli.core.spec import as_plain
from mmkv_cli.pack import (
    BlockShape,
    EarlyPack,
    Fingerprint,
    KVShape,
    LayoutRecord,
    MediaRecord,
    MethodRecord,
    PackHeader,
    PromptRecord,
    QuantSpec,
    Span,
    write_pack,
)

LOG = logs.get(__name__)

if TYPE_CHECKING:
    from mmkv_cli.backbones.base import Backbone
    from mmkv_cli.encode.results import Encoded
    from mmkv_cli.media.base import Media
    from mmkv_cli.methods import EncodeContext
    from mmkv_cli.methods.choice import MethodChoice


def method_record(choice: MethodChoice, guidance_prompt: str | None) -> MethodRecord:
    """The method as chosen: its name, the method in code, the budget asked for, the parameters."""
    budget = choice.budget
    return MethodRecord(
        name=choice.name,
        implements=choice.method.name,
        budget=None if budget is None or budget.tokens is not None else budget.share,
        budget_tokens=None if budget is None else budget.tokens,
        params=as_plain(choice.params),
        guidance_prompt=guidance_prompt,
        reduce=choice.reduce.record() if choice.reduce is not None else None,
    )


def pack_header(
    backbone: Backbone,
    choice: MethodChoice,
    context: EncodeContext,
    media: Media,
    encoded: Encoded,
) -> tuple[PackHeader, dict[str, list]]:
    """The pack's header, and the lists that grow with the video (stored as tensors)."""
    described = media.describe()
    layout = dict(encoded.layout)
    series = {
        "media.timestamps": described.pop("timestamps"),
        "layout.step_lengths": layout.pop("step_lengths"),
    }
    stats = {k: round(v, 4) if isinstance(v, float) else v for k, v in encoded.stats.items()}
    header = PackHeader(
        kv=KVShape(**backbone.kv_shape(), per_head=encoded.per_head),
        fingerprint=Fingerprint.stored(backbone.fingerprint()),
        method=method_record(choice, context.guidance_prompt),
        media=MediaRecord.stored(described),
        prompt=PromptRecord.stored(backbone.prompt.as_dict()),
        layout=LayoutRecord.stored(layout),
        rotary=backbone.rotary(),
        visual_tokens_total=encoded.visual_tokens_total,
        stats=stats,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        mmkv_version=__version__,
    )
    return header, series


def write_encoded(
    path,
    backbone: Backbone,
    choice: MethodChoice,
    context: EncodeContext,
    media: Media,
    encoded: Encoded,
    quant: QuantSpec | None = None,
    force: bool = False,
) -> int:
    """An encode's result (a file's, or a live stream's memory) as a pack at `path`, written
    atomically; returns its size in bytes."""
    try:
        header, series = pack_header(backbone, choice, context, media, encoded)
    except BaseException:
        if encoded.early is not None:  # its writer stopped, its partial file removed
            encoded.early.abandon()
        raise
    prefix, suffix, space = encoded.prefix, encoded.suffix, encoded.representatives
    if encoded.early is not None:  # its blocks written while encoding: the rest now
        size = encoded.early.finish(header, prefix, suffix, space, series)
        blocks = len(encoded.early.blocks)
    else:
        size = write_pack(
            path, header, prefix, encoded.blocks, suffix, force, quant, space, series=series
        )
        blocks = len(encoded.blocks)
    LOG.info("wrote %s: %d blocks, %d bytes", path, blocks, size)
    return size


@dataclass(frozen=True)
class EarlyWrite:
    """An encode's pack, to be written while the encode runs where its method allows
    (encoder.EarlyTarget): what its header needs besides the encode's result."""

    path: Path
    backbone: Backbone
    choice: MethodChoice
    context: EncodeContext
    media: Media
    quant: QuantSpec | None = None
    force: bool = False

    def open(self, provisional: Encoded, shapes: list[BlockShape], first: Span) -> EarlyPack:
        header, series = pack_header(
            self.backbone, self.choice, self.context, self.media, provisional
        )
        return EarlyPack(
            self.path, header, provisional.prefix, shapes, first, provisional.suffix,
            force=self.force, quant=self.quant, reps_space=provisional.representatives,
            series=series,
        )  # fmt: skip


def encode_identity(
    backbone: Backbone,
    choice: MethodChoice,
    media: Media,
    guidance_prompt: str | None,
    fps: float,
    max_frames: int,
) -> dict:
    """Everything that makes an encode's saved state this encode's (a checkpoint is bound to it)."""
    fingerprint = backbone.fingerprint()
    identity = {
        "media": media.digest,
        "frames": media.num_frames,
        "model": [fingerprint.get(k) for k in ("family", "config_sha256", "weights_sha256")],
        "method": choice.name,
        "params": as_plain(choice.params),
        "budget": None if choice.budget is None else [choice.budget.share, choice.budget.tokens],
        "guidance_prompt": guidance_prompt,
        "fps": fps,
        "max_frames": max_frames,
    }
    if choice.reduce is not None:  # only then: checkpoints made before reducers still resume
        identity["reduce"] = choice.reduce.record()
    return identity
