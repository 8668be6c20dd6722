"""Quantized KV (KIVI's layout), as pure functions over tensors.

Keys have a few channels with large magnitudes that stay large across tokens, so they are quantized
per channel over groups of `group` consecutive tokens; values have no such channels and are
quantized per token over groups of `group` channels. Both are asymmetric: a code q in [0, 2^b - 1]
stands for q * scale + zero, scale and zero stored in float16. Codes are packed along the head
dimension, 8 / bits codes to a byte, lowest bits first, so a token's codes stay one row of bytes
and a block stays one contiguous row range of every tensor.

Key groups never cross layers: one layer's outliers never widen another layer's scale. From v9 a
layer's key groups run across the blocks (`span`): layer l's tokens of every block, in table order,
are cut into groups of `group` tokens, so a block of a few tokens no longer pays a whole scale row
per channel for itself; the scales sit apart in one small tensor (layer after layer), and each
block's codes stay one byte range. Before v9 each block's layer runs had groups of their own. Either
way a reader finds the group of any token from the table's token counts alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.lazy import torch
from mmkv_cli.core.options import KV_BITS
from mmkv_cli.pack.quantized import vidkv
from mmkv_cli.pack.quantized.codes import pack_codes, unpack_codes

# 16: not quantized (the backbone's own dtype); 1.5: VidKV's mixed 1/2-bit keys and ternary values
# (vidkv.py)
BITS = KV_BITS
MIXED = 1.5
FLOAT16_MAX = 65504.0
MAX_GROUP = 1 << 16
CHUNK_TOKENS = 2048  # tokens (de)quantized at a time on a CPU (their float32 copies fit in cache)


@dataclass(frozen=True)
class QuantSpec:
    """How a pack's block KV is stored. bits 16 means as computed, in the backbone's dtype."""

    bits: float = 16  # bits per stored K/V value: 16 (unquantized), 8, 4, 2 or 1.5 (VidKV)
    group: int = 128  # tokens per key group (per channel); channels per value group (per token)
    span: bool = True  # key groups run across blocks (v9); False: each block's own (v7, v8)

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    @property
    def mixed(self) -> bool:
        """VidKV's 1.5 bits: keys 2-bit on half the channels, 1-bit FFT signs on the rest."""
        return self.bits == MIXED

    @property
    def key_planes(self) -> int:
        """float16 planes a key group stores: scale and zero (mixed: and which channels are 2-bit,
        and the values' per-channel means over the group)."""
        return 4 if self.mixed else 2

    @property
    def block_parts(self) -> tuple[str, ...]:
        """What each block stores of the block tensors, in checksum order (v9): codes and
        positions, and the values' per-token scales (KIVI; mixed values share the key groups)."""
        return ("k", "v", "pos") if self.mixed else ("k", "v", "pos", "vq")

    def key_width(self, head_dim: int) -> int:
        """Bytes of one head's key codes per token."""
        return vidkv.key_width(head_dim) if self.mixed else head_dim * int(self.bits) // 8

    def value_width(self, head_dim: int) -> int:
        """Bytes of one head's value codes per token."""
        return vidkv.value_width(head_dim) if self.mixed else head_dim * int(self.bits) // 8

    def value_group(self, kv_heads: int, head_dim: int) -> int:
        """Channels per value group: `group`, or a token's whole width when that is smaller."""
        return min(self.group, kv_heads * head_dim)

    def check(self, kv_heads: int, head_dim: int) -> None:
        """Refuse a setting this KV width cannot take, before any work."""
        if self.bits not in BITS:
            raise UsageError(f"--kv-bits must be one of {', '.join(map(str, BITS))}")
        if not 1 <= self.group <= MAX_GROUP:
            raise UsageError(f"--kv-group must be a number of tokens / channels, 1 to {MAX_GROUP}")
        if not self.quantized:
            return
        width = kv_heads * head_dim
        if width % self.value_group(kv_heads, head_dim):
            raise UsageError(
                f"--kv-group {self.group} does not divide the KV width {width} "
                f"({kv_heads} heads x {head_dim}); pick a divisor of it"
            )
        if head_dim % (8 if self.mixed else 8 // int(self.bits)):
            raise UsageError(f"head dim {head_dim} cannot be packed at {self.bits} bits")

    @classmethod
    def from_header(cls, stored, kv, where: str) -> QuantSpec | None:
        """A pack header's `quant`, checked against its `kv`: None when the K/V are stored as
        computed (every pack before v7)."""
        from mmkv_cli.core.errors import PackError

        if stored is None:
            return None
        try:
            if not isinstance(stored, dict) or type(stored.get("group")) is not int:
                raise ValueError
            if type(stored.get("bits")) is not int and stored.get("bits") != MIXED:
                raise ValueError
            if stored.get("key_groups", "block") not in ("block", "span"):
                raise ValueError
            quant = cls(stored["bits"], stored["group"], stored.get("key_groups") == "span")
            if stored.get("scale_dtype") != "float16" or not quant.quantized:
                raise ValueError
            quant.check(int(kv["kv_heads"]), int(kv["head_dim"]))
        except (KeyError, TypeError, ValueError, UsageError):
            raise PackError(f"{where} is corrupted (bad quantization header)") from None
        return quant

    def as_header(self) -> dict | None:
        if not self.quantized:
            return None
        return {
            "bits": self.bits,
            "group": self.group,
            "keys": "per_channel",
            "values": "per_token",
            "scale_dtype": "float16",
            **({"key_groups": "span"} if self.span else {}),
        }


def _refuse_beyond_float16(*tensors: torch.Tensor) -> None:
    """Quantized KV keeps float16 scales: values float16 cannot hold are refused."""
    if any(t.numel() and float(t.abs().max()) > FLOAT16_MAX for t in tensors):
        raise UsageError(
            "KV values exceed float16's range, so they cannot be quantized: keep --kv-bits 16"
        )


def _scale_zero(low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 2] float16 (scale, zero) for ranges [low, high]; refused when float16 cannot hold
    them."""
    _refuse_beyond_float16(low, high)
    scale = (high - low) / ((1 << bits) - 1)
    return torch.stack([scale, low], dim=-1).to(torch.float16)


def _codes_into(out: torch.Tensor, x, scale, zero, bits: int) -> None:
    """x's codes written into uint8 `out`, against the stored (float16) scale and zero, so
    decoding adds no second rounding."""
    safe = torch.where(scale > 0, scale, 1.0)
    out.copy_(torch.sub(x, zero).div_(safe).round_().clamp_(0, (1 << bits) - 1))


def token_chunks(n: int, device: torch.device) -> list[slice]:
    """n tokens a chunk at a time on a CPU (CHUNK_TOKENS: their float32 copies stay in cache),
    all at once on a GPU."""
    step = max(1, n if device.type == "cuda" else CHUNK_TOKENS)
    return [slice(first, first + step) for first in range(0, n, step)]


def layer_first_groups(totals: list[int], group: int) -> list[int]:
    """Spanning key groups: the first group row of each layer, whose run over all blocks holds
    `totals[l]` tokens (layer after layer, each cut into groups of its own)."""
    first, out = 0, []
    for total in totals:
        out.append(first)
        first += -(-total // group)
    return out


def spanning_groups(before: list[int], counts: list[int], group: int, firsts: list[int]):
    """[sum counts] the spanning key group row of every token of one block whose layers keep
    `counts` tokens, after `before[l]` tokens of layer l in the blocks before it."""
    rows = [
        firsts[layer] + (before[layer] + torch.arange(count)) // group
        for layer, count in enumerate(counts)
    ]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


class SpanningKeyRanges:
    """The float16 scale and zero of every spanning key group, gathered block by block in table
    order: each layer's open group grows until it holds `group` tokens, then its row of `scales`
    ([groups, 2, H, D], layer after layer, as a pack stores them) is set. closed[l]: how many of
    layer l's groups are final; finish() closes the last ones."""

    def __init__(self, totals: list[int], group: int, bits: int, heads: int, dim: int):
        self.group, self.bits, self.shape = group, bits, (heads, dim)
        self.firsts = layer_first_groups(totals, group)
        count = sum(-(-t // group) for t in totals)
        planes = QuantSpec(bits).key_planes
        self.scales = torch.zeros(count, planes, heads, dim, dtype=torch.float16)
        # mixed: the open group's keys and values themselves (its 2-bit channels, FFT scales and
        # value means need all of its tokens: at most `group` tokens a layer are held)
        self.held: list[list[tuple]] = [[] for _ in totals]
        self.closed = [0] * len(totals)
        self.open: list[tuple | None] = [None] * len(totals)
        self.filled = [0] * len(totals)

    def add(self, keys: torch.Tensor, counts: list[int], values: torch.Tensor | None = None):
        """One block's token-major keys [sum counts, H, D], its layers one after another (mixed:
        and its values)."""
        # ranges of the keys as given (float16 min and max are exact in float32): a float32 copy
        # of every block cost more than the ranges, and torch.aminmax ran slower than amin and
        # amax on the CPU (docs/benchmarks.md, Quantized packs)
        x = None if self.bits == MIXED else keys.reshape(keys.shape[0], -1)
        first = 0
        for layer, count in enumerate(counts):
            at = first
            while at < first + count:
                take = min(self.group - self.filled[layer], first + count - at)
                if self.bits == MIXED:  # the group's planes come from its tokens at its close
                    self.held[layer].append((keys[at : at + take], values[at : at + take]))
                else:
                    rows = x[at : at + take]
                    low, high = rows.amin(dim=0).float(), rows.amax(dim=0).float()
                    held = self.open[layer]
                    if held is not None:
                        low, high = torch.minimum(low, held[0]), torch.maximum(high, held[1])
                    self.open[layer] = (low, high)
                self.filled[layer] += take
                if self.filled[layer] == self.group:
                    self._close(layer)
                at += take
            first += count

    def finish(self) -> torch.Tensor:
        """Close every layer's last group; returns the scales."""
        for layer, filled in enumerate(self.filled):
            if filled:
                self._close(layer)
        return self.scales

    def _close(self, layer: int) -> None:
        row = self.firsts[layer] + self.closed[layer]
        if self.bits == MIXED:
            keys, values = (torch.cat(part) for part in zip(*self.held[layer]))
            _refuse_beyond_float16(keys, values)
            self.scales[row] = vidkv.group_planes(keys, values)
            self.held[layer] = []
        else:
            low, high = self.open[layer]
            stored = _scale_zero(low[None], high[None], int(self.bits))[0]  # [C, 2]
            self.scales[row] = stored.T.reshape(2, *self.shape)
        self.closed[layer] += 1
        self.open[layer], self.filled[layer] = None, 0


def quantize_keys_with(
    keys: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, bits: int
) -> torch.Tensor:
    """Token-major keys [n, H, D] -> packed codes [n, H, D * bits / 8], each token against the
    stored (float16) scale and zero of its group: scales [groups, 2, H, D], rows [n] group rows."""
    n, heads, dim = keys.shape
    if bits == MIXED:
        return vidkv.encode_keys(keys, scales.index_select(0, rows))
    bits = int(bits)
    codes = torch.empty(n, heads * dim, dtype=torch.uint8, device=keys.device)
    for chunk in token_chunks(n, keys.device):
        picked = scales.index_select(0, rows[chunk]).float().flatten(2)  # [m, 2, H * D]
        x = keys[chunk].flatten(1).float()
        _codes_into(codes[chunk], x, picked[:, 0], picked[:, 1], bits)
    return pack_codes(codes.reshape(n, heads, dim), bits)


def quantize_values(
    values: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major values [n, H, D] -> (packed codes [n, H, D * bits / 8] uint8, scale and zero
    [n, H * D / group, 2] float16), per token over groups of `group` channels."""
    n, heads, dim = values.shape
    bits, grouped = int(bits), values.reshape(n, -1, group)
    codes = torch.empty(grouped.shape, dtype=torch.uint8, device=values.device)
    stored = torch.empty(*grouped.shape[:2], 2, dtype=torch.float16, device=values.device)
    for chunk in token_chunks(n, values.device):
        x = grouped[chunk].float()
        stored[chunk] = _scale_zero(x.amin(dim=-1), x.amax(dim=-1), bits)
        scale, zero = (t.unsqueeze(-1) for t in stored[chunk].float().unbind(-1))
        _codes_into(codes[chunk], x, scale, zero, bits)
    return pack_codes(codes.reshape(n, heads, dim), bits), stored


def dequantize_keys(packed: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed key codes [n, H, B] and each token's group's scale and zero [n, 2, H, D] -> float32
    [n, H, D]."""
    codes = unpack_codes(packed, bits).float()
    return codes.mul_(scales[:, 0]).add_(scales[:, 1])


def dequantize_values(packed: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed value codes [n, H, B] and scale and zero [n, groups, 2] -> float32 [n, H, D]."""
    codes = unpack_codes(packed, bits).float()
    n, heads, dim = codes.shape
    grouped = codes.reshape(n, scales.shape[1], -1)
    scales = scales.unsqueeze(-1)  # [n, groups, 2, 1]
    return grouped.mul_(scales[:, :, 0]).add_(scales[:, :, 1]).reshape(n, heads, dim)


def dequantize(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_scales: torch.Tensor,
    key_group: torch.Tensor,
    value_scales: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    prepared: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes of n tokens' keys and values [n, H, B] -> ([n, H, D], [n, H, D]) of `dtype`.
    key_scales [groups, planes, H, D] holds each key group once, key_group [n] the group of every
    token; value_scales [n, groups, 2] (None at 1.5 bits: VidKV's codes, vidkv.py, whose groups
    `prepared` holds when a caller decodes many layers from the same key_scales).

    On a CPU the tokens go a chunk at a time, so the float32 working copies stay in cache: five
    times faster than whole-tensor passes over a real context."""
    n, heads, _ = keys.shape
    dim = key_scales.shape[-1]
    out_keys = torch.empty(n, heads, dim, dtype=dtype, device=keys.device)
    out_values = torch.empty_like(out_keys)
    if bits == MIXED and prepared is None:
        prepared = vidkv.prepare(key_scales)  # once per group, not per token
    for rows in token_chunks(n, keys.device):
        if bits == MIXED:  # the values' scales are the key groups' fourth plane
            at = key_group[rows]
            out_keys[rows] = vidkv.decode_keys_at(keys[rows], prepared, at)
            out_values[rows] = vidkv.decode_values_with(values[rows], prepared[3][at])
        else:
            scales = key_scales.index_select(0, key_group[rows])
            out_keys[rows] = dequantize_keys(keys[rows], scales, int(bits))
            out_values[rows] = dequantize_values(values[rows], value_scales[rows], int(bits))
    return out_keys, out_values
