"""Question-aware pruning at ask (`mmkv ask PACK q --prune aircache --budget 0.1`).

The question is prefilled over the whole context (so the first token sees everything), its attention rows
score the context's visual tokens, and every layer drops what its method rejects before decoding: the
setting the AirCache and MEDA papers measure (faster decoding, less KV). Text KV is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmkv_cli.errors import UsageError


@dataclass(frozen=True)
class AskPrune:
    method: str
    budget: float
    params: dict
    keep: Callable  # (rows, visual slices, question slices, budget, params) -> local indices per layer


def ask_pruner(method: str, budget: float | None) -> AskPrune:
    from mmkv_cli.methods import METHODS, build_method

    preset, policy = build_method(method, budget)
    module = METHODS[preset.implements]
    if not hasattr(module, "prune_at_ask"):
        able = ", ".join(sorted(n for n, m in METHODS.items() if hasattr(m, "prune_at_ask")))
        raise UsageError(f"method '{method}' does not prune at ask ({able} do)")
    return AskPrune(method, policy.budget, preset.params, module.prune_at_ask)


def prune_context(
    cache,
    rows: dict[int, torch.Tensor],
    prefix: list[int],
    visual: list[int],
    question: int,
    prune: AskPrune,
) -> list[int]:
    """Cut each layer's visual span [prefix, prefix + visual) of `cache` to what `prune` keeps.

    rows: layer -> [1, question, keys] the question's attention. Returns the KV tokens per layer after.
    """
    layers = len(cache.layers)
    lengths = [int(cache.layers[l].keys.shape[2]) for l in range(layers)]
    spans = [slice(prefix[l], prefix[l] + visual[l]) for l in range(layers)]
    asked = [slice(lengths[l] - question, lengths[l]) for l in range(layers)]
    keep = prune.keep(
        [rows[l][0].cpu() for l in range(layers)], spans, asked, prune.budget, prune.params
    )
    for layer, local in enumerate(keep):
        entry, span = cache.layers[layer], spans[layer]
        index = torch.cat(
            [torch.arange(span.start), span.start + local, torch.arange(span.stop, lengths[layer])]
        ).to(entry.keys.device)
        entry.keys, entry.values = entry.keys[:, :, index], entry.values[:, :, index]
    return [int(e.keys.shape[2]) for e in cache.layers]
