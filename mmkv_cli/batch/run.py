"""One batch item, start to finish, on a worker that holds one backbone: name the pack by its
content, skip it when it is there, otherwise encode and publish it. Whatever goes wrong becomes a
ledger row with one error line; only an interrupt stops the worker."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from mmkv_cli.batch.manifest import BatchItem
from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.names import stem_from
from mmkv_cli.core.options import EncodeOptions, LoadOptions
from mmkv_cli.core.spec import as_plain
from mmkv_cli.pack import exists, is_url, local_copy, local_path


@dataclass(frozen=True)
class BatchSettings:
    """What every item shares: the backbone, the encode options rows override, the packs' home."""

    load: LoadOptions
    options: EncodeOptions
    dest: str  # a folder or a URL prefix

    def options_for(self, item: BatchItem) -> EncodeOptions:
        return replace(self.options, **item.options)

    def target(self, name: str) -> str:
        return f"{self.dest.rstrip('/')}/{name}"


def check_items(items: list[BatchItem], settings: BatchSettings) -> None:
    """Every row's options checked (method, budget, bits, sampling) before any model loads."""
    from mmkv_cli.methods.choice import choice_for
    from mmkv_cli.pack import QuantSpec

    checked = set()
    for item in items:
        options = settings.options_for(item)
        if options in checked:
            continue
        where = item.where or "options"
        try:
            choice = choice_for(options)
            QuantSpec(options.bits_for(choice.method), options.kv_group).check(1, 8)
            if options.fps is not None and not (math.isfinite(options.fps) and options.fps > 0):
                raise UsageError(f"fps must be positive, got {options.fps}")
            if options.max_frames is not None and options.max_frames < 0:
                raise UsageError(f"max_frames must be 0 or more, got {options.max_frames}")
        except UsageError as err:
            raise UsageError(f"{where}: {err}") from None
        checked.add(options)


def pack_name(media: str, digest: str, fingerprint: dict, options: EncodeOptions, spec) -> str:
    """STEM-HASH.kvpack, HASH over everything that makes the pack what it is: the media's bytes,
    the model's fingerprint, the method with its parameters and budget, the sampling and the bits.
    Two runs that would write the same pack name it the same; any change names another."""
    from mmkv_cli.methods.choice import choice_for

    choice = choice_for(options)
    bits = options.bits_for(choice.method)
    identity = {
        "media": digest,
        "model": [fingerprint.get(k) for k in ("family", "config_sha256", "weights_sha256")],
        "method": choice.name,
        "params": as_plain(choice.params),
        "budget": None if choice.budget is None else [choice.budget.share, choice.budget.tokens],
        "guidance_prompt": options.guidance_prompt,
        "fps": options.fps if options.fps is not None else spec.fps,
        "max_frames": options.max_frames if options.max_frames is not None else spec.max_frames,
        "kv": [bits, options.kv_group if bits < 16 else None],
    }
    if choice.reduce is not None:  # only then: the names of packs made before reducers stay
        identity["reduce"] = choice.reduce.record()
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    stem = stem_from(Path(media.rstrip("/").rsplit("/", 1)[-1]).stem)  # a name, whatever the file's
    return f"{stem}-{key[:16]}.kvpack"


class BatchWorker:
    """Holds one backbone and runs items on it (in-process, or as a Ray actor)."""

    def __init__(self, settings: BatchSettings):
        from mmkv_cli.backbones.loading import load_backbone

        self.settings = settings
        self.backbone = load_backbone(settings.load)
        self.fingerprint = self.backbone.fingerprint()
        self.host = f"{socket.gethostname()}:{os.getpid()}"

    def run(self, item: BatchItem, known: dict | None = None) -> dict:
        """known: what the ledger learnt of this media before ({"version", "digest"}): when the
        media is unchanged its digest is reused, so a rerun neither downloads nor hashes it."""
        started = time.perf_counter()
        row = {"media": item.media, "id": item.id, "worker": self.host}
        try:
            row.update(self._run(item, known or {}, row))
        except MmkvError as err:
            row.update(status="failed", error=str(err))
        except OSError as err:  # a failing disk or mount, a link loop: the media, not mmkv
            row.update(status="failed", error=f"cannot read {item.media}: {err.strerror or err}")
        except Exception as err:  # one bad video never stops the batch: it is this row's error
            line = (str(err).strip().splitlines() or [""])[0][:300]
            row.update(status="failed", error=f"{type(err).__name__}: {line}")
        row["seconds"] = round(time.perf_counter() - started, 3)
        row["at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        return row

    def _name(self, item: BatchItem, digest: str) -> tuple[str, str]:
        options = self.settings.options_for(item)
        name = pack_name(item.media, digest, self.fingerprint, options, self.backbone.spec)
        return name, self.settings.target(name)

    def _run(self, item: BatchItem, known: dict, row: dict) -> dict:
        from mmkv_cli import api
        from mmkv_cli.media.base import sha256_files

        row["media_version"] = media_version(item.media)
        if known.get("version") == row["media_version"] and known.get("digest"):
            row["media_digest"] = known["digest"]
            _, target = self._name(item, known["digest"])
            if _present(target):
                return {"status": "skipped", "pack": target, "bytes": _size(target)}
        fetched = local_copy(item.media) if is_url(item.media) else nullcontext(Path(item.media))
        with fetched as media:
            row["media_digest"] = sha256_files([media])
            _, target = self._name(item, row["media_digest"])
            if _present(target):
                return {"status": "skipped", "pack": target, "bytes": _size(target)}
            done = api.encode(
                str(media),
                target,
                replace(self.settings.options_for(item), force=False),
                backbone=self.backbone,
                shown_as=item.media,
            )
        return {
            "status": "ok",
            "pack": target,
            "bytes": done["bytes"],
            "frames": done["media"]["frames"],
            "encode_s": done.get("encode_s"),
        }


def media_version(media: str) -> str:
    """What changes when the media does: size and modification time (an object's ETag)."""
    if is_url(media):
        from mmkv_cli.pack import filesystem

        fs, key = filesystem(media)
        try:
            info = fs.info(key)
        except FileNotFoundError:
            raise MmkvError(f"no such media: {media}") from None
        return f"{info.get('size')}:{info.get('ETag') or info.get('mtime') or ''}"
    try:
        stat = Path(media).stat()
    except OSError:
        raise MmkvError(f"no such media: {media}") from None
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _present(target: str) -> bool:
    return exists(target) if is_url(target) else local_path(target).is_file()


def _size(target: str) -> int:
    if not is_url(target):
        return local_path(target).stat().st_size
    from mmkv_cli.pack import filesystem

    fs, key = filesystem(target)
    return int(fs.size(key))
