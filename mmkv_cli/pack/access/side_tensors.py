"""A pack's small tensors beside its blocks, each checked whole against its digests as it is read:
the representatives, v9's spanning key scales and the prompt spans (prefix and suffix); and the
holder a reader keeps the first two in (SideTensors)."""

from __future__ import annotations

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.access.block_store import all_finite
from mmkv_cli.pack.integrity.finite import finite_stored
from mmkv_cli.pack.integrity.hashing import chunk_digests, digest_of
from mmkv_cli.pack.integrity.tensors import StoredTensors
from mmkv_cli.pack.quantized.vidkv import two_bit_flags_sound
from mmkv_cli.pack.schema.format import EMBEDS


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


def checked_embeddings(tensors: StoredTensors, stored: dict, digest: str, where: str) -> np.ndarray:
    """v13's embeddings as stored ("embeds", float16 bits), checked: their digests, no NaN or Inf
    (a re-sealed forgery would make every frame's score NaN)."""
    array = tensors.array(EMBEDS)
    expected = stored["integrity"][EMBEDS]
    if chunk_digests(array, expected["chunk"], digest) != expected[digest]:
        raise PackError(f"{where} is corrupted (checksum mismatch in embeds)")
    if not finite_stored(array, "float16"):
        raise PackError(f"{where} is corrupted (NaN or Inf in embeds)")
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


class SideTensors:
    """A pack's representatives, v9's key scales and v13's embeddings, each read and checked once,
    on first use,
    then held: a session asks many questions of one index (an hour's per-layer ReKV index at 7B
    is 51 MB in bf16, twice that as float32). Callers must not write into what they are given."""

    def __init__(self, tensors: StoredTensors, stored: dict, version: int, digest: str, quant,
                 where: str):  # fmt: skip
        self.tensors, self.stored, self.version = tensors, stored, version
        self.digest, self.quant, self.where = digest, quant, where
        self._reps: torch.Tensor | None = None
        self._key_scales: torch.Tensor | None = None
        self._embeds: torch.Tensor | None = None

    def representatives(self) -> torch.Tensor | None:
        """[blocks, layers, dim] retrieval keys (layers: 1 unless stored per layer) in the dtype
        they are stored in (v7 on: the KV's), or None."""
        if not self.stored.get("representatives"):
            return None
        if self._reps is None:
            stored = self.stored_representatives()
            dtype = getattr(torch, self.tensors.view("reps")[1])
            reps = torch.from_numpy(stored).view(dtype)  # scores convert the rows they compare
            self._reps = reps.unsqueeze(1) if reps.dim() == 2 else reps  # v2-v5: [blocks, dim]
        return self._reps

    def stored_representatives(self) -> np.ndarray | None:
        """The representatives as stored, checked against their digests, or None (numpy: no
        torch)."""
        if not self.stored.get("representatives"):
            return None
        return checked_representatives(
            self.tensors, self.stored, self.version, self.digest, self.where
        )

    def embeddings(self) -> torch.Tensor | None:
        """v13: [tokens, dim] float16 unit rows, the blocks' tokens as the language model took them
        in, one a token each block's first layer holds, in table order; None where not kept."""
        if self._embeds is None and self.stored.get("embeddings"):
            self._embeds = torch.from_numpy(self.stored_embeddings()).view(torch.float16)
        return self._embeds

    def stored_embeddings(self) -> np.ndarray | None:
        """v13's embeddings as stored, checked, or None (numpy: no torch)."""
        if not self.stored.get("embeddings"):
            return None
        return checked_embeddings(self.tensors, self.stored, self.digest, self.where)

    @property
    def rotated_representatives(self) -> bool:
        """Whether the representatives are means of keys after RoPE (packs before v6, and MuKV's
        code: keys as each block was prefilled after the init prompt)."""
        return (self.stored.get("representatives") or {}).get("space") != "pre_rope"

    def key_scales(self, path: str) -> torch.Tensor:
        """v9: the spanning key groups' planes [groups, planes, H, D] float16 (scales and zeros;
        at 1.5 bits also which channels are 2-bit and the values' means; about 0.8% of the fp16
        KV at a group of 128 tokens). A re-sealed forgery is refused too: a NaN or Inf anywhere in
        them, or (1.5 bits) a channel flag that is not 0 or 1, or not half the channels 2-bit."""
        fault = self.key_scales_fault()
        if fault:
            raise PackError(f"{path} is corrupted ({fault} in the key scales)")
        return self._key_scales

    def key_scales_fault(self) -> str | None:
        """What is wrong with the key scales (None: nothing; they are then held)."""
        if self._key_scales is not None:
            return None
        scales, fault = checked_key_scales(self.tensors, self.stored, self.digest,
                                           self.quant.mixed)  # fmt: skip
        if not fault:
            self._key_scales = scales
        return fault
