"""Block retrieval at ask (MuKV, ReKV): cosine (or dot-product) scores of the question vector
against the blocks' representatives, both taken before RoPE so neither says where it sat; per
granularity over-retrieve 2k, rerank patch/frame candidates against the top segments, keep k. With
layers "each", every layer makes that choice with its own vectors. A context policy, not a method:
MuKV and ReKV both build one from their parameters."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.methods.base import QuestionVector, Selection, TakenIn
from mmkv_cli.methods.context import last_shown
from mmkv_cli.methods.scoring import SIMILARITY, cosine_scores
from mmkv_cli.pack import eligible_at

if TYPE_CHECKING:
    from mmkv_cli.pack import BlockTable


@dataclass(frozen=True)
class RetrievalOptions:
    k: dict[str, int]  # blocks kept per granularity; granularities missing here are never retrieved
    rerank: dict[str, float] = field(default_factory=dict)  # lambda_g per granularity
    top_segments: int = 0  # segments whose mean representative reranks the others (0: no rerank)
    chunk: int = 1  # blocks retrieved together: runs of this many, by their mean score (ReKV)
    query: str = "query_mean"  # query_mean | last_key
    positions: str = "keep"  # keep | reindex
    similarity: str = "cosine"  # cosine | dot
    layers: str = "last"  # last: one choice from the last layer's vectors; each: one per layer
    # before: the question's vectors from a forward of its own, then one choice for every layer;
    # in_forward (layers "each"): each layer chooses inside the answering forward, from the
    # question's query there (the layers below have attended their blocks by then)
    when: str = "before"


@dataclass(frozen=True)
class Picks:
    """What one layer retrieved, best first within each granularity: each block's index (into
    the blocks scored, or its table row), granularity, score and reranked score."""

    index: np.ndarray  # int64
    granularity: list[str]
    score: np.ndarray  # float64 (the float32 scores, exactly)
    reranked: np.ndarray

    @staticmethod
    def none() -> Picks:
        return Picks(np.zeros(0, np.int64), [], np.zeros(0), np.zeros(0))


def retrieve(
    scores: torch.Tensor,
    reps: torch.Tensor,
    granularity: list[str] | tuple[torch.Tensor, list[str]],
    k: dict[str, int],
    rerank: dict[str, float],
    top_segments: int,
    chunk: int = 1,
) -> list[Picks]:
    """Pick blocks per granularity for every layer at once: top 2k by score, rerank by agreement
    with the top segments, keep k. With chunk > 1 (no rerank) runs of `chunk` consecutive blocks
    of a granularity are scored by their mean (the last run may be shorter) and the best
    k / chunk runs kept whole: `reranked` is the run's mean.

    scores [layers, blocks]; reps [blocks, layers, dim], each layer's own representatives.
    rerank[g] = lambda_g: s' = (1 - lambda) s + lambda cos(rep, c), c = mean of the top segments'
    reps. granularity: one label per block, or (codes [blocks], kinds) with kinds[code] the label.
    Returns each layer's picks. Whole-table work is a few tensor ops for every layer together:
    a pack retrieved layer by layer scores its blocks 28 times a question at 7B.
    """
    if isinstance(granularity, tuple):
        codes, kinds = granularity
    else:
        kinds = list(dict.fromkeys(granularity))
        codes = torch.tensor([kinds.index(g) for g in granularity], dtype=torch.int64)
    scores = scores.float()
    layers = torch.arange(scores.shape[0], device=scores.device)[:, None]
    centre = None  # each layer's mean representative of its best segments
    if "segment" in kinds and top_segments > 0:
        segments = torch.nonzero(codes == kinds.index("segment")).flatten()
        if len(segments):
            top = torch.topk(scores[:, segments], min(top_segments, len(segments)), dim=1)
            centre = reps[segments[top.indices], layers].float().mean(dim=1)
    found = []
    for g, keep in k.items():
        if g not in kinds or keep <= 0:
            continue
        members = torch.nonzero(codes == kinds.index(g)).flatten()
        if chunk > 1:
            found.append((g, *_runs(scores[:, members], members, keep // chunk, chunk)))
            continue
        top = torch.topk(scores[:, members], min(2 * keep, len(members)), dim=1)
        candidates = members[top.indices]
        before = scores.gather(1, candidates)
        after = before
        lam = float(rerank.get(g, 0.0))
        if centre is not None and lam:
            after = (1 - lam) * before + lam * cosine_scores(centre, reps[candidates, layers])
        order = torch.argsort(-after, dim=1, stable=True)[:, :keep]
        chosen = [t.gather(1, order).cpu().numpy() for t in (candidates, before, after)]
        found.append((g, *chosen))
    if not found:
        return [Picks.none() for _ in range(scores.shape[0])]
    picks = []
    for layer in range(scores.shape[0]):
        # a run past the last block leaves its slots empty (-1): each layer drops its own
        kept = [(g, *(a[layer] for a in arrays)) for g, *arrays in found]
        kept = [(g, i[i >= 0], s[i >= 0], r[i >= 0]) for g, i, s, r in kept]
        labels = [g for g, index, _, _ in kept for _ in range(len(index))]
        index, score, reranked = (np.concatenate([f[i] for f in kept]) for i in (1, 2, 3))
        picks.append(Picks(index, labels, score.astype(np.float64), reranked.astype(np.float64)))
    return picks


def _runs(scores: torch.Tensor, members: torch.Tensor, runs: int, chunk: int) -> tuple:
    """The best `runs` runs of `chunk` consecutive members by mean score, per layer (scores
    [layers, n]): (member indices, scores, run means) [layers, runs x chunk], best run first, in
    time order within a run, -1 where a short last run has no block."""
    n = scores.shape[1]
    run_of = torch.arange(n, device=scores.device) // chunk
    count = -(-n // chunk)
    sums = torch.zeros(scores.shape[0], count, device=scores.device).index_add_(1, run_of, scores)
    means = sums / torch.bincount(run_of, minlength=count).to(scores.dtype)
    top = torch.topk(means, min(runs, count), dim=1).indices  # [layers, runs]
    slots = (top[:, :, None] * chunk + torch.arange(chunk, device=scores.device)).flatten(1)
    inside = slots < n
    at = slots.clamp(max=n - 1)
    chosen = torch.where(inside, members[at], -1)
    score = torch.where(inside, scores.gather(1, at), float("nan"))
    mean = means.gather(1, top).repeat_interleave(chunk, dim=1)
    return tuple(t.cpu().numpy() for t in (chosen, score, mean))


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
        taken_in: TakenIn | None = None,
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
        chosen = slice(-1, None) if o.layers == "last" else slice(None)
        per_layer = self._pick(blocks, eligible, codes, stored[:, chosen], query[chosen])
        return self.selection(blocks, per_layer, last_shown(blocks, eligible, at))

    def selection(self, blocks: BlockTable, per_layer: list[Picks], ends_at: str | None):
        """The Selection of what each layer picked (one entry: every layer took the same). A
        block taken by several layers is explained by its best pick (the first of equals)."""
        o = self.options
        rows = np.concatenate([p.index for p in per_layer])
        scores = np.concatenate([p.score for p in per_layer])
        reranked = np.concatenate([p.reranked for p in per_layer])
        labels = [g for p in per_layer for g in p.granularity]
        counts = [len(p.index) for p in per_layer]
        layer = np.repeat(np.arange(len(counts)), counts)
        within = np.concatenate([np.arange(n) for n in counts])
        # each row's picks best first, the earliest of equal scores first
        order = np.lexsort((within, layer, -scores, rows))
        first = np.ones(len(order), bool)
        first[1:] = rows[order][1:] != rows[order][:-1]
        best = order[first]  # each row's best pick, rows ascending
        taken = np.diff([*np.flatnonzero(first), len(order)])  # how many layers took each
        placed = context_order(blocks, rows[best], [labels[i] for i in best])
        times = blocks.times()
        explain = []
        for at in placed.tolist():
            pick, row = int(best[at]), int(rows[best[at]])
            time = times[row].tolist()
            entry = {
                "block": blocks.name(row),
                "granularity": labels[pick],
                "time": None if math.isnan(time[0]) else time,
                "score": round(float(scores[pick]), 4),
                "reranked": round(float(reranked[pick]), 4),
            }
            if o.layers == "each":
                entry["layers"] = int(taken[at])
            explain.append(entry)
        names = [e["block"] for e in explain]
        layered = None
        if o.layers == "each":  # each layer's blocks in context order: by their place in it
            place = np.empty(len(placed), np.int64)
            place[placed] = np.arange(len(placed))
            unique = rows[best]
            layered = [
                [names[i] for i in np.sort(place[np.searchsorted(unique, p.index)]).tolist()]
                for p in per_layer
            ]
        return Selection(names, explain, ends_at, layered)

    def _pick(self, blocks, eligible, codes, reps: torch.Tensor, query: torch.Tensor):
        """Each layer's picks (table rows) for reps [blocks, layers, dim] and its question
        vectors query [layers, dim]."""
        o = self.options
        scores = SIMILARITY[o.similarity](query, reps.transpose(0, 1))
        picks = retrieve(
            scores, reps, (codes, blocks.kinds), o.k, o.rerank, o.top_segments, o.chunk
        )
        return [replace(p, index=eligible[p.index]) for p in picks]


class LayerByLayer:
    """Retrieval inside the answering forward (ReKV's code): layer l picks its blocks with the
    question's query at layer l, which already saw what layers below l retrieved."""

    def __init__(self, context: RetrievalContext, blocks, eligible, stored, ends_at: str | None):
        self.context, self.blocks, self.eligible, self.stored = context, blocks, eligible, stored
        self.query = context.options.query  # query_mean | last_key
        self.codes = torch.as_tensor(blocks.codes()[eligible])
        self.ends_at = ends_at
        self.picked: dict[int, Picks] = {}  # by layer

    def check_layers(self, layers: int) -> None:
        """Refuse a pack without a retrieval key for each of the model's `layers`."""
        check_stored_layers(self.stored, layers)

    def pick(self, layer: int, vector: torch.Tensor) -> list[str]:
        """Layer `layer`'s blocks, in context order, for its question vector [dim] (before
        RoPE)."""
        stored, vector = self.stored[:, layer : layer + 1], vector[None]
        picks = self.context._pick(self.blocks, self.eligible, self.codes, stored, vector)[0]
        self.picked[layer] = picks
        in_order = context_order(self.blocks, picks.index, picks.granularity)
        return [self.blocks.name(r) for r in picks.index[in_order].tolist()]

    def selection(self) -> Selection:
        """What every layer picked, once the forward has run."""
        per_layer = [self.picked.get(layer, Picks.none()) for layer in range(self.stored.shape[1])]
        return self.context.selection(self.blocks, per_layer, self.ends_at)


def check_stored_layers(stored: torch.Tensor, layers: int) -> None:
    """Refuse representatives [blocks, stored layers, dim] without a key for each of `layers`."""
    if stored.shape[1] != layers:
        raise PackError(
            f"this pack stores a retrieval key for {stored.shape[1]} of {layers} layers: "
            "per-layer retrieval needs a pack encoded with layers: each"
        )


def context_order(blocks: BlockTable, rows: np.ndarray, granularity: list[str]) -> np.ndarray:
    """Where each of the blocks at table `rows` (of `granularity`) goes in the context, as an
    argsort: time, then segment before frame before patch (a coarser block first), then row."""
    rank = {g: r for r, g in enumerate(("segment", "frame", "patch"))}
    ranks = np.fromiter((rank.get(g, 3) for g in granularity), np.int64, len(granularity))
    return np.lexsort((rows, ranks, blocks.start_steps()[rows]))
