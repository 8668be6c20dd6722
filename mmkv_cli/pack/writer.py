"""Write a pack atomically: a temporary file beside the target, fsync, then rename into place."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmkv_cli.errors import OutputExistsError, PackError
from mmkv_cli.pack.format import (BLOCKS, FORMAT_NAME, FORMAT_VERSION, META_HEADER, META_HEADER_SHA, Segment,
                                  tensors_sha256)


def check_writable(path: Path, force: bool) -> None:
    """Fail before any work is done when the target exists (and --force is off) or cannot be written."""
    if path.exists() and not force:
        raise OutputExistsError(f"{path} already exists; pass --force to replace it")
    if path.exists() and path.is_dir():
        raise OutputExistsError(f"{path} is a folder, not a pack file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise PackError(f"cannot write {path}: folder {parent} does not exist")


def write_pack(path: Path, header: dict, prefix: Segment, blocks: list[Segment], suffix: Segment,
               force: bool = False) -> int:
    """Write header + segments to `path`; returns the file size in bytes."""
    check_writable(path, force)
    tensors: dict = {}
    segments_meta = {}
    for seg in (prefix, suffix):
        packed = seg.packed()
        tensors.update(packed)
        segments_meta[seg.name] = {"layer_counts": seg.layer_counts, "sha256": tensors_sha256(list(packed.values()))}
    # All blocks share three tensors (a few safetensors entries, whatever the video length); each block is a
    # token range of them, read by slicing the memory map.
    blocks_meta, parts, offset = [], {"k": [], "v": [], "pos": []}, 0
    for index, block in enumerate(blocks):
        packed = block.packed()
        for part in parts:
            parts[part].append(packed[f"{block.name}.{part}"])
        count = int(packed[f"{block.name}.k"].shape[1])
        blocks_meta.append({
            "index": index, "name": block.name, "granularity": block.granularity,
            "steps": list(block.steps) if block.steps else None,
            "time": [round(float(t), 4) for t in block.time] if block.time else None,
            "layer_counts": block.layer_counts, "offset": offset, "sha256": tensors_sha256(list(packed.values())),
        })
        offset += count
    if blocks:
        tensors.update({f"{BLOCKS}.{part}": torch.cat(chunks, dim=1).contiguous() for part, chunks in parts.items()})
    reps = [b.representative for b in blocks if b.representative is not None]
    if reps and len(reps) == len(blocks):
        tensors["reps"] = torch.stack(reps).float().contiguous()
    header = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **header,
              "segments": segments_meta, "blocks": blocks_meta,
              "representatives": {"dim": int(tensors["reps"].shape[1])} if "reps" in tensors else None}
    text = json.dumps(header, sort_keys=True)
    metadata = {META_HEADER: text, META_HEADER_SHA: hashlib.sha256(text.encode()).hexdigest()}

    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        if path.exists() and not force:  # appeared while we were encoding
            raise OutputExistsError(f"{path} already exists; pass --force to replace it")
        os.replace(tmp, path)
    except OSError as err:
        raise PackError(f"cannot write {path}: {err.strerror or err}") from err
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size
