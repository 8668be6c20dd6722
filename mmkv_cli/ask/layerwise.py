"""The question as retrieval vectors, one per layer: from a forward of its own before the context is
built (`question_vector`), or inside the answering forward, where each layer's blocks are read in
just before its attention runs (`in_forward_splice`, ReKV's code)."""

from __future__ import annotations

import time

import torch

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.core.errors import UsageError
from mmkv_cli.kernels.attention import Recorder, Splice, recording
from mmkv_cli.kernels.rope import compact_positions, rotate_keys, unrotate
from mmkv_cli.methods.base import LayerRetrieval
from mmkv_cli.pack import LaterVerdicts, PackReader


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
    with_suffix: bool = True,
    reindex_to: int | None = None,
    spent: dict[str, float] | None = None,
    later: LaterVerdicts | None = None,
) -> Splice:
    """A splice for the answering forward over `cache` (the prefix, then the stored suffix unless
    `with_suffix` is off): at each layer the question's vector is taken from its own rows there
    (the last `asked` of the forward's tokens, at `positions` [P, n]), that layer's blocks are
    chosen and read, and put in after the prefix, in the cache too, so decoding attends them. One
    wait a layer: its choice names blocks of the file.

    reindex_to: the forward's first position; each layer's context is then compacted to
    consecutive slots ending right before it, keys re-rotated (positions reindex). Attention sees
    only distances, so this is the question right after the compacted context, in every layer,
    though the question's position was set before any layer chose.

    spent: seconds the layers spent choosing ("select") and reading ("read") are added there, from
    the moment each layer's question vector reached the host, so the forward's own work is not
    counted (on a GPU the copies to the device run on after). later: where a quantized layer's
    NaN/Inf verdict goes, for the first token to read (not a second wait a layer)."""
    check_query_mode(retrieval.query)
    prefix = reader.span("prefix")
    counts = prefix.layer_counts
    retrieval.check_layers(len(counts))
    tails = reader.span("suffix").positions if with_suffix else None
    rope, rotated = backbone.rope_tables(), reader.rotated_representatives
    at = positions[:, -1:] if retrieval.query == "last_key" else positions[:, -asked:]
    fresh = positions.shape[1]

    def splice(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        rows = key[0, :, -1:] if retrieval.query == "last_key" else query[0, :, -asked:]
        vector = layer_vector(rows, at, key.shape[1], rotated, rope).cpu()
        began = time.perf_counter()
        names = retrieval.pick(layer, vector)
        chosen = time.perf_counter()
        if spent is not None:
            spent["select"] = spent.get("select", 0.0) + chosen - began
        if not names and reindex_to is None:
            return key, value
        cut, held = counts[layer], key.shape[2] - fresh
        read = ([], [], [])
        if names:
            only = [names if i == layer else [] for i in range(len(counts))]
            read = tuple(
                part[layer : layer + 1]
                for part in reader.gather(names, only, backbone.device, later=later)
            )
            if spent is not None:
                spent["read"] = spent.get("read", 0.0) + time.perf_counter() - chosen
        joined = [
            torch.cat([t[0, :, :cut], *(_onto(r, t) for r in got), t[0, :, cut:held]], dim=1)
            for t, got in ((key, read[0]), (value, read[1]))
        ]
        if reindex_to is not None:
            tail = tails[layer] if tails is not None else prefix.positions[layer][:, :0]
            old = torch.cat([prefix.positions[layer], *read[2], tail], dim=1)
            new = compact_positions(old, 0)
            new += reindex_to - (int(new.max()) + 1)  # host positions: no wait
            joined[0] = rotate_keys(joined[0], new - old, *rope)
        entry = cache.layers[layer]
        entry.keys, entry.values = (
            torch.cat([j[None].to(t.dtype), t[:, :, held:]], dim=2)
            for j, t in zip(joined, (key, value))
        )
        return entry.keys, entry.values

    return splice


def _onto(read: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows read from the pack, on the cache's device in its dtype, without a wait."""
    return read.to(like.device, like.dtype, non_blocking=True)
