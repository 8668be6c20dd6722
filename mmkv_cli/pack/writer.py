"""Write a pack atomically: a temporary file beside the target, fsync, then rename into place."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
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
    raw_bytes,
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


# torch dtype name -> safetensors dtype code
SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}


def _dtype_code(t: torch.Tensor) -> str:
    return SAFETENSORS_DTYPES[str(t.dtype).replace("torch.", "")]


def write_pack(
    path: Path,
    header: dict,
    prefix: Span,
    blocks: list[Span],
    suffix: Span,
    force: bool = False,
) -> int:
    """Write header + spans to `path` atomically; returns the file size in bytes.

    The file is a safetensors file written here directly: the directory first, then every tensor's
    bytes in order, the blocks streamed one at a time (a pack of an hour of video is many GB: it is
    never assembled in memory, only each block's contiguous copy while it is written and hashed).
    """
    check_writable(path, force)
    small: dict[str, torch.Tensor] = {}
    spans_meta = {}
    for seg in (prefix, suffix):
        packed = seg.packed()
        small.update(packed)
        spans_meta[seg.name] = {
            "layer_counts": seg.layer_counts,
            "sha256": tensors_sha256(list(packed.values())),
        }
    header, series = split_series(header)
    small.update(series)
    # All blocks share three tensors (a few safetensors entries, whatever the video length); each
    # block is a contiguous row range of them, read by slicing the memory map.
    kinds, table, times, offset = [], [], [], 0
    for index, block in enumerate(blocks):
        if block.name != block_name(index):  # readers name blocks by their row in the table
            raise PackError(
                f"internal: block {index} is named '{block.name}', not '{block_name(index)}'"
            )
        if block.granularity not in kinds:
            kinds.append(block.granularity)
        steps = list(block.steps) if block.steps else [-1, -1]
        table.append([kinds.index(block.granularity), *steps, offset, *block.layer_counts])
        times.append([round(float(t), 4) for t in block.time] if block.time else [float("nan")] * 2)
        offset += sum(block.layer_counts)
    streamed: dict[str, tuple[str, list[int], int]] = {}  # block tensors: dtype, shape, bytes
    if blocks:
        for part, name in enumerate(("k", "v", "pos")):
            sample = blocks[0].part(part)
            shape = [offset, *sample.shape[1:]]
            nbytes = math.prod(shape) * sample.element_size()
            streamed[f"{BLOCKS}.{name}"] = (_dtype_code(sample), shape, nbytes)
        small[f"{BLOCKS}.table"] = torch.tensor(table, dtype=torch.int64)
        small[f"{BLOCKS}.time"] = torch.tensor(times, dtype=torch.float64)
    reps = [b.representative for b in blocks if b.representative is not None]
    if reps and len(reps) == len(blocks):
        small["reps"] = torch.stack([r.reshape(-1, r.shape[-1]) for r in reps]).float().contiguous()
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "spans": spans_meta,
        "blocks": {"count": len(blocks), "granularities": kinds},
        "representatives": (
            {
                "dim": int(small["reps"].shape[2]),
                "layers": int(small["reps"].shape[1]),
                "space": "pre_rope",
            }
            if "reps" in small
            else None
        ),
    }
    text = json.dumps(header, sort_keys=True)
    metadata = {META_HEADER: text, META_HEADER_SHA: hashlib.sha256(text.encode()).hexdigest()}

    # The directory: small tensors, then the streamed block tensors, then the blocks' digests.
    directory: dict = {"__metadata__": metadata}
    at = 0

    def place(name: str, code: str, shape: list[int], nbytes: int) -> None:
        nonlocal at
        directory[name] = {"dtype": code, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes

    for name, tensor in small.items():
        place(name, _dtype_code(tensor), list(tensor.shape), tensor.numel() * tensor.element_size())
    for name, (code, shape, nbytes) in streamed.items():
        place(name, code, shape, nbytes)
    if blocks:
        place(f"{BLOCKS}.sha256", "U8", [len(blocks), 32], 32 * len(blocks))
    head = json.dumps(directory, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes

    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:  # mode: 0666 less the umask, as any new file
            fh.write(struct.pack("<Q", len(head)) + head)
            for tensor in small.values():
                fh.write(raw_bytes(tensor))
            digests = [hashlib.sha256() for _ in blocks]
            # all K, then all V, then all positions; each block hashed in turn
            for part in range(3):
                for block, digest in zip(blocks, digests):
                    data = raw_bytes(block.part(part))
                    fh.write(data)
                    digest.update(data)
            fh.write(b"".join(d.digest() for d in digests))
            fh.flush()
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
