"""pack: the .kvpack on disk (format, atomic writer, lazy verified reader)."""

from mmkv_cli.pack.format import FORMAT_VERSION, Span, block_name
from mmkv_cli.pack.reader import PackReader
from mmkv_cli.pack.writer import check_writable, write_pack

__all__ = ["FORMAT_VERSION", "Span", "PackReader", "block_name", "check_writable", "write_pack"]
