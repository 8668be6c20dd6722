"""pack: the .kvpack on disk (format, typed header, atomic writer, lazy verified reader)."""

from mmkv_cli.pack.atomic import check_writable
from mmkv_cli.pack.format import FORMAT_VERSION, Span, block_name
from mmkv_cli.pack.header import KVShape, PackHeader
from mmkv_cli.pack.reader import PackReader
from mmkv_cli.pack.writer import write_pack

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
