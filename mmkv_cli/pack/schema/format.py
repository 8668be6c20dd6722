"""The .kvpack format (v13): one safetensors file, a JSON header in its metadata, tensors by span.

A span is the per-layer KV of one stretch of the stream: the prefix (init prompt), one visual block,
or the suffix. Each span holds its per-layer K, V and original positions concatenated along the
token axis, token-major ([sum n_l, H_kv, D], [sum n_l, P]), so a span is one contiguous byte range
per tensor: a reader reads and checksums it in one piece, never strided head slices. The header
keeps the per-layer counts to split them again, so layers may keep different numbers of tokens.
Prefix and suffix are tensors of their own ("prefix.k", ...); the blocks sit one after another in
"blocks.k/.v/.pos", each at its offset, so the tensor directory stays small however many blocks.
Everything that grows with the video is a tensor, not header JSON: the block table (granularity,
steps, time, offset, counts, checksum), the frame timestamps and the tokens per step; so opening a
pack parses a few KB whatever its length. Block representatives sit together in "reps" [blocks,
layers, dim] so retrieval reads them without touching any block. From v7 the blocks' K/V may be
quantized (pack/quantized/quant.py: codes in "blocks.k/.v", scales in "blocks.kq/.vq"), positions
are int32 and stored once for a span whose layers all keep the same tokens. From v8 the block table
and the tokens per step are int32 where every value fits (int64 otherwise), and the representatives
have a digest per 4 MiB, hashed on every core. From v9 a quantized pack's key groups run across the
blocks of each layer, their scales ("blocks.kq") one small tensor with a digest per 4 MiB that no
block's checksum covers. From v10 every checksum is BLAKE3 (sha256 before; the header's own stays
sha256), named so: "blocks.blake3", and "blake3" where the header held "sha256". From v11 a pack may
be held per head: its spans store each (layer, KV head) as a layer of one head. From v12 a block's
checksum may be a digest per model layer ("digest_layers": stored layers each covers): a retrieval
that reads one layer's rows of a block checks those, not the block's every layer. From v13 a pack
may keep its blocks' tokens as the language model took them in ("embeds" [tokens, dim] float16, unit
rows, one a token its blocks' first layer holds, in table order, a digest per 4 MiB): a question's
late interaction with them chooses frames (SAVEMem's retrieval). See docs/kvpack.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mmkv_cli.core.lazy import torch

FORMAT_NAME = "mmkv.kvpack"
FORMAT_VERSION = 13
# v2 kept the block table as JSON in the header; v2 and v3 stored K/V head-major ([H_kv, tokens, D])
# and positions as [P, tokens], with timestamps and step lengths in the header; v2-v4 named the
# prefix and suffix "segments" in the header (v5: "spans") and kept a fixed token budget among the
# params. v2-v5 stored one representative per block, [blocks, dim], the mean of keys after RoPE;
# v6 stores [blocks, layers, dim] means of keys before RoPE ("space": "pre_rope"; "post_rope" from
# v8 for MuKV's code: the keys as each block was prefilled after the init prompt). v2-v6 stored
# positions int64, once per layer, and K/V only as computed (no "quant"). v2-v7 stored the block
# table and the tokens per step int64 always. v7 and v8 gave each block's layer runs key groups of
# their own, the scales among the blocks' rows (a block's checksum covered them); v9 lets them run
# across blocks ("key_groups": "span" in the quant header; the table's key-group column is 0).
# v2-v9 made every checksum sha256; v10 makes them BLAKE3 (the header's own checksum stays sha256).
# v11 may hold KV per head ("per_head" in the header's "kv"): every span then stores each (layer,
# KV head) as a layer of one head, layer-major, so each head keeps tokens of its own. v2-v11 gave
# each block one checksum over all its layers; v12 may cut it into a digest per `digest_layers`
# stored layers ("blocks.blake3" [N, digests, 32]): a pack retrieved layer by layer has one a layer.
# v13 may store "embeds" (the header's "embeddings"); v2-v12 never do.
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
EMBEDS = "embeds"  # v13: [tokens, dim] float16 unit input embeddings of the blocks' tokens
BLOCKS = "blocks"  # tensors "blocks.k/.v/.pos": every block's tokens, one range each
# Header lists that grow with the video, stored as tensors of these names (and dtypes) from v4 on;
# from v8 an int64 one is stored int32 where every value fits.
SERIES = {"media.timestamps": "float64", "layout.step_lengths": "int64"}
# Block table, one row per block: "blocks.table" int64 (v8: int32 where all fit) [N, 7 + layers] =
# (granularity index, first step, stop step, offset, position offset, positions shared (0/1), first
# key group, layer counts...), "blocks.time" float64 [N, 2] (NaN: none), "blocks.<digest>" uint8
# [N, 32] ("blocks.sha256" before v10; v12: [N, digests, 32]). v3-v6 had the first four columns.
TABLE_COLUMNS = 7
OLD_TABLE_COLUMNS = 4
# The stored tensors of a span, in the order its checksum covers them: keys, values, positions,
# then (quantized packs) the keys' and the values' scales and zero points.
PARTS = ("k", "v", "pos", "kq", "vq")
META_HEADER = "mmkv"
META_HEADER_SHA = "mmkv_sha256"


@dataclass
class Span:
    """Per-layer KV of one stretch of the stream (prefix, block or suffix).

    keys/values: [H_kv, n_l, D]; positions: [P, n_l] int64."""

    name: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    granularity: str | None = None  # patch | frame | segment for visual blocks
    steps: tuple[int, int] | None = None  # temporal steps [start, stop) the block covers
    time: tuple[float, float] | None = (
        None  # seconds (or image / page index) of its first and last frame
    )
    representative: torch.Tensor | None = None  # [layers, dim] retrieval key(s), before RoPE
    # [n, dim] its tokens as the language model took them in, one a token its first layer holds,
    # in that layer's order (v13: kept for a question's late interaction; None: not kept)
    embeddings: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def layer_counts(self) -> list[int]:
        return [int(k.shape[1]) for k in self.keys]

    def part(self, index: int) -> torch.Tensor:
        """One stored, token-major tensor: 0 K, 1 V [sum n_l, H_kv, D], 2 positions [sum n_l, P]."""
        if index == 2:
            return torch.cat(self.positions, dim=1).to(torch.int64).T.contiguous()
        layers = self.keys if index == 0 else self.values
        return torch.cat(layers, dim=1).transpose(0, 1).contiguous()

    def by_head(self) -> Span:
        """This span as a pack held per head stores it: each (layer, KV head) a layer of its own
        ([1, n_l, D]), layer-major, positions repeated for each head; no embeddings (its heads
        keep tokens of their own)."""
        heads = self.keys[0].shape[0] if self.keys else 0

        def split(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [t[h : h + 1] for t in parts for h in range(heads)]

        positions = [p for p in self.positions for _ in range(heads)]
        return replace(self, keys=split(self.keys), values=split(self.values), positions=positions,
                       embeddings=None)  # fmt: skip

    def packed(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name: "<name>.k", "<name>.v", "<name>.pos"."""
        return {f"{self.name}.{part}": self.part(i) for i, part in enumerate(("k", "v", "pos"))}


@dataclass(frozen=True)
class BlockShape:
    """What a pack's table holds of a block, without its KV: a source that knows it without loading
    the block (convert, from the source pack's table) spares the writer a pass over the KV."""

    granularity: str | None
    steps: tuple[int, int] | None
    time: tuple[float, float] | None
    layer_counts: list[int]
    shared_positions: bool  # one set of positions serves every layer
    representative: torch.Tensor | None
    embeddings: torch.Tensor | None = None  # Span.embeddings


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as stored, without copying a contiguous tensor."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a size-1 tensor may keep any stride
        flat = flat.new_empty(flat.shape).copy_(flat)
    return memoryview(flat.view(torch.uint8).numpy())


def digest_name(version: int) -> str:
    """The hash of every checksum in a pack of format `version` but the header's own, which is
    also what its digest fields and the table's digest tensor ("blocks.<name>") are called."""
    return "blake3" if version >= 10 else "sha256"


def split_layers(
    t: torch.Tensor, counts: list[int], token_major: bool = True
) -> list[torch.Tensor]:
    """A stored span tensor -> per-layer [H_kv, n_l, D] (or [P, n_l]) views; v2/v3 were
    head-major."""
    if not token_major:
        return list(torch.split(t, counts, dim=1))
    return [part.transpose(0, 1) for part in torch.split(t, counts, dim=0)]


def block_name(index: int) -> str:
    return f"b{index}"
