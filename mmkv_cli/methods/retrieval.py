"""Block retrieval at ask (MuKV, ReKV): cosine (or dot-product) scores of the question vector
against the blocks' representatives, both taken before RoPE so neither says where it sat; per
granularity over-retrieve 2k, rerank patch/frame candidates against the top segments, keep k. With
layers "each", every layer makes that choice with its own vectors. A context policy, not a method:
MuKV and ReKV both build one from their parameters."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mmkv_cli.errors import PackError
from mmkv_cli.lazy import torch
from mmkv_cli.methods.base import QuestionVector, Selection
from mmkv_cli.methods.context import last_shown
from mmkv_cli.methods.scoring import SIMILARITY, cosine_scores
from mmkv_cli.pack.table import eligible_at

if TYPE_CHECKING:
    from mmkv_cli.pack.table import BlockTable


@dataclass(frozen=True)
class RetrievalOptions:
    k: dict[str, int]  # blocks kept per granularity; granularities missing here are never retrieved
    rerank: dict[str, float] = field(default_factory=dict)  # lambda_g per granularity
    top_segments: int = 0  # segments whose mean representative reranks the others (0: no rerank)
    query: str = "query_mean"  # query_mean | last_key
    positions: str = "keep"  # keep | reindex
    similarity: str = "cosine"  # cosine | dot
    layers: str = "last"  # last: one choice from the last layer's vectors; each: one per layer
    # before: the question's vectors from a forward of its own, then one choice for every layer;
    # in_forward (layers "each"): each layer chooses inside the answering forward, from the
    # question's query there (the layers below have attended their blocks by then)
    when: str = "before"


@dataclass
class Retrieved:
    index: int  # into the candidate list
    granularity: str
    score: float
    reranked: float


def retrieve(
    scores: torch.Tensor,
    reps: torch.Tensor,
    granularity: list[str] | tuple[torch.Tensor, list[str]],
    k: dict[str, int],
    rerank: dict[str, float],
    top_segments: int,
) -> list[Retrieved]:
    """Pick blocks per granularity: top 2k by score, rerank by agreement with the top segments, keep
    k.

    rerank[g] = lambda_g: s' = (1 - lambda) s + lambda cos(rep, c), c = mean of the top segments'
    reps. granularity: one label per block, or (codes [blocks], kinds) with kinds[code] the label.
    Returns the picks, best first within each granularity. Whole-table work is vectorised: thousands
    of blocks cost a few tensor ops, not Python loops.
    """
    if isinstance(granularity, tuple):
        codes, kinds = granularity
    else:
        kinds = list(dict.fromkeys(granularity))
        codes = torch.tensor([kinds.index(g) for g in granularity], dtype=torch.int64)
    scores = scores.float()
    centre = None  # mean representative of the best segments
    if "segment" in kinds and top_segments > 0:
        segments = torch.nonzero(codes == kinds.index("segment")).flatten()
        if len(segments):
            best = segments[torch.topk(scores[segments], min(top_segments, len(segments))).indices]
            centre = reps[best].float().mean(dim=0)
    picks = []
    for g, keep in k.items():
        if g not in kinds or keep <= 0:
            continue
        members = torch.nonzero(codes == kinds.index(g)).flatten()
        candidates = members[torch.topk(scores[members], min(2 * keep, len(members))).indices]
        lam = float(rerank.get(g, 0.0))
        before = scores[candidates]
        after = before
        if centre is not None and lam:
            after = (1 - lam) * before + lam * cosine_scores(centre, reps[candidates])
        order = torch.argsort(-after, stable=True)[:keep]
        picks += [
            Retrieved(c, g, s, r)
            for c, s, r in zip(
                candidates[order].tolist(), before[order].tolist(), after[order].tolist()
            )
        ]
    return picks


class RetrievalContext:
    """Top-k blocks per granularity by the question, in time order; positions kept or compacted."""

    def __init__(self, options: RetrievalOptions):
        self.options = options
        self.position_mode = options.positions

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: QuestionVector,
        at: float | None = None,
    ) -> Selection:
        o = self.options
        eligible = eligible_at(blocks, at)
        if not len(eligible):
            return Selection([], [])
        stored = reps()  # [eligible, stored layers, dim]: every block, unless some start later
        if not np.array_equal(eligible, np.arange(len(stored))):
            stored = stored[torch.as_tensor(eligible)]
        if o.when == "in_forward":
            ends_at = last_shown(blocks, eligible, at)
            layerwise = LayerByLayer(self, blocks, eligible, stored, ends_at)
            return Selection([], [], ends_at, in_forward=layerwise)
        query = question_vector(o.query)  # [layers, dim]
        if o.layers == "each":
            check_stored_layers(stored, query.shape[0])
        codes = torch.as_tensor(blocks.codes()[eligible])
        chosen = [-1] if o.layers == "last" else range(query.shape[0])
        per_layer = [self._pick(blocks, eligible, codes, stored[:, i], query[i]) for i in chosen]
        return self.selection(blocks, per_layer, last_shown(blocks, eligible, at))

    def selection(self, blocks: BlockTable, per_layer: list[dict], ends_at: str | None):
        """The Selection of what each layer picked (one entry: every layer took the same)."""
        o = self.options
        best: dict[int, tuple[Retrieved, int]] = {}  # row -> its best pick and how many layers
        for picks in per_layer:
            for row, pick in picks.items():
                held, count = best.get(row, (pick, 0))
                best[row] = (pick if pick.score > held.score else held, count + 1)
        rows = context_order(blocks, {row: pick for row, (pick, _) in best.items()})
        times = blocks.times()
        explain = []
        for row in rows:
            pick, count = best[row]
            time = times[row].tolist()
            entry = {
                "block": blocks.name(row),
                "granularity": pick.granularity,
                "time": None if math.isnan(time[0]) else time,
                "score": round(pick.score, 4),
                "reranked": round(pick.reranked, 4),
            }
            if o.layers == "each":
                entry["layers"] = count
            explain.append(entry)
        names = [e["block"] for e in explain]
        layered = None
        if o.layers == "each":
            order = {row: i for i, row in enumerate(rows)}
            layered = [
                [blocks.name(r) for r in sorted(picks, key=order.__getitem__)]
                for picks in per_layer
            ]
        return Selection(names, explain, ends_at, layered)

    def _pick(self, blocks, eligible, codes, reps: torch.Tensor, query: torch.Tensor) -> dict:
        """Table row -> Retrieved for the blocks one set of vectors picks."""
        o = self.options
        scores = SIMILARITY[o.similarity](query, reps)
        picks = retrieve(scores, reps, (codes, blocks.kinds), o.k, o.rerank, o.top_segments)
        return {int(eligible[p.index]): p for p in picks}


class LayerByLayer:
    """Retrieval inside the answering forward (ReKV's code): layer l picks its blocks with the
    question's query at layer l, which already saw what layers below l retrieved."""

    def __init__(self, context: RetrievalContext, blocks, eligible, stored, ends_at: str | None):
        self.context, self.blocks, self.eligible, self.stored = context, blocks, eligible, stored
        self.query = context.options.query  # query_mean | last_key
        self.codes = torch.as_tensor(blocks.codes()[eligible])
        self.ends_at = ends_at
        self.picked: dict[int, dict] = {}  # layer -> table row -> Retrieved

    def check_layers(self, layers: int) -> None:
        """Refuse a pack without a retrieval key for each of the model's `layers`."""
        check_stored_layers(self.stored, layers)

    def pick(self, layer: int, vector: torch.Tensor) -> list[str]:
        """Layer `layer`'s blocks, in context order, for its question vector [dim] (before
        RoPE)."""
        picks = self.context._pick(
            self.blocks, self.eligible, self.codes, self.stored[:, layer], vector
        )
        self.picked[layer] = picks
        return [self.blocks.name(r) for r in context_order(self.blocks, picks)]

    def selection(self) -> Selection:
        """What every layer picked, once the forward has run."""
        per_layer = [self.picked.get(layer, {}) for layer in range(self.stored.shape[1])]
        return self.context.selection(self.blocks, per_layer, self.ends_at)


def check_stored_layers(stored: torch.Tensor, layers: int) -> None:
    """Refuse representatives [blocks, stored layers, dim] without a key for each of `layers`."""
    if stored.shape[1] != layers:
        raise PackError(
            f"this pack stores a retrieval key for {stored.shape[1]} of {layers} layers: "
            "per-layer retrieval needs a pack encoded with layers: each"
        )


def context_order(blocks: BlockTable, picks: dict[int, Retrieved]) -> list[int]:
    """Table rows of `picks` in the order they enter the context: time, then segment before frame
    before patch (a coarser block first)."""
    rank = {g: r for r, g in enumerate(("segment", "frame", "patch"))}
    starts = blocks.start_steps()  # one column for the whole table, not one per compared row
    return sorted(picks, key=lambda r: (int(starts[r]), rank.get(picks[r].granularity, 3), r))
