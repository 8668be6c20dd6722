"""Resumable encodes: every N chunks the streaming state is saved beside the output, atomically;
`encode --resume` continues from it and writes the pack an uninterrupted run would.

A checkpoint is safetensors files (no pickle). What does not change while it is needed (the running
cache's pristine entries, by stream index; ReKV's offloaded KV; MuKV's finished blocks and their
rows: see saved_state.py) is written once, each save adding a segment `.NAME.mmkv-checkpoint.seg-N`
with what is new since the last; the rest (entries a policy rewrote, the policy's own state, the
archive's part of a piece not yet whole) is rewritten in the head `.NAME.mmkv-checkpoint` at every
save. Rewriting everything made an encode's checkpoint writes grow with the square of its length
(bench/checkpoint_writes.py measures them). What the state stops needing (a
sliding window's old pieces) stays in its segment until the stale bytes outweigh the needed ones;
then the needed ones are written into one new segment and the old segments go, so the files stay
under twice the state between saves (three times while a save compacts). The head's metadata holds
what the encode is (media digest, model fingerprint, method, parameters, budget, sampling, stored
bits), how far it got, and each segment's number and one digest binding its tensor names, rows and
bytes; a segment's names and rows live in the segment, so the head stays a few KB however long the
encode. A checkpoint of another encode is refused, never mixed in; one whose bytes do not match
their digests is refused too. It is removed once the pack is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack import sweep_stale, tensors_digest

SUFFIX = ".mmkv-checkpoint"
FORMAT, VERSION = "mmkv.checkpoint", 5  # 3: what never changes is written once, in segments;
# 4: so are the running cache's entries no splice rewrote; 5: segments hold their names and rows,
# the running cache is sealed by stream index in pieces cut at each save, segments are compacted
META = "mmkv_checkpoint"
SEGMENT = ".seg-"
DIGEST = re.compile(r"[0-9a-f]{64}")


def checkpoint_path(output: Path) -> Path:
    return output.parent / f".{output.name}{SUFFIX}"


def segment_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.name}{SEGMENT}{number}")


@dataclass(frozen=True)
class Sealed:
    """A tensor a checkpoint writes once: made only when it is written, and what it would weigh
    now (a piece of the running cache loses rows as the policy evicts: what it was written with
    beyond that is stale)."""

    make: Callable[[], torch.Tensor]
    nbytes: int


def held(tensor: torch.Tensor) -> Sealed:
    """A tensor that exists already, as Sealed."""
    return Sealed(lambda: tensor, tensor.nbytes)


@dataclass
class Restored:
    """What a resume starts from: the last save's progress, every tensor saved (head and
    segments), and the rows the segments carry, in the order they were saved."""

    progress: dict
    tensors: dict[str, torch.Tensor]
    rows: list


@dataclass
class Checkpointing:
    """One encode's checkpoints: where, how often, what encode they belong to, what a resume
    starts from (or None), the segments saved so far and the tensor names they hold."""

    path: Path
    every: int  # chunks between saves (0: never save)
    identity: dict
    restored: Restored | None = None
    segments: list[dict] = field(default_factory=list)  # {"number", "sha256"}, in order
    written: dict[str, int] = field(default_factory=dict)  # the segments' tensors: bytes each
    rows: list = field(default_factory=list)  # every save's rows so far, in order

    @classmethod
    def open(cls, output: Path, every: int, resume: bool, identity: dict) -> Checkpointing:
        if every < 0:
            raise UsageError("--checkpoint-every must be 0 (never) or a number of chunks")
        cls.refuse_overwrite(output, every, resume)
        path = checkpoint_path(output)
        if not (resume and path.exists()):
            return cls(path, every, identity)
        restored, segments, written = load(path, identity)
        return cls(path, every, identity, restored, segments, written, list(restored.rows))

    @staticmethod
    def refuse_overwrite(output: Path, every: int, resume: bool) -> None:
        """An interrupted encode's checkpoint is not overwritten by a new checkpointing encode
        that was not asked to resume it (checked before the model loads)."""
        path = checkpoint_path(output)
        if not resume and every and path.exists():
            raise UsageError(
                f"{path} holds an interrupted encode of {output}: pass --resume to continue it, "
                "or delete it to start over"
            )

    def take_restored(self) -> Restored | None:
        """What a resume starts from, handed over once: held here for the whole encode, the
        loaded checkpoint (at an hour of video, GBs) would outlive every tensor made from it."""
        restored, self.restored = self.restored, None
        return restored

    def due(self, chunks_done: int) -> bool:
        return self.every > 0 and chunks_done % self.every == 0

    def save(
        self,
        progress: dict,
        live: dict[str, torch.Tensor],
        sealed: dict[str, Sealed],
        rows: list | None = None,
    ) -> None:
        """Save the state. `sealed`: every tensor the state needs whose name, while it is needed,
        stands for the same rows (a piece may lose rows, never gain or change one); those not
        written yet go to a new segment. `rows`: JSON records made since the last save (a resume
        gets every save's, in order). `live`: the rest, rewritten in the head.
        When the segments' stale bytes (tensors no longer needed, rows evicted since) outweigh
        what is needed, everything needed is written again into one segment and the old ones go:
        the checkpoint stays under twice the state, and the writes stay linear in the stream."""
        rows = rows or []
        needed = sum(s.nbytes for s in sealed.values())
        held_now = sum(sealed[name].nbytes for name in self.written if name in sealed)
        stale = sum(self.written.values()) - held_now
        compact = stale > needed
        keep = [] if compact else list(self.segments)
        written = {} if compact else {n: b for n, b in self.written.items() if n in sealed}
        new = {name: s.make() for name, s in sealed.items() if name not in written}
        segment_rows = self.rows + rows if compact else rows
        if new or segment_rows:
            number = max((s["number"] for s in self.segments), default=-1) + 1
            found = segment_path(self.path, number)
            tensors_digest = _write(found, self.path, new, {"rows": segment_rows})
            digest = _segment_digest(sorted(new), segment_rows, tensors_digest)
            keep.append({"number": number, "sha256": digest})
        meta = {"format": FORMAT, "version": VERSION, "identity": self.identity}
        _write(self.path, self.path, live, {**meta, "progress": progress, "segments": keep})
        self.segments, self.rows = keep, self.rows + rows
        self.written = (self.written if not compact else {}) | {
            name: t.nbytes for name, t in new.items()
        }
        _sweep_segments(self.path, keep={s["number"] for s in keep})  # unlisted: dead or killed

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        _sweep_segments(self.path, keep=set())


def _write(target: Path, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Write `tensors` to `target` atomically (a partial file beside it, fsynced, renamed into
    place), with `meta` (and the tensors' digest) as its metadata; the digest."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    plain = _writable(tensors)
    digest = tensors_digest(list(plain.values()), "sha256")
    sweep_stale(path, path.name, ".part")  # partial checkpoints of killed encodes
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        metadata = {META: json.dumps({**meta, "sha256": digest}, sort_keys=True)}
        save_file(plain, str(partial), metadata=metadata)
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, target)
    except (OSError, SafetensorError) as err:
        partial.unlink(missing_ok=True)
        raise PackError(f"cannot write the checkpoint {target}: {err}") from None
    return digest


def _segment_digest(names: list[str], rows: list, tensors_digest: str) -> str:
    """The digest the head lists for a segment: its tensor names, rows and bytes together (a
    segment's own metadata is not otherwise covered)."""
    record = {"names": names, "rows": rows, "sha256": tensors_digest}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _sweep_segments(path: Path, keep: set[int]) -> None:
    """Remove the segments of `path` whose number is not in `keep`."""
    start = f"{path.name}{SEGMENT}"
    for found in path.parent.iterdir():
        number = found.name[len(start) :] if found.name.startswith(start) else ""
        if number.isdigit() and int(number) not in keep:
            found.unlink(missing_ok=True)


def _writable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors writes them (contiguous, host, no storage shared), copying only
    those that are not: an hour's archive written in place, not cloned whole at every save."""
    out, storages = {}, set()
    for name, tensor in sorted(tensors.items()):
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if not tensor.is_contiguous() or storage in storages:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            storage = tensor.untyped_storage().data_ptr()
        storages.add(storage)
        out[name] = tensor
    return out


def load(path: Path, identity: dict) -> tuple[Restored, list[dict], dict[str, int]]:
    """What the checkpoint at `path`, made by the encode `identity` names, restores (its head's
    tensors and every segment's, and the segments' rows), its segments and the bytes of each
    tensor they hold; each file is checked against its digest."""
    meta, tensors = _read(path)
    if meta.get("format") != FORMAT:
        raise PackError(f"{path} is not an mmkv checkpoint")
    if meta.get("version") != VERSION:
        raise UsageError(
            f"{path} was saved by another mmkv version (checkpoint v{meta.get('version')}, this "
            f"one reads v{VERSION}): resume with that version, or delete it to start over"
        )
    if meta.get("identity") != identity:
        theirs = meta.get("identity") if isinstance(meta.get("identity"), dict) else {}
        changed = [k for k in identity if theirs.get(k) != identity[k]] or ["unknown"]
        raise UsageError(
            f"{path} is the checkpoint of another encode ({', '.join(changed)} differ): delete "
            "it, or encode without --resume"
        )
    progress, segments = meta.get("progress"), meta.get("segments")
    if not isinstance(progress, dict) or not _segment_list(segments):
        raise PackError(f"{path} is corrupted (no progress or segment list)")
    rows, written = [], {}
    for segment in segments:
        found = segment_path(path, segment["number"])
        if not found.exists():
            raise PackError(f"{path} is incomplete: its segment {found.name} is missing")
        part_meta, part = _read(found)
        part_rows = part_meta.get("rows")
        if not isinstance(part_rows, list) or segment["sha256"] != _segment_digest(
            sorted(part), part_rows, part_meta["sha256"]
        ):
            raise PackError(f"{found} is not the segment {path} lists")
        if part.keys() & tensors.keys():
            raise PackError(f"{path} is corrupted (a tensor saved twice)")
        tensors |= part
        rows += part_rows
        written |= {name: t.nbytes for name, t in part.items()}
    return Restored(progress, tensors, rows), segments, written


def _segment_list(segments) -> bool:
    return isinstance(segments, list) and all(
        isinstance(s, dict)
        and isinstance(s.get("sha256"), str)
        and DIGEST.fullmatch(s["sha256"])
        and type(s.get("number")) is int
        and s["number"] >= 0
        for s in segments
    )


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """One checkpoint file's metadata and tensors, its tensors checked against its digest."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get(META, "null"))
            tensors = {name: fh.get_tensor(name) for name in sorted(fh.keys())}
    except (OSError, SafetensorError, ValueError, RecursionError) as err:
        raise PackError(f"{path} is not a readable checkpoint ({type(err).__name__})") from None
    if not isinstance(meta, dict):
        raise PackError(f"{path} is not an mmkv checkpoint this version reads")
    if tensors_digest(list(tensors.values()), "sha256") != meta.get("sha256"):
        raise PackError(f"{path} is corrupted (checksum mismatch)")
    return meta, tensors
