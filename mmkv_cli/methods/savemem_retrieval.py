"""SAVEMem's retrieval at the question, following the authors' code (wuhang03/savemem 3b6beed,
`SaveMem._query_guided_memory_selection`): every mid- and long-term frame is scored by late
interaction with the prompt's text tokens (each of its kept tokens' best cosine with any of them,
averaged over the frame, on the tokens as the language model took them in), and the best frames
stay; how many depends on how far apart the scores are (their coefficient of variation), never
fewer than 90% of them nor `retrieval_top_k`. The short term always stays whole. The pure
functions are tested on tensors (tests/test_savemem_retrieval.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from mmkv_cli.core.lazy import torch
from mmkv_cli.methods.base import QuestionVector, Selection, TakenIn
from mmkv_cli.methods.context import WholeContext
from mmkv_cli.pack import eligible_at, run_rows

if TYPE_CHECKING:
    from mmkv_cli.pack import BlockTable

UNIFORM, APART = 0.05, 0.3  # coefficients of variation: keep every frame / keep only the top k
FLOOR = 0.9  # the share of the frames that always stays


def late_interaction(
    tokens: torch.Tensor, question: torch.Tensor, frame_of: torch.Tensor, frames: int
) -> torch.Tensor:
    """[2, frames]: each frame's mean over its visual tokens of the best cosine with any question
    token, and how many visual tokens it has. tokens [N, H] unit rows, a zero row where a token is
    not visual (a marker); question [Q, H] unit rows; frame_of [N]: the frame each token is in."""
    tokens = tokens.float()
    visual = (tokens != 0).any(dim=1).float()
    best = (tokens @ question.float().T).amax(dim=1) * visual
    sums = torch.zeros(frames, device=best.device).index_add_(0, frame_of, best)
    counts = torch.zeros(frames, device=best.device).index_add_(0, frame_of, visual)
    return torch.stack([sums / counts.clamp_min(1), counts])


def frames_kept(scores: torch.Tensor, top_k: int) -> int:
    """How many of the candidate frames (scores [C], float32 on the host) stay: all where the
    scores are alike (a coefficient of variation at most 0.05), `top_k` where they are far apart
    (0.3 or more), linearly between; never fewer than max(top_k, int(0.9 C))."""
    count = len(scores)
    if count <= top_k:
        return count
    spread = float(scores.std()) / max(abs(float(scores.mean())), 1e-8)
    if spread <= UNIFORM:
        kept = count
    elif spread >= APART:
        kept = top_k
    else:
        kept = int(count - (spread - UNIFORM) / (APART - UNIFORM) * (count - top_k))
    return max(kept, min(max(top_k, int(count * FLOOR)), count))


class LateInteractionContext:
    """The stored blocks shown by the question's moment, less the mid- and long-term frames the
    question's late interaction ranks lowest; the whole memory where the pack keeps no
    embeddings (a pack made before format v13, or with retrieval off)."""

    position_mode = "keep"

    def __init__(self, short_term_frames: int, top_k: int):
        self.short_term_frames, self.top_k = short_term_frames, top_k

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: QuestionVector,
        at: float | None = None,
        taken_in: TakenIn | None = None,
    ) -> Selection:
        whole = WholeContext().select(blocks, reps, question_vector, at)
        eligible = eligible_at(blocks, at)
        if taken_in is None or self.top_k <= 0 or not len(eligible):
            return whole
        steps = blocks.start_steps()[eligible]
        short = max(1, self.short_term_frames // taken_in.frames_per_step)  # steps, as the memory
        candidates = eligible[steps <= (steps.max() - short)]
        stored = taken_in.blocks() if len(candidates) > self.top_k else None
        if stored is None:
            return whole
        starts = blocks.first_layer_starts()
        counts = np.diff(starts)
        rows = torch.as_tensor(run_rows(starts[candidates], counts[candidates]))
        frame_of = torch.repeat_interleave(torch.arange(len(candidates)),
                                           torch.as_tensor(counts[candidates]))  # fmt: skip
        question = taken_in.question()
        on = question.device  # only the candidates' rows go there
        scores, visual = late_interaction(
            stored[rows].to(on, non_blocking=True), question, frame_of.to(on), len(candidates)
        ).cpu()  # the one wait: which frames stay is the host's to say
        candidates, scores = candidates[visual.numpy() > 0], scores[visual > 0]  # as the code
        if len(candidates) <= self.top_k:
            return whole
        order = torch.argsort(-scores, stable=True)  # best first, the earlier of equals first
        keep = frames_kept(scores, self.top_k)
        dropped = set(candidates[order[keep:].numpy()].tolist())
        kept = [i for i in eligible.tolist() if i not in dropped]
        scored = dict(zip(candidates.tolist(), scores.tolist()))
        explain = _explain(blocks, kept, scored)
        return Selection([blocks.name(i) for i in kept], explain, whole.ends_at)


def _explain(blocks: BlockTable, kept: list[int], scored: dict[int, float]) -> list[dict]:
    """Every block of the context in time order, a scored frame with its late-interaction score
    (the short term's: None, kept whole unscored)."""
    out = []
    for row in kept:
        entry, score = blocks[row], scored.get(row)
        out.append(
            {"block": entry["name"], "granularity": entry["granularity"], "time": entry["time"],
             "score": None if score is None else round(score, 4), "reranked": None}
        )  # fmt: skip
    return out
