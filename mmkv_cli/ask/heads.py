"""A pack held per head, as the model's cache: each layer's KV heads joined, padded to the longest.

Such a pack stores each (layer, KV head) as a layer of one head (docs/kvpack.md), so the context is
built per head as it is per layer elsewhere (positions kept or compacted head by head). The model's
cache holds one [1, H_kv, n, D] tensor per layer: a head holding fewer entries is padded before its
own, so its entries and whatever a forward appends are one slice of its row, and each head attends
to its own slice (kernels.attention.masking): the padding is never computed.
"""

from __future__ import annotations

from mmkv_cli.lazy import torch


def join_heads(
    keys: list[torch.Tensor], values: list[torch.Tensor], heads: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, tuple[int, ...]]]:
    """Per (layer, KV head) K and V [1, n_h, D], layer-major -> per layer [H_kv, n, D] (n: the
    longest head's), and for each layer whose heads differ in length where each head's entries
    start. Heads of one length need nothing more (a per-layer pack's)."""
    joined_keys, joined_values, starts = [], [], {}
    for layer in range(len(keys) // heads):
        at = slice(layer * heads, (layer + 1) * heads)
        lengths = [int(k.shape[1]) for k in keys[at]]
        longest = max(lengths)
        joined_keys.append(_padded(keys[at], longest))
        joined_values.append(_padded(values[at], longest))
        if min(lengths) < longest:
            starts[layer] = tuple(longest - n for n in lengths)
    return joined_keys, joined_values, starts


def _padded(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """[1, n_h, D] each -> [H, length, D], zeros before each head's own entries."""
    first = parts[0]
    out = first.new_zeros(len(parts), length, first.shape[-1])
    for head, part in enumerate(parts):
        out[head, length - part.shape[1] :] = part[0]
    return out
