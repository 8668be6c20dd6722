"""Whether stored scales decode to finite values, from the scales alone: a quantized pack's
verdict on NaN and Inf (`verify`, and every read's later verdicts) without decoding its codes.
A code q stands for q * scale + zero in float32, monotone in q, so codes 0 and 2^bits - 1 bound
every value a pair decodes to."""

from __future__ import annotations

import numpy as np

from mmkv_cli.pack.integrity.finite import EXPONENTS

# a float32 of at least this magnitude becomes Inf as float16 (65504 is odd: a tie rounds up)
FLOAT16_INF_FROM = 65520.0
FLOAT16_INF_BITS = EXPONENTS["float16"][1]  # a float16's magnitude bits from Inf on


def decodes_finite(scale: np.ndarray, zero: np.ndarray, bits: int, dtype: str) -> np.ndarray:
    """For float16 scales and zeros (numpy, any shape, element by element): whether every value a
    code 0 .. 2^bits - 1 decodes to is finite in `dtype`, from the scales alone. Decoding makes
    code * scale + zero in float32, monotone in the code, so the extremes are codes 0 and the top
    one; float16 overflows from FLOAT16_INF_FROM, bfloat16 and float32 never at these sizes.

    Most pairs are settled by their bits: finite float16 decodes finite in bfloat16 and float32,
    and one whose |scale| and |zero| are under 2^(15 - bits) decodes under 2^15 in float16. Only
    the others are decoded (KV rarely reaches 2^(15 - bits): 2,048 at 4 bits): a StreamingTOM
    pack's value scales at 7B are 5.7M pairs, checked by every `verify`."""
    if scale.dtype == np.float16 and zero.dtype == np.float16:
        magnitude = [np.bitwise_and(t.view(np.uint16), 0x7FFF) for t in (scale, zero)]
        fine = (magnitude[0] < FLOAT16_INF_BITS) & (magnitude[1] < FLOAT16_INF_BITS)
        if dtype != "float16":
            return fine
        small = _float16_bits_of_decodable(bits)
        rest = np.flatnonzero(fine & ~((magnitude[0] < small) & (magnitude[1] < small)))
        if len(rest):
            fine.flat[rest] = _decodes_finite(scale.flat[rest], zero.flat[rest], bits, dtype)
        return fine
    return _decodes_finite(scale, zero, bits, dtype)


def _float16_bits_of_decodable(bits: int) -> int:
    """The float16 bits of 2^(15 - bits): a scale and zero both under it decode every code under
    2^15 in float16."""
    return ((15 - bits) + 15) << 10


def rows_decode_finite(pairs: np.ndarray, plane_axis: int, bits: int, dtype: str) -> np.ndarray:
    """Per row (axis 0) of stored scale/zero pairs (the pair on `plane_axis`): whether every pair
    decodes finite (decodes_finite). In float16, a row whose every value's magnitude is under
    both limits (Inf/NaN; in float16, 2^(15 - bits)) is settled by one pass over the bits; only
    the others are decoded pair by pair (from an honest writer, none)."""

    def pair_by_pair(rows: np.ndarray) -> np.ndarray:
        scale, zero = np.take(rows, 0, plane_axis), np.take(rows, 1, plane_axis)
        return decodes_finite(scale, zero, bits, dtype).reshape(len(rows), -1).all(axis=1)

    if not pairs.size:
        return np.ones(len(pairs), dtype=bool)
    if pairs.dtype != np.float16:
        return pair_by_pair(pairs)
    limit = _float16_bits_of_decodable(bits) if dtype == "float16" else FLOAT16_INF_BITS
    magnitude = np.bitwise_and(np.ascontiguousarray(pairs).view(np.uint16), 0x7FFF)
    if magnitude.max() < limit:  # one pass settles them all: a maximum over a short row is slow
        return np.ones(len(pairs), dtype=bool)
    fine = magnitude.reshape(len(pairs), -1).max(axis=1) < limit
    doubtful = np.flatnonzero(~fine)
    fine[doubtful] = pair_by_pair(pairs[doubtful])
    return fine


def _decodes_finite(scale: np.ndarray, zero: np.ndarray, bits: int, dtype: str) -> np.ndarray:
    """decodes_finite worked out for every pair."""
    with np.errstate(all="ignore"):
        s, z = scale.astype(np.float32), zero.astype(np.float32)
        top = np.float32((1 << bits) - 1) * s + z
        fine = np.isfinite(s) & np.isfinite(z) & np.isfinite(top)
        if dtype == "float16":
            fine &= (np.abs(z) < FLOAT16_INF_FROM) & (np.abs(top) < FLOAT16_INF_FROM)
    return fine
