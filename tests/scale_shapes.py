"""Spans at LLaVA-OV-7B's KV width (28 layers x 4 KV heads x 128, float16) for the tests that
cross the sizes a real pack reaches (docs/scale-tests.md)."""

from __future__ import annotations

import torch

from mmkv_cli.pack import Span

LAYERS, HEADS, DIM = 28, 4, 128  # LLaVA-OV-7B's language model (Qwen2-7B): 28 x 4 KV heads x 128


def block(name: str, tokens: int, seed: int, layers: int = LAYERS, keys: int | None = None) -> Span:
    """A frame at 7B width with a retrieval key for each layer (or `keys` of them: one makes a
    pack with one digest a block)."""
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(HEADS, tokens, DIM, generator=g).half() for _ in range(2 * layers)]
    return Span(
        name=name,
        keys=kv[:layers],
        values=kv[layers:],
        positions=[torch.arange(tokens).expand(3, -1) + seed * tokens for _ in range(layers)],
        granularity="frame",
        steps=(seed, seed + 1),
        time=(float(seed), seed + 0.5),
        representative=torch.randn(keys or layers, HEADS * DIM, generator=g).half(),
    )


def plain(name: str, tokens: int, layers: int = LAYERS) -> Span:
    return Span(
        name=name,
        keys=[torch.zeros(HEADS, tokens, DIM, dtype=torch.float16)] * layers,
        values=[torch.ones(HEADS, tokens, DIM, dtype=torch.float16)] * layers,
        positions=[torch.arange(tokens).expand(3, -1)] * layers,
    )


def constant_block(index: int, tokens: int, retrieval_keys: bool = False) -> Span:
    """A block at 7B width whose every key is index + layer / 32 and every value minus that:
    expanded views (a few bytes each until written), so a 4.5 GB pack costs no memory to build,
    and a read from the wrong offset cannot return the right numbers. retrieval_keys: a key a
    layer, as ReKV's and StreamingTOM's blocks (so a digest a layer, v12)."""
    keys = [
        torch.full((HEADS, 1, DIM), index + layer / 32, dtype=torch.float16).expand(-1, tokens, -1)
        for layer in range(LAYERS)
    ]
    return Span(
        name=f"b{index}",
        keys=keys,
        values=[-k for k in keys],
        positions=[torch.arange(tokens).expand(3, -1) + index * tokens] * LAYERS,
        granularity="frame",
        steps=(index, index + 1),
        time=(float(index), index + 0.5),
        representative=torch.full((LAYERS, HEADS * DIM), index / 1024, dtype=torch.float16)
        if retrieval_keys
        else None,
    )
