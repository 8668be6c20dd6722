"""Write a pack atomically: a temporary file beside the target, fsync, then rename into place."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mmkv_cli.errors import OutputExistsError, PackError
from mmkv_cli.lazy import torch
from mmkv_cli.pack.format import (
    BLOCKS,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_HEADER,
    META_HEADER_SHA,
    SERIES,
    Span,
    block_name,
    tensors_sha256,
)


def check_writable(path: Path, force: bool) -> None:
    """Fail before any work is done when the target exists (and --force is off) or cannot be
    written."""
    if path.exists() and not force:
        raise OutputExistsError(f"{path} already exists; pass --force to replace it")
    if path.exists() and path.is_dir():
        raise OutputExistsError(f"{path} is a folder, not a pack file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise PackError(f"cannot write {path}: folder {parent} does not exist")


def _default_mode() -> int:
    """rw for everyone, less the process umask: the mode any other new file of this process gets."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def split_series(header: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header without the lists that grow with the video (timestamps, tokens per step), and
    those lists as tensors. The caller's header is left as it was."""
    header, series = dict(header), {}
    for name, dtype in SERIES.items():
        section, key = name.split(".")
        if key in (header.get(section) or {}):
            header[section] = dict(header[section])
            series[name] = torch.tensor(
                header[section].pop(key), dtype=getattr(torch, dtype)
            ).reshape(-1)
    return header, series


def write_pack(
    path: Path,
    header: dict,
    prefix: Span,
    blocks: list[Span],
    suffix: Span,
    force: bool = False,
) -> int:
    """Write header + spans to `path`; returns the file size in bytes."""
    from safetensors.torch import save_file

    check_writable(path, force)
    tensors: dict = {}
    spans_meta = {}
    for seg in (prefix, suffix):
        packed = seg.packed()
        tensors.update(packed)
        spans_meta[seg.name] = {
            "layer_counts": seg.layer_counts,
            "sha256": tensors_sha256(list(packed.values())),
        }
    header, series = split_series(header)
    tensors.update(series)
    # All blocks share three tensors (a few safetensors entries, whatever the video length); each
    # block is a contiguous row range of them, read by slicing the memory map.
    parts, offset, kinds = {"k": [], "v": [], "pos": []}, 0, []
    table, times, digests = [], [], []
    for index, block in enumerate(blocks):
        if block.name != block_name(index):  # readers name blocks by their row in the table
            raise PackError(
                f"internal: block {index} is named '{block.name}', not '{block_name(index)}'"
            )
        packed = block.packed()
        for part in parts:
            parts[part].append(packed[f"{block.name}.{part}"])
        if block.granularity not in kinds:
            kinds.append(block.granularity)
        steps = list(block.steps) if block.steps else [-1, -1]
        table.append([kinds.index(block.granularity), *steps, offset, *block.layer_counts])
        times.append([round(float(t), 4) for t in block.time] if block.time else [float("nan")] * 2)
        digests.append(bytes.fromhex(tensors_sha256(list(packed.values()))))
        offset += int(packed[f"{block.name}.k"].shape[0])
    if blocks:
        tensors.update(
            {f"{BLOCKS}.{part}": torch.cat(chunks, dim=0) for part, chunks in parts.items()}
        )
        tensors[f"{BLOCKS}.table"] = torch.tensor(table, dtype=torch.int64)
        tensors[f"{BLOCKS}.time"] = torch.tensor(times, dtype=torch.float64)
        tensors[f"{BLOCKS}.sha256"] = torch.frombuffer(
            bytearray(b"".join(digests)), dtype=torch.uint8
        ).reshape(-1, 32)
    blocks_meta = {"count": len(blocks), "granularities": kinds}
    reps = [b.representative for b in blocks if b.representative is not None]
    if reps and len(reps) == len(blocks):
        tensors["reps"] = torch.stack(reps).float().contiguous()
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "spans": spans_meta,
        "blocks": blocks_meta,
        "representatives": {"dim": int(tensors["reps"].shape[1])} if "reps" in tensors else None,
    }
    text = json.dumps(header, sort_keys=True)
    metadata = {META_HEADER: text, META_HEADER_SHA: hashlib.sha256(text.encode()).hexdigest()}

    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(
            tmp, _default_mode()
        )  # safetensors creates files 0600; a pack is an ordinary output file
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
