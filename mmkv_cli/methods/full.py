"""full: every visual token of every layer. The reference all other methods are measured against."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll


@dataclass(frozen=True)
class FullParams(StreamParams):
    pass


class FullMemory(KeepAll):
    """Every token as prefilled: each step's block is whole as soon as its chunk is in."""

    seals_as_prefilled = True


METHOD = Method(
    name="full",
    label="Full",
    description="keep the whole KV cache (reference)",
    start_here="the reference: every token kept, what the others are measured against",
    paper=Paper("the uncompressed baseline of all four papers", 2025),
    params=FullParams,
    budget=None,
    streaming=FullMemory,
)
