"""The question as retrieval vectors, one per layer: from a forward of its own before the context is
built (`question_vector`), or inside the answering forward, where each layer's blocks are read in
just before its attention runs (`in_forward_splice`, ReKV's code)."""

from __future__ import annotations

import torch

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.errors import UsageError
from mmkv_cli.kernels.attention import Recorder, Splice, recording
from mmkv_cli.kernels.rope import unrotate
from mmkv_cli.methods.base import LayerRetrieval
from mmkv_cli.pack import PackReader


def layer_vector(
    rows: torch.Tensor,
    at: torch.Tensor,
    kv_heads: int,
    rotated: bool,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """One layer's retrieval vector [H_kv * D] from the question's rows [H, n, D] after RoPE at
    positions [P, n]: rotated back (unless the pack's representatives are rotated too), averaged
    over the rows and over the query heads sharing a KV head, so it lives where the blocks'
    representatives do."""
    vector = rows.float()
    if not rotated:
        vector = unrotate(vector, at, *rope)
    vector = vector.mean(dim=1)  # [H, D]
    return vector.reshape(kv_heads, -1, vector.shape[-1]).mean(dim=1).reshape(-1)


def question_vector(
    backbone: Backbone, reader: PackReader, ids: list[int], mode: str
) -> torch.Tensor:
    """The question as one retrieval vector per layer [layers, H_kv * D], from a forward over
    [init prompt + question] (no video).

    query_mean: each layer's queries averaged over the question's tokens and over the query heads
    sharing a KV head; last_key: each layer's key of the question's last token. Both are rotated
    back to before RoPE, as the representatives of a v6 pack are (older packs averaged keys after
    RoPE: their question vectors stay rotated too).
    """
    prefix = reader.span("prefix")
    cache = backbone.cache_from_layers(prefix.keys, prefix.values)
    layers = len(prefix.keys)
    check_query_mode(mode)
    recorder = Recorder(layers=set(range(layers)), queries=mode == "query_mean")
    positions = backbone.text_positions(prefix.layer_counts[0], len(ids))
    with recording(recorder):
        backbone.forward(backbone.embed_ids(ids), positions, cache)
    rope, rotated = backbone.rope_tables(), reader.rotated_representatives
    out = []
    for layer in range(layers):
        if mode == "last_key":
            rows, at = cache.layers[layer].keys[0, :, -1:], positions[:, -1:]
        else:
            rows, at = recorder.query[layer][0], positions  # [H, q, D]
        out.append(layer_vector(rows, at, prefix.keys[layer].shape[0], rotated, rope))
    return torch.stack(out).cpu()  # one wait for every layer's query


def check_query_mode(mode: str) -> None:
    if mode not in ("query_mean", "last_key"):
        raise UsageError(f"unknown query mode '{mode}' (query_mean, last_key)")


def in_forward_splice(
    backbone: Backbone,
    reader: PackReader,
    retrieval: LayerRetrieval,
    cache,
    positions: torch.Tensor,
    asked: int,
) -> Splice:
    """A splice for the answering forward over `cache` (the prefix, then what follows the blocks):
    at each layer the question's vector is taken from its own rows there (the last `asked` of the
    forward's tokens, at `positions` [P, n]), that layer's blocks are chosen and read, and put in
    after the prefix, in the cache too, so decoding attends them. One wait a layer: its choice
    names blocks of the file."""
    check_query_mode(retrieval.query)
    prefix = reader.span("prefix").layer_counts
    retrieval.check_layers(len(prefix))
    rope, rotated = backbone.rope_tables(), reader.rotated_representatives
    at = positions[:, -1:] if retrieval.query == "last_key" else positions[:, -asked:]

    def splice(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        if retrieval.query == "last_key":
            rows = key[0, :, -1:]
        else:
            rows = query[0, :, -asked:]
        vector = layer_vector(rows, at, key.shape[1], rotated, rope).cpu()
        names = retrieval.pick(layer, vector)
        if not names:
            return key, value
        only = [names if i == layer else [] for i in range(len(prefix))]
        keys, values, _ = reader.gather(names, only, backbone.device)
        entry, cut = cache.layers[layer], prefix[layer]
        entry.keys, entry.values = (
            torch.cat([t[:, :, :cut], _onto(b[layer], t)[None], t[:, :, cut:]], dim=2)
            for t, b in ((key, keys), (value, values))
        )
        return entry.keys, entry.values

    return splice


def _onto(read: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows read from the pack, on the cache's device in its dtype, without a wait."""
    return read.to(like.device, like.dtype, non_blocking=True)
