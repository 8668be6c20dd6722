"""Resumable encodes: every N chunks the streaming state is saved beside the output, atomically;
`encode --resume` continues from it and writes the pack an uninterrupted run would.

A checkpoint is a safetensors file `.NAME.mmkv-checkpoint` (no pickle): the running cache of every
layer (K, V, stream indices, positions, entries offloaded to the host), the policy's own state (its
`saved()` tensors), or for a blockwise method the blocks made so far; its metadata holds what the
encode is (media digest, model fingerprint, method, parameters, budget, sampling, stored bits) and
how far it got. A checkpoint of another encode is refused, never mixed in; one whose bytes do not
match its digest is refused too. It is removed once the pack is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.errors import PackError, UsageError
from mmkv_cli.lazy import torch
from mmkv_cli.methods.archive import Archive
from mmkv_cli.pack.format import Span, tensors_sha256
from mmkv_cli.pack.writer import sweep_stale

SUFFIX = ".mmkv-checkpoint"
FORMAT, VERSION = "mmkv.checkpoint", 2  # 2: the archive stored by column, in slabs
META = "mmkv_checkpoint"


def checkpoint_path(output: Path) -> Path:
    return output.parent / f".{output.name}{SUFFIX}"


@dataclass
class Checkpointing:
    """One encode's checkpoints: where, how often, what encode they belong to, and what a resume
    starts from (restored: (progress, tensors), or None)."""

    path: Path
    every: int  # chunks between saves (0: never save)
    identity: dict
    restored: tuple[dict, dict] | None = None

    @classmethod
    def open(cls, output: Path, every: int, resume: bool, identity: dict) -> Checkpointing:
        if every < 0:
            raise UsageError("--checkpoint-every must be 0 (never) or a number of chunks")
        cls.refuse_overwrite(output, every, resume)
        path = checkpoint_path(output)
        found = load(path, identity) if resume and path.exists() else None
        return cls(path, every, identity, found)

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

    def take_restored(self) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """What a resume starts from, handed over once: held here for the whole encode, the
        loaded checkpoint (at an hour of video, GBs) would outlive every tensor made from it."""
        restored, self.restored = self.restored, None
        return restored

    def due(self, chunks_done: int) -> bool:
        return self.every > 0 and chunks_done % self.every == 0

    def save(self, progress: dict, tensors: dict[str, torch.Tensor]) -> None:
        save(self.path, self.identity, progress, tensors)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def save(path: Path, identity: dict, progress: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write a checkpoint atomically: a partial file beside it, fsynced, renamed into place."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    plain = _writable(tensors)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "identity": identity,
        "progress": progress,
        "sha256": tensors_sha256(list(plain.values())),
    }
    sweep_stale(path, path.name, ".part")  # partial checkpoints of killed encodes
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        save_file(plain, str(partial), metadata={META: json.dumps(meta, sort_keys=True)})
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, path)
    except (OSError, SafetensorError) as err:
        partial.unlink(missing_ok=True)
        raise PackError(f"cannot write the checkpoint {path}: {err}") from None


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


def load(path: Path, identity: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(progress, tensors) of the checkpoint at `path`, made by the encode `identity` names."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get(META, "null"))
            tensors = {name: fh.get_tensor(name) for name in sorted(fh.keys())}
    except (OSError, SafetensorError, ValueError) as err:
        raise PackError(f"{path} is not a readable checkpoint ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise PackError(f"{path} is not an mmkv checkpoint this version reads")
    if meta.get("identity") != identity:
        theirs = meta.get("identity") if isinstance(meta.get("identity"), dict) else {}
        changed = [k for k in identity if theirs.get(k) != identity[k]] or ["unknown"]
        raise UsageError(
            f"{path} is the checkpoint of another encode ({', '.join(changed)} differ): delete "
            "it, or encode without --resume"
        )
    if tensors_sha256(list(tensors.values())) != meta.get("sha256"):
        raise PackError(f"{path} is corrupted (checksum mismatch)")
    progress = meta.get("progress")
    if not isinstance(progress, dict):
        raise PackError(f"{path} is corrupted (no progress)")
    return progress, tensors


# --- what is saved ---


def running_cache_tensors(running) -> dict[str, torch.Tensor]:
    """A RunningCache as named tensors: every layer's whole cache entry (prompt, front token and
    visual part), its visual entries' stream indices and positions, and what it offloaded."""
    out = {"cache.front": torch.tensor(running.front)}
    for layer, entry in enumerate(running.cache.layers):
        out[f"cache.{layer}.k"], out[f"cache.{layer}.v"] = entry.keys, entry.values
        out[f"cache.{layer}.index"] = running.index[layer]
        out[f"cache.{layer}.pos"] = running.positions[layer]
        for name, parts in running.archive[layer].parts().items():
            for n, tensor in enumerate(parts):
                out[f"cache.{layer}.archive.{name}.{n}"] = tensor
    return out


def restore_running_cache(running, tensors: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint's tensors back into `running`, taking them out of `tensors` as they go: the
    archive keeps the loaded slabs themselves (no second host copy of an hour's offloaded KV)."""
    running.front = tensors.pop("cache.front").tolist()
    for layer, entry in enumerate(running.cache.layers):
        entry.keys = tensors.pop(f"cache.{layer}.k").to(entry.keys)
        entry.values = tensors.pop(f"cache.{layer}.v").to(entry.values)
        running.index[layer] = tensors.pop(f"cache.{layer}.index")
        running.positions[layer] = tensors.pop(f"cache.{layer}.pos")
        archived = {name: [] for name in Archive.NAMES}
        for name, parts in archived.items():
            while (key := f"cache.{layer}.archive.{name}.{len(parts)}") in tensors:
                parts.append(tensors.pop(key))
        running.archive[layer] = Archive.adopting(archived)


def blocks_tensors(blocks: list[Span]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Blockwise blocks made so far: their K/V/positions concatenated (token-major, as a pack
    stores them) and representatives; the rest as JSON rows."""
    tensors, rows = {}, []
    for i, block in enumerate(blocks):
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
        keys, values, positions = (
            split_layers(tensors.pop(f"block.{i}.{name}"), row["counts"])
            for name in ("k", "v", "pos")
        )
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
