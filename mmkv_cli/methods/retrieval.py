"""Block retrieval at ask (MuKV, ReKV): cosine scores of the question vector against block representatives,
per granularity over-retrieve 2k, rerank patch/frame candidates against the top segments, keep k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mmkv_cli.methods.base import ContextPolicy, Selection


@dataclass
class Retrieved:
    index: int  # into the candidate list
    granularity: str
    score: float
    reranked: float


def cosine_scores(query: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """query [dim], reps [blocks, dim] -> [blocks] cosine similarity."""
    return F.cosine_similarity(reps.float(), query.float().unsqueeze(0), dim=1)


def retrieve(scores: torch.Tensor, reps: torch.Tensor, granularity: list[str], k: dict[str, int],
             rerank: dict[str, float], top_segments: int) -> list[Retrieved]:
    """Pick blocks per granularity: top 2k by score, rerank by agreement with the top segments, keep k.

    rerank[g] = lambda_g: s' = (1 - lambda) s + lambda cos(rep, c), c = mean of the top segments' reps.
    Granularities missing from k are never retrieved. Returns the picks, best first within each granularity.
    """
    labels = list(granularity)
    value = scores.tolist()  # plain floats: thousands of blocks sort in microseconds
    agreement = [0.0] * len(labels)
    seg = [i for i, g in enumerate(labels) if g == "segment"]
    if seg and top_segments > 0:
        best = sorted(seg, key=lambda i: -value[i])[:top_segments]
        agreement = cosine_scores(reps[best].float().mean(dim=0), reps).tolist()
    picks = []
    for g, keep in k.items():
        members = [i for i, label in enumerate(labels) if label == g]
        candidates = sorted(members, key=lambda i: -value[i])[:2 * keep]
        lam = float(rerank.get(g, 0.0))
        rescored = []
        for i in candidates:
            rescored.append(Retrieved(i, g, value[i], (1 - lam) * value[i] + lam * agreement[i]))
        picks += sorted(rescored, key=lambda r: -r.reranked)[:keep]
    return picks


QuestionVector = Callable[[str], torch.Tensor]  # mode ("query_mean" | "last_key") -> [dim]


class RetrievalContext(ContextPolicy):
    """Top-k blocks per granularity by the question, in time order; positions kept or compacted."""

    name = "retrieval"

    def select(self, blocks: list[dict], reps: Callable[[], torch.Tensor], question_vector: QuestionVector,
               before: float | None = None) -> Selection:
        p = self.params
        eligible = [i for i, b in enumerate(blocks) if before is None or (b["time"] or [0.0])[0] <= before]
        if not eligible:
            return Selection([], [])
        table = reps()[eligible]
        scores = cosine_scores(question_vector(p.get("query", "query_mean")), table)
        picks = retrieve(scores, table, [blocks[i]["granularity"] for i in eligible], dict(p["k"]),
                         dict(p.get("rerank", {})), int(p.get("top_segments", 0)))
        rank = {g: r for r, g in enumerate(("segment", "frame", "patch"))}
        chosen = sorted(picks, key=lambda r: ((blocks[eligible[r.index]]["steps"] or [0])[0],
                                              rank.get(r.granularity, 3), r.index))
        names = [blocks[eligible[r.index]]["name"] for r in chosen]
        explain = [{"block": blocks[eligible[r.index]]["name"], "granularity": r.granularity,
                    "time": blocks[eligible[r.index]]["time"], "score": round(r.score, 4),
                    "reranked": round(r.reranked, 4)} for r in chosen]
        return Selection(names, explain)
