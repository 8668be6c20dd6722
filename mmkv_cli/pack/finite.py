"""NaN and Inf in stored bytes, found with numpy alone: `verify` of a pack stored as computed
checks every value without importing torch (a quantized pack's values are decoded first, by torch).
"""

from __future__ import annotations

import numpy as np

BF16_EXPONENT = 0x7F80  # all ones in a bfloat16's exponent: Inf or NaN


def finite_stored(array: np.ndarray, dtype: str) -> bool:
    """Whether every value of `array` (as stored; bfloat16 read as uint16) is finite; `dtype` is
    the torch dtype name the bytes mean."""
    if not array.size:
        return True
    if dtype == "bfloat16":
        return not bool(((array.view(np.uint16) & BF16_EXPONENT) == BF16_EXPONENT).any())
    if np.issubdtype(array.dtype, np.floating):
        return bool(np.isfinite(array).all())
    return True
