"""pack: the .kvpack on disk (format, typed header, atomic writer, lazy verified reader).

Its names load on first use, so a module of it that needs none of them (storage's `is_url` in a
warm server's client) costs no reader, hashing or numpy import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmkv_cli.pack.access.reader import PackReader
    from mmkv_cli.pack.access.writer import write_pack
    from mmkv_cli.pack.io.atomic import check_writable
    from mmkv_cli.pack.schema.format import FORMAT_VERSION, Span, block_name
    from mmkv_cli.pack.schema.header import KVShape, PackHeader

_HOMES = {
    "check_writable": "io.atomic",
    "FORMAT_VERSION": "schema.format",
    "Span": "schema.format",
    "block_name": "schema.format",
    "KVShape": "schema.header",
    "PackHeader": "schema.header",
    "PackReader": "access.reader",
    "write_pack": "access.writer",
}

__all__ = [
    "FORMAT_VERSION",
    "KVShape",
    "PackHeader",
    "PackReader",
    "Span",
    "block_name",
    "check_writable",
    "write_pack",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mmkv_cli.pack' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"mmkv_cli.pack.{home}"), name)
    globals()[name] = value
    return value
