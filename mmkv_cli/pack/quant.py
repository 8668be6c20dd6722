"""Quantized KV (KIVI's layout), as pure functions over tensors.

Keys have a few channels with large magnitudes that stay large across tokens, so they are quantized
per channel over groups of `group` consecutive tokens; values have no such channels and are
quantized per token over groups of `group` channels. Both are asymmetric: a code q in [0, 2^b - 1]
stands for q * scale + zero, scale and zero stored in float16. Codes are packed along the head
dimension, 8 / bits codes to a byte, lowest bits first, so a token's codes stay one row of bytes
and a block stays one contiguous row range of every tensor.

Key groups never cross a layer's run of tokens inside a span (a span stores its layers one after
another): one layer's outliers never widen another layer's scale, and a reader can find the groups
of any (block, layer) from the token counts alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.errors import UsageError
from mmkv_cli.lazy import torch

BITS = (16, 8, 4, 2)  # 16: not quantized (the backbone's own dtype)
FLOAT16_MAX = 65504.0
MAX_GROUP = 1 << 16
CHUNK_TOKENS = 2048  # tokens dequantized at a time on a CPU (their float32 copies fit in cache)


@dataclass(frozen=True)
class QuantSpec:
    """How a pack's block KV is stored. bits 16 means as computed, in the backbone's dtype."""

    bits: int = 16  # bits per stored K/V value: 16 (unquantized), 8, 4 or 2
    group: int = 64  # tokens per key group (per channel); channels per value group (per token)

    @property
    def quantized(self) -> bool:
        return self.bits != 16

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
        if head_dim % (8 // self.bits):
            raise UsageError(f"head dim {head_dim} cannot be packed at {self.bits} bits")

    @classmethod
    def from_header(cls, stored, kv, where: str) -> QuantSpec | None:
        """A pack header's `quant`, checked against its `kv`: None when the K/V are stored as
        computed (every pack before v7)."""
        from mmkv_cli.errors import PackError

        if stored is None:
            return None
        try:
            if not isinstance(stored, dict) or not all(
                type(stored.get(k)) is int for k in ("bits", "group")
            ):
                raise ValueError
            quant = cls(stored["bits"], stored["group"])
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
        }


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2^bits) -> bytes [..., D * bits / 8], lowest bits first."""
    if bits == 8:
        return codes.to(torch.uint8)
    per_byte = 8 // bits
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: bytes [..., B] -> uint8 codes [..., B * 8 / bits]."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    # one shift per position in the byte, stacked: faster than a broadcast shift on the CPU
    codes = torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.reshape(*packed.shape[:-1], -1)


def _scale_zero(low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 2] float16 (scale, zero) for ranges [low, high]; refused when float16 cannot hold
    them."""
    if float(torch.maximum(low.abs().max(), high.abs().max())) > FLOAT16_MAX:
        raise UsageError(
            "KV values exceed float16's range, so they cannot be quantized: keep --kv-bits 16"
        )
    scale = (high - low) / ((1 << bits) - 1)
    return torch.stack([scale, low], dim=-1).to(torch.float16)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    # quantize against the stored (float16) scale and zero, so decoding adds no second rounding
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((x - zero) / safe).round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)


def key_groups(counts: list[int], group: int) -> torch.Tensor:
    """[sum counts] the key group of every token of a span whose layers keep `counts` tokens: each
    layer's run is cut into groups of `group` tokens on its own."""
    runs = torch.tensor(counts, dtype=torch.int64)
    per_run = (runs + group - 1) // group
    first_group = torch.cumsum(per_run, 0) - per_run
    first_token = torch.cumsum(runs, 0) - runs
    run_of = torch.repeat_interleave(torch.arange(len(counts)), runs)
    within = torch.arange(int(runs.sum())) - first_token[run_of]
    return first_group[run_of] + within // group


def key_ranges(x: torch.Tensor, counts: list[int], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (low, high) [groups, C] of every key group of token-major x [sum counts, C].
    A group is a contiguous run of tokens, so each layer's run reduces as whole groups (one
    reshape) plus its shorter last group: no per-token scatter."""
    lows, highs, first = [], [], 0
    for count in counts:
        whole = count // group * group
        for start, stop in ((first, first + whole), (first + whole, first + count)):
            if stop > start:
                runs = x[start:stop].reshape(-1, min(group, stop - start), x.shape[1])
                low, high = torch.aminmax(runs, dim=1)
                lows.append(low)
                highs.append(high)
        first += count
    if not lows:
        return x.new_empty(0, x.shape[1]), x.new_empty(0, x.shape[1])
    return torch.cat(lows), torch.cat(highs)


def quantize_keys(
    keys: torch.Tensor, counts: list[int], bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major keys [n, H, D] of a span -> (packed codes [n, H, D * bits / 8] uint8, scale and
    zero [groups, 2, H, D] float16), per channel over groups of `group` tokens of each layer."""
    n, heads, dim = keys.shape
    x = keys.float().reshape(n, heads * dim)
    low, high = key_ranges(x, counts, group)
    stored = _scale_zero(low, high, bits)  # [groups, C, 2]
    scale, zero = stored.float().unbind(-1)
    ids = key_groups(counts, group)
    codes = _codes(x, scale[ids], zero[ids], bits).reshape(n, heads, dim)
    groups = stored.shape[0]
    return pack_codes(codes, bits), stored.transpose(1, 2).reshape(groups, 2, heads, dim)


def quantize_values(
    values: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major values [n, H, D] -> (packed codes [n, H, D * bits / 8] uint8, scale and zero
    [n, H * D / group, 2] float16), per token over groups of `group` channels."""
    n, heads, dim = values.shape
    x = values.float().reshape(n, -1, group)
    stored = _scale_zero(x.amin(dim=-1), x.amax(dim=-1), bits)
    scale, zero = (t.unsqueeze(-1) for t in stored.float().unbind(-1))
    codes = _codes(x, scale, zero, bits).reshape(n, heads, dim)
    return pack_codes(codes, bits), stored


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes of n tokens' keys and values [n, H, B] -> ([n, H, D], [n, H, D]) of `dtype`.
    key_scales [groups, 2, H, D] holds each key group once, key_group [n] the group of every
    token; value_scales [n, groups, 2].

    On a CPU the tokens go a chunk at a time, so the float32 working copies stay in cache: five
    times faster than whole-tensor passes over a real context."""
    n, heads, width = keys.shape
    dim = width * 8 // bits
    out_keys = torch.empty(n, heads, dim, dtype=dtype, device=keys.device)
    out_values = torch.empty_like(out_keys)
    step = n if keys.device.type == "cuda" else CHUNK_TOKENS
    for first in range(0, n, max(1, step)):
        rows = slice(first, first + step)
        scales = key_scales.index_select(0, key_group[rows])
        out_keys[rows] = dequantize_keys(keys[rows], scales, bits)
        out_values[rows] = dequantize_values(values[rows], value_scales[rows], bits)
    return out_keys, out_values
