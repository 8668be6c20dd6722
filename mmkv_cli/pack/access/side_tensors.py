"""A pack's small tensors beside its blocks, each checked whole against its digests as it is read:
the representatives, v9's spanning key scales and the prompt spans (prefix and suffix)."""

from __future__ import annotations

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.access.block_store import all_finite
from mmkv_cli.pack.integrity.finite import finite_stored
from mmkv_cli.pack.integrity.hashing import chunk_digests, digest_of
from mmkv_cli.pack.integrity.tensors import StoredTensors
from mmkv_cli.pack.quantized.vidkv import two_bit_flags_sound


def checked_representatives(
    tensors: StoredTensors, stored: dict, version: int, digest: str, where: str
) -> np.ndarray:
    """The representatives as stored ("reps"), checked against their digests (numpy: no torch).
    stored: the header as stored; digest: the name of the pack's hash."""
    array = tensors.array("reps")
    expected = (stored.get("integrity") or {}).get("reps")
    if version >= 8:  # a digest per chunk (checked on open), on threads
        whole = chunk_digests(array, expected["chunk"], digest) == expected[digest]
    else:
        whole = expected is None or digest_of([array], digest) == expected
    if not whole:
        raise PackError(f"{where} is corrupted (checksum mismatch in reps)")
    return array


def checked_key_scales(
    tensors: StoredTensors, stored: dict, digest: str, mixed: bool
) -> tuple[torch.Tensor | None, str | None]:
    """v9's key scales ("blocks.kq"): (them, None), or (None, what is wrong with them). A
    re-sealed forgery is refused too: a NaN or Inf anywhere in them, or (mixed: 1.5 bits) a
    channel flag that is not 0 or 1, or not half the channels 2-bit."""
    array = tensors.array("blocks.kq")
    expected = stored["integrity"]["key_scales"]
    if chunk_digests(array, expected["chunk"], digest) != expected[digest]:
        return None, "checksum mismatch"
    scales = torch.from_numpy(array).view(torch.float16)
    if not all_finite([scales]):
        return None, "NaN or Inf"
    if mixed and not two_bit_flags_sound(scales[:, 2]):
        return None, "channel flags not 0/1, half of them 1,"
    return scales, None


def checked_span(
    tensors: StoredTensors, name: str, meta: dict, digest: str, where: str
) -> tuple[np.ndarray, ...]:
    """A prompt span's stored K, V and positions, checked: its checksum, no NaN or Inf, its
    shared positions one layer's worth (numpy: no torch). meta: the span's header entry."""
    parts = [f"{name}.{part}" for part in ("k", "v", "pos")]
    k, v, pos = (tensors.array(part) for part in parts)
    if digest_of((k, v, pos), digest) != meta[digest]:
        raise PackError(f"{where} is corrupted (checksum mismatch in {name})")
    dtypes = [tensors.view(part)[1] for part in parts[:2]]
    if not all(finite_stored(a, dtype) for a, dtype in zip((k, v), dtypes)):
        raise PackError(f"{where} is corrupted (NaN or Inf in the K/V of {name})")
    counts = meta["layer_counts"]
    if meta.get("shared_positions") and (len(set(counts)) > 1 or pos.shape[0] != counts[0]):
        raise PackError(f"{where} is corrupted (positions of {name})")
    return k, v, pos
