"""The .kvpack format (v3): one safetensors file, a JSON header in its metadata, tensors by segment.

Segments are the prefix (init prompt), one per visual block, and the suffix. Each segment holds its
per-layer K, V and original positions concatenated along the token axis ([H_kv, sum n_l, D], [P, sum n_l]);
the header keeps the per-layer counts to split them again, so layers may keep different numbers of tokens.
Prefix and suffix are tensors of their own ("prefix.k", ...); the blocks sit one after another in
"blocks.k/.v/.pos", each at its offset, so the tensor directory stays small however many blocks; the block
table (granularity, steps, time, offset, counts, checksum) is three small tensors, not header JSON, so opening
a pack of thousands of blocks parses a few KB. Block representatives sit together in "reps" [blocks, dim]
so retrieval reads them without touching any block. See docs/kvpack.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

FORMAT_NAME = "mmkv.kvpack"
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)  # v2 kept the block table as JSON in the header
BLOCKS = "blocks"  # tensors "blocks.k/.v/.pos": every block's tokens, one range each
# v3 block table, one row per block: "blocks.table" int64 [N, 4 + layers] = (granularity index, first step,
# stop step, offset, layer counts...), "blocks.time" float64 [N, 2] (NaN: none), "blocks.sha256" uint8 [N, 32].
TABLE_COLUMNS = 4
META_HEADER = "mmkv"
META_HEADER_SHA = "mmkv_sha256"


@dataclass
class Segment:
    """Per-layer KV of one stretch of the stream. keys/values: [H_kv, n_l, D]; positions: [P, n_l] int64."""

    name: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    granularity: str | None = None  # patch | frame | segment for visual blocks
    steps: tuple[int, int] | None = None  # temporal steps [start, stop) the block covers
    time: tuple[float, float] | None = None  # seconds (or image / page index) of its first and last frame
    representative: torch.Tensor | None = None  # [dim] retrieval key
    extra: dict = field(default_factory=dict)

    @property
    def layer_counts(self) -> list[int]:
        return [int(k.shape[1]) for k in self.keys]

    def packed(self) -> dict[str, torch.Tensor]:
        return {
            f"{self.name}.k": torch.cat(self.keys, dim=1).contiguous(),
            f"{self.name}.v": torch.cat(self.values, dim=1).contiguous(),
            f"{self.name}.pos": torch.cat(self.positions, dim=1).to(torch.int64).contiguous(),
        }


def tensors_sha256(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def split_layers(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts, dim=1))


def block_name(index: int) -> str:
    return f"b{index}"
