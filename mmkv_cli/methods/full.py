"""full: every visual token of every layer. The reference all other methods are measured against."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepPrefilled


@dataclass(frozen=True)
class FullParams(StreamParams):
    pass


METHOD = Method(
    name="full",
    label="Full",
    description="keep the whole KV cache (reference)",
    start_here="the reference: every token kept, what the others are measured against",
    paper=Paper("the uncompressed baseline of all four papers", 2025),
    params=FullParams,
    budget=None,
    streaming=KeepPrefilled,
)
