"""Codes packed into bytes: `bits` of them to a byte along the last axis, lowest bits first, so a
token's codes stay one row of bytes (quant.py, vidkv.py)."""

from __future__ import annotations

from mmkv_cli.core.lazy import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2^bits) -> bytes [..., D * bits / 8], lowest bits first."""
    if bits == 8:
        return codes.to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.to(torch.uint8)
    # each position in the byte OR-ed in from a strided view: a sum over a small last axis ran
    # slower on the CPU, where every block a pack is written with is quantized
    packed = codes[..., 0::per_byte].clone(memory_format=torch.contiguous_format)
    for position in range(1, per_byte):
        packed |= codes[..., position::per_byte] << position * bits
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: bytes [..., B] -> uint8 codes [..., B * 8 / bits]."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    # one shift per position in the byte, stacked: faster than a broadcast shift on the CPU
    codes = torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.reshape(*packed.shape[:-1], -1)
