"""Block retrieval at ask (MuKV, ReKV): cosine scores of the question vector against block representatives,
per granularity over-retrieve 2k, rerank patch/frame candidates against the top segments, keep k."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmkv_cli.methods.base import ContextPolicy, Selection, last_shown
from mmkv_cli.pack.table import BlockTable, eligible_before


@dataclass
class Retrieved:
    index: int  # into the candidate list
    granularity: str
    score: float
    reranked: float


def cosine_scores(query: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """query [dim], reps [blocks, dim] -> [blocks] cosine similarity."""
    return F.cosine_similarity(reps.float(), query.float().unsqueeze(0), dim=1)


def retrieve(
    scores: torch.Tensor,
    reps: torch.Tensor,
    granularity: list[str] | tuple[torch.Tensor, list[str]],
    k: dict[str, int],
    rerank: dict[str, float],
    top_segments: int,
) -> list[Retrieved]:
    """Pick blocks per granularity: top 2k by score, rerank by agreement with the top segments, keep k.

    rerank[g] = lambda_g: s' = (1 - lambda) s + lambda cos(rep, c), c = mean of the top segments' reps.
    Granularities missing from k are never retrieved. Returns the picks, best first within each granularity.
    granularity: one label per block, or (codes [blocks], kinds) with kinds[code] the label.
    Whole-table work is vectorised: thousands of blocks cost a few tensor ops, not Python loops.
    """
    if isinstance(granularity, tuple):
        codes, kinds = granularity
    else:
        kinds = list(dict.fromkeys(granularity))
        codes = torch.tensor([kinds.index(g) for g in granularity], dtype=torch.int64)
    scores = scores.float()
    centre = None  # mean representative of the best segments
    segments = (
        torch.nonzero(codes == kinds.index("segment")).flatten() if "segment" in kinds else None
    )
    if segments is not None and len(segments) and top_segments > 0:
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


QuestionVector = Callable[[str], torch.Tensor]  # mode ("query_mean" | "last_key") -> [dim]


class RetrievalContext(ContextPolicy):
    """Top-k blocks per granularity by the question, in time order; positions kept or compacted."""

    name = "retrieval"

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: QuestionVector,
        before: float | None = None,
    ) -> Selection:
        p = self.params
        eligible = eligible_before(blocks, before)
        if not len(eligible):
            return Selection([], [])
        table = reps()[eligible]
        scores = cosine_scores(question_vector(p.get("query", "query_mean")), table)
        picks = retrieve(
            scores,
            table,
            (blocks.codes()[eligible], blocks.kinds),
            dict(p["k"]),
            dict(p.get("rerank", {})),
            int(p.get("top_segments", 0)),
        )
        rank = {g: r for r, g in enumerate(("segment", "frame", "patch"))}
        index = eligible[[r.index for r in picks]] if picks else eligible[:0]
        rows, steps, times = (
            index.tolist(),
            blocks.start_steps()[index].tolist(),
            blocks.times()[index].tolist(),
        )
        order = sorted(
            range(len(picks)), key=lambda j: (steps[j], rank.get(picks[j].granularity, 3), rows[j])
        )
        explain = [
            {
                "block": blocks.name(rows[j]),
                "granularity": picks[j].granularity,
                "time": None if math.isnan(times[j][0]) else times[j],
                "score": round(picks[j].score, 4),
                "reranked": round(picks[j].reranked, 4),
            }
            for j in order
        ]
        return Selection(
            [e["block"] for e in explain], explain, last_shown(blocks, eligible, before)
        )
