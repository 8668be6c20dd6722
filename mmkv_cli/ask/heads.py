"""A pack held per head, as the model's cache: each layer's KV heads joined, padded to the longest.

Such a pack stores each (layer, KV head) as a layer of one head (docs/kvpack.md), so the context is
built per head as it is per layer elsewhere (positions kept or compacted head by head). The model's
cache holds one [1, H_kv, n, D] tensor per layer: a head holding fewer entries is padded before its
own, so its entries and whatever a forward appends are one slice of its row, and each head attends
to its own slice (kernels.attention.masking): the padding is never computed.
"""

from __future__ import annotations

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.rope import rotate_keys


def join_heads(
    keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]], heads: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, tuple[int, ...]]]:
    """Per (layer, KV head), layer-major, the pieces of its K and V in context order ([1, n, D]
    each) -> per layer [H_kv, n, D] (n: the longest head's), each head's pieces copied once into
    place and let go, and for each layer whose heads differ in length where each head's entries
    start. Heads of one length need nothing more (a per-layer pack's)."""
    joined_keys, joined_values, starts = [], [], {}
    for layer in range(len(keys) // heads):
        at = slice(layer * heads, (layer + 1) * heads)
        lengths = [sum(int(p.shape[1]) for p in pieces) for pieces in keys[at]]
        longest = max(lengths)
        joined_keys.append(_padded(keys, at, longest))
        joined_values.append(_padded(values, at, longest))
        if min(lengths) < longest:
            starts[layer] = tuple(longest - n for n in lengths)
    return joined_keys, joined_values, starts


def rotate_pieces(
    pieces: list[torch.Tensor], delta: torch.Tensor, inv_freq, axes
) -> list[torch.Tensor]:
    """rotate_keys over one head's context held in pieces ([1, n_i, D]; delta [P, sum n_i])."""
    lengths = [int(p.shape[1]) for p in pieces]
    moved = torch.split(delta, lengths, dim=1)
    return [rotate_keys(p, d, inv_freq, axes) for p, d in zip(pieces, moved)]


def _padded(parts: list[list[torch.Tensor]], at: slice, length: int) -> torch.Tensor:
    """The heads `parts[at]` (each a list of [1, n_i, D] pieces) -> [H, length, D], zeros before
    each head's own entries; the pieces are let go as they are copied."""
    first = parts[at][0][0]
    out = first.new_zeros(len(parts[at]), length, first.shape[-1])
    for head, index in enumerate(range(*at.indices(len(parts)))):
        pieces, parts[index] = parts[index], []
        stop = length
        for piece in reversed(pieces):
            out[head, stop - piece.shape[1] : stop] = piece[0]
            stop -= piece.shape[1]
    return out
