"""pack: the .kvpack on disk, a storage engine in five rooms, each importing only those below it
(the import-linter contracts in pyproject.toml keep the order):

- schema: what a pack is (the format's names and versions, spans, the typed header, the table);
- io: bytes on and off the disk, whatever they mean (local and remote files, vectored reads,
  staging, write-behind, atomic replacement);
- integrity: what makes an untrusted file a usable pack (the checks, checked tensors, digests,
  verdicts on non-finite values);
- quantized: KV stored in fewer bits (group quantization, VidKV's codes);
- access: the writers and readers built on them.

This module is the one face the rest of the project imports: its names load on first use, so a
module that needs none of them (storage's `is_url` in a warm server's client) costs no reader,
hashing or numpy import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmkv_cli.pack.access.convert import convert, convert_quant
    from mmkv_cli.pack.access.early import EarlyPack, worth_writing_early
    from mmkv_cli.pack.access.memory import MemoryPack, joined_spans
    from mmkv_cli.pack.access.reader import PackReader
    from mmkv_cli.pack.access.report import inspect, listing, verify
    from mmkv_cli.pack.access.writer import write_pack
    from mmkv_cli.pack.integrity.checks import check_askable
    from mmkv_cli.pack.integrity.hashing import tensors_digest
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts
    from mmkv_cli.pack.io.atomic import check_writable, sweep_stale
    from mmkv_cli.pack.io.storage import (
        URL,
        exists,
        filesystem,
        is_url,
        local_copy,
        local_path,
        read_text,
        staged_upload,
        write_text,
    )
    from mmkv_cli.pack.quantized.quant import QuantSpec
    from mmkv_cli.pack.schema.format import (
        FORMAT_VERSION,
        READABLE_VERSIONS,
        BlockShape,
        Span,
        block_name,
        split_layers,
    )
    from mmkv_cli.pack.schema.header import (
        Fingerprint,
        KVShape,
        LayoutRecord,
        MediaRecord,
        MethodRecord,
        PackHeader,
        PromptRecord,
    )
    from mmkv_cli.pack.schema.table import BlockTable, eligible_at, run_rows

_HOMES = {
    "block_name": "schema.format",
    "BlockShape": "schema.format",
    "BlockTable": "schema.table",
    "check_askable": "integrity.checks",
    "check_writable": "io.atomic",
    "convert": "access.convert",
    "convert_quant": "access.convert",
    "EarlyPack": "access.early",
    "eligible_at": "schema.table",
    "run_rows": "schema.table",
    "exists": "io.storage",
    "filesystem": "io.storage",
    "Fingerprint": "schema.header",
    "FORMAT_VERSION": "schema.format",
    "inspect": "access.report",
    "is_url": "io.storage",
    "joined_spans": "access.memory",
    "KVShape": "schema.header",
    "LaterVerdicts": "integrity.verdicts",
    "LayoutRecord": "schema.header",
    "listing": "access.report",
    "local_copy": "io.storage",
    "local_path": "io.storage",
    "MediaRecord": "schema.header",
    "MemoryPack": "access.memory",
    "MethodRecord": "schema.header",
    "PackHeader": "schema.header",
    "PackReader": "access.reader",
    "PromptRecord": "schema.header",
    "QuantSpec": "quantized.quant",
    "read_text": "io.storage",
    "READABLE_VERSIONS": "schema.format",
    "Span": "schema.format",
    "split_layers": "schema.format",
    "staged_upload": "io.storage",
    "sweep_stale": "io.atomic",
    "tensors_digest": "integrity.hashing",
    "URL": "io.storage",
    "verify": "access.report",
    "worth_writing_early": "access.early",
    "write_pack": "access.writer",
    "write_text": "io.storage",
}

__all__ = [
    "BlockShape",
    "BlockTable",
    "EarlyPack",
    "FORMAT_VERSION",
    "Fingerprint",
    "KVShape",
    "LaterVerdicts",
    "LayoutRecord",
    "MediaRecord",
    "MemoryPack",
    "MethodRecord",
    "PackHeader",
    "PackReader",
    "PromptRecord",
    "QuantSpec",
    "READABLE_VERSIONS",
    "Span",
    "URL",
    "block_name",
    "check_askable",
    "check_writable",
    "convert",
    "convert_quant",
    "eligible_at",
    "exists",
    "filesystem",
    "inspect",
    "is_url",
    "joined_spans",
    "listing",
    "local_copy",
    "local_path",
    "read_text",
    "run_rows",
    "split_layers",
    "staged_upload",
    "sweep_stale",
    "tensors_digest",
    "verify",
    "worth_writing_early",
    "write_pack",
    "write_text",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mmkv_cli.pack' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"mmkv_cli.pack.{home}"), name)
    globals()[name] = value
    return value
