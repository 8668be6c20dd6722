"""Resumable encodes: every N chunks the streaming state is saved beside the output, atomically;
`encode --resume` continues from it and writes the pack an uninterrupted run would.

A checkpoint is safetensors files (no pickle). What only grows and never changes once made (the
running cache's entries no policy rewrote, all of `full`'s; ReKV's offloaded KV; each in whole
pieces; MuKV's finished blocks and their rows) is written once, each save adding a segment
`.NAME.mmkv-checkpoint.seg-N` with what is new since the last; the rest (the running cache's
rewritten part, the policy's own state, the tails of less than a piece) is rewritten in the head
`.NAME.mmkv-checkpoint` at every save. Rewriting everything made an encode's checkpoint writes
grow with the square of its length: an hour of ReKV or `full` at 7B (20 GB, 90 saves) wrote about
900 GB. The head's metadata holds what the encode is (media digest, model fingerprint, method,
parameters, budget, sampling, stored bits), how far it got, and one digest per segment binding
its tensor names, rows and bytes; a segment's names and rows live in the segment, so the head
stays a few KB however long the encode. A checkpoint of another encode is refused, never mixed
in; one whose bytes do not match their digests is refused too. It is removed once the pack is
written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mmkv_cli.errors import PackError, UsageError
from mmkv_cli.lazy import torch
from mmkv_cli.methods import archive
from mmkv_cli.methods.archive import Archive
from mmkv_cli.pack.format import Span, tensors_sha256
from mmkv_cli.pack.writer import sweep_stale

SUFFIX = ".mmkv-checkpoint"
FORMAT, VERSION = "mmkv.checkpoint", 5  # 3: what never changes is written once, in segments;
# 4: so are the running cache's entries no splice rewrote; 5: segments hold their names and rows
META = "mmkv_checkpoint"
SEGMENT = ".seg-"
DIGEST = re.compile(r"[0-9a-f]{64}")


def checkpoint_path(output: Path) -> Path:
    return output.parent / f".{output.name}{SUFFIX}"


def segment_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.name}{SEGMENT}{number}")


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
    segments: list[str] = field(default_factory=list)  # each segment's digest, in order
    sealed: set[str] = field(default_factory=set)  # the names the segments hold

    @classmethod
    def open(cls, output: Path, every: int, resume: bool, identity: dict) -> Checkpointing:
        if every < 0:
            raise UsageError("--checkpoint-every must be 0 (never) or a number of chunks")
        cls.refuse_overwrite(output, every, resume)
        path = checkpoint_path(output)
        if not (resume and path.exists()):
            return cls(path, every, identity)
        restored, segments, sealed = load(path, identity)
        return cls(path, every, identity, restored, segments, sealed)

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
        sealed: dict[str, torch.Tensor],
        rows: list | None = None,
    ) -> None:
        """Save the state. `sealed`: tensors whose name, once saved, always stands for the same
        bytes; those not saved yet go to a new segment, the others are not written again (and
        may be left out). `rows`: JSON records made since the last save, kept with them (a
        resume gets every save's, in order). `live`: the rest, rewritten in the head."""
        new = {name: t for name, t in sealed.items() if name not in self.sealed}
        segments = list(self.segments)
        if new or rows:
            found = segment_path(self.path, len(segments))
            tensors_digest = _write(found, self.path, new, {"rows": rows or []})
            segments.append(_segment_digest(sorted(new), rows or [], tensors_digest))
        meta = {"format": FORMAT, "version": VERSION, "identity": self.identity}
        _write(self.path, self.path, live, {**meta, "progress": progress, "segments": segments})
        self.segments = segments
        self.sealed |= new.keys()
        _sweep_segments(self.path, keep=len(segments))  # what a killed save left unlisted

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        _sweep_segments(self.path, keep=0)


def _write(target: Path, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Write `tensors` to `target` atomically (a partial file beside it, fsynced, renamed into
    place), with `meta` (and the tensors' digest) as its metadata; the digest."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    plain = _writable(tensors)
    digest = tensors_sha256(list(plain.values()))
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


def _sweep_segments(path: Path, keep: int) -> None:
    """Remove the segments of `path` numbered `keep` and on."""
    start = f"{path.name}{SEGMENT}"
    for found in path.parent.iterdir():
        number = found.name[len(start) :] if found.name.startswith(start) else ""
        if number.isdigit() and int(number) >= keep:
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


def load(path: Path, identity: dict) -> tuple[Restored, list[str], set[str]]:
    """What the checkpoint at `path`, made by the encode `identity` names, restores (its head's
    tensors and every segment's, and the segments' rows), its segments' digests and the tensor
    names they hold; each file is checked against its digest."""
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
    if not isinstance(progress, dict) or not _digest_list(segments):
        raise PackError(f"{path} is corrupted (no progress or segment list)")
    rows, sealed = [], set()
    for number, digest in enumerate(segments):
        found = segment_path(path, number)
        if not found.exists():
            raise PackError(f"{path} is incomplete: its segment {found.name} is missing")
        part_meta, part = _read(found)
        part_rows = part_meta.get("rows")
        if not isinstance(part_rows, list) or digest != _segment_digest(
            sorted(part), part_rows, part_meta["sha256"]
        ):
            raise PackError(f"{found} is not the segment {path} lists")
        if part.keys() & tensors.keys():
            raise PackError(f"{path} is corrupted (a tensor saved twice)")
        tensors |= part
        rows += part_rows
        sealed |= part.keys()
    return Restored(progress, tensors, rows), segments, sealed


def _digest_list(segments) -> bool:
    return isinstance(segments, list) and all(
        isinstance(s, str) and DIGEST.fullmatch(s) for s in segments
    )


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """One checkpoint file's metadata and tensors, its tensors checked against its digest."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get(META, "null"))
            tensors = {name: fh.get_tensor(name) for name in sorted(fh.keys())}
    except (OSError, SafetensorError, ValueError) as err:
        raise PackError(f"{path} is not a readable checkpoint ({err})") from None
    if not isinstance(meta, dict):
        raise PackError(f"{path} is not an mmkv checkpoint this version reads")
    if tensors_sha256(list(tensors.values())) != meta.get("sha256"):
        raise PackError(f"{path} is corrupted (checksum mismatch)")
    return meta, tensors


# --- what is saved ---


def running_cache_tensors(running) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A RunningCache as named tensors, (live, sealed). Sealed: the entries of each layer no splice
    has rewritten (all of `full`'s) and the archive's offloaded entries, in whole pieces named by
    their first entry (an untouched entry never changes later: splices only ever lower the count);
    live: the rest of every layer's cache entry (prompt, front token, visual part), of its visual
    entries' stream indices and positions and of the archive, and where the pieces end."""
    live, sealed = {"cache.front": torch.tensor(running.front)}, {}
    piece = archive.PIECE  # read here: tests cut smaller pieces
    for layer, entry in enumerate(running.cache.layers):
        name, unchanged = f"cache.{layer}", running.unchanged[layer]
        cut = min(unchanged, entry.keys.shape[2]) // piece * piece
        start = running.visual_start(layer)
        visual_cut = max(0, min(unchanged - start, running.count(layer))) // piece * piece
        live[f"{name}.cut"] = torch.tensor([unchanged, cut, visual_cut])
        parts = (
            ("k", entry.keys, 2, cut),
            ("v", entry.values, 2, cut),
            ("index", running.index[layer], 0, visual_cut),
            ("pos", running.positions[layer], 1, visual_cut),
        )
        for part, tensor, dim, upto in parts:
            for first in range(0, upto, piece):
                sealed[f"{name}.piece.{part}.{first}"] = tensor.narrow(dim, first, piece)
            live[f"{name}.{part}"] = tensor.narrow(dim, upto, tensor.shape[dim] - upto)
        pieces, tails = running.archive[layer].pieces()
        for kind, by_start in pieces.items():
            for first, tensor in by_start.items():
                sealed[f"{name}.archive.{kind}.{first}"] = tensor
        for kind, tensor in tails.items():
            live[f"{name}.archive.{kind}.tail"] = tensor
    return live, sealed


def restore_running_cache(running, tensors: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint's tensors back into `running`, taking them out of `tensors` as they go: the
    archive keeps the loaded pieces themselves (no second host copy of an hour's offloaded KV).
    Pieces past the last save's cut (entries a splice rewrote after they were saved) are dropped."""
    running.front = tensors.pop("cache.front").tolist()
    for layer, entry in enumerate(running.cache.layers):
        name = f"cache.{layer}"
        unchanged, cut, visual_cut = tensors.pop(f"{name}.cut").tolist()
        pieces = f"{name}.piece."
        entry.keys = _joined(tensors, pieces + "k.", f"{name}.k", 2, cut).to(entry.keys)
        entry.values = _joined(tensors, pieces + "v.", f"{name}.v", 2, cut).to(entry.values)
        running.index[layer] = _joined(tensors, pieces + "index.", f"{name}.index", 0, visual_cut)
        running.positions[layer] = _joined(tensors, pieces + "pos.", f"{name}.pos", 1, visual_cut)
        running.unchanged[layer] = unchanged
        kept, tails = {}, {}
        for kind in Archive.NAMES:
            prefix = f"{name}.archive.{kind}."
            kept[kind] = [piece for _, piece in _taken_pieces(tensors, prefix)]
            if f"{prefix}tail" in tensors:
                tails[kind] = tensors.pop(f"{prefix}tail")
        running.archive[layer] = Archive.restoring(kept, tails)


def _joined(tensors: dict, prefix: str, tail: str, dim: int, cut: int) -> torch.Tensor:
    """The pieces named `prefix`<first entry> below `cut`, which must cover [0, cut) one after
    another, and then the tail, joined along `dim`; every piece is taken out of `tensors` (those
    from `cut` on hold entries rewritten since)."""
    parts, at = [], 0
    for start, piece in _taken_pieces(tensors, prefix):
        if start < cut:
            parts.append(piece)
            at = at + piece.shape[dim] if start == at else -1
    if at != cut or tail not in tensors:
        raise PackError(f"the checkpoint is corrupted (the saved pieces of {tail} do not fit)")
    parts.append(tensors.pop(tail))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _taken_pieces(tensors: dict, prefix: str) -> list[tuple[int, torch.Tensor]]:
    """The tensors named `prefix`<first entry>, taken out of `tensors`, in order of first entry."""
    numbers = (k[len(prefix) :] for k in tensors if k.startswith(prefix))
    starts = sorted(int(n) for n in numbers if n.isdigit())
    return [(start, tensors.pop(f"{prefix}{start}")) for start in starts]


def blocks_tensors(
    blocks: list[Span], saved: int = 0
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The blockwise blocks from `saved` on (sealed: a block never changes once made) as tensors,
    their K/V/positions concatenated (token-major, as a pack stores them) and representatives,
    and as JSON rows (a segment keeps them: a resume gets the rows of every save in order)."""
    tensors, rows = {}, []
    for i, block in enumerate(blocks[saved:], start=saved):
        for part, name in enumerate(("k", "v", "pos")):
            tensors[f"block.{i}.{name}"] = block.part(part)
        if block.representative is not None:
            tensors[f"block.{i}.rep"] = block.representative
        rows.append(
            {
                "counts": block.layer_counts,
                "granularity": block.granularity,
                "steps": list(block.steps) if block.steps else None,
                "time": list(block.time) if block.time else None,
                "extra": block.extra,
            }
        )
    return tensors, rows


def blocks_from(tensors: dict[str, torch.Tensor], rows: list[dict]) -> list[Span]:
    """The blocks a checkpoint saved, taken out of `tensors`: each layer's K, V and positions are
    views of the loaded tensors (the writer joins them again), not copies."""
    from mmkv_cli.pack.format import split_layers

    blocks = []
    for i, row in enumerate(rows):
        try:
            keys, values, positions = (
                split_layers(tensors.pop(f"block.{i}.{name}"), row["counts"])
                for name in ("k", "v", "pos")
            )
        except (KeyError, TypeError, RuntimeError):
            problem = f"the checkpoint is corrupted (block {i} does not fit its row)"
            raise PackError(problem) from None
        blocks.append(
            Span(
                name="",
                keys=keys,
                values=values,
                positions=positions,
                granularity=row["granularity"],
                steps=tuple(row["steps"]) if row["steps"] else None,
                time=tuple(row["time"]) if row["time"] else None,
                representative=tensors.pop(f"block.{i}.rep", None),
                extra=row["extra"],
            )
        )
    return blocks
