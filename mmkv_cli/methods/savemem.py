"""SAVEMem (arXiv 2605.07897): FluxMem's three tiers with a semantic prior and a recency gate.
Following the authors' code (wuhang03/savemem, `SaveMem` in
models/qwen2-5-vl/src/qwen2_5_vl_savemem/savemem.py) at their StreamingBench script's settings:

- a fixed bank of pseudo-questions scores each visual token's importance: its best cosine with any
  of their tokens' input embeddings;
- mid term as FluxMem's, except that a frame that cuts the scene (its mean distance to the frame
  before above 1.5 x the running mean) drops nothing directly, and elsewhere the direct drop's
  similarity threshold rises with a token's importance (0.8 + 0.15 x importance);
- long term: a frame still holding 20 tokens or more keeps its most important ones, a share that
  grows with the frame's mean importance (15-40%), spread over its four quadrants; a smaller one
  merges as FluxMem's; past `max_memory_tokens` in the mid and long terms, the long term's least
  important go;
- the recency gate: at a ratio of 1 or less a question reads the short term alone;
- above it, the question's late interaction keeps the mid- and long-term frames it matches best
  (savemem_retrieval.py), on the tokens as taken in, which the pack keeps for it (format v13)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.savemem_retrieval import LateInteractionContext
from mmkv_cli.methods.scoring import ranks
from mmkv_cli.methods.tiers import (
    Frame,
    TieredMemory,
    best_neighbour_similarity,
    differs,
    long_term_merge,
)

PSEUDO_QUESTIONS = (
    "What objects are visible in the scene?",
    "How many items or people can be seen?",
    "What actions or events are happening?",
    "What has changed in the scene?",
    "Describe the spatial arrangement of objects.",
)


@dataclass(frozen=True)
class SaveMemParams(StreamParams):
    short_term_frames: int = knob(
        8, "the newest frames, kept whole (short_frames: 8 StreamingBench, 4 OVO-Bench)", low=1
    )  # fmt: skip
    mid_term_frames: int = knob(
        16, "frames after those that keep what differs from their neighbours (medium_frames)",
        low=0,
    )  # fmt: skip
    direct_drop_similarity: float = knob(
        0.8, "a mid-term token more similar than this (plus its protection) to the next frame "
        "goes whatever the thresholds say", low=-1.0, high=1.0,
    )  # fmt: skip
    pair_similarity: float | None = knob(
        None, "one similarity threshold for the mid term instead of Otsu's per frame", low=-1.0,
        high=1.0,
    )  # fmt: skip
    scene_change: float = knob(
        1.5, "a frame whose mean distance to the one before is above this times the running mean "
        "cuts the scene: it drops nothing directly (scene_change_multiplier)", above=0.0,
    )  # fmt: skip
    protection: float = knob(
        0.15, "the direct drop's threshold rises by this times a token's importance "
        "(semantic_protect_weight)", low=0.0,
    )  # fmt: skip
    pseudo_questions: tuple[str, ...] = knob(
        PSEUDO_QUESTIONS, "questions whose tokens score each visual token's importance; empty: "
        "none, as the OVO-Bench script runs it (the long term then merges, the cap drops by "
        "embedding norm)",
    )  # fmt: skip
    semantic_long_term: int = knob(
        20, "a frame leaving the mid term with at least this many tokens keeps its most "
        "important; fewer merge as FluxMem's", low=1,
    )  # fmt: skip
    max_memory_tokens: int = knob(
        8192, "the mid and long terms hold at most this many tokens; past it the long term's "
        "least important go (8192 StreamingBench, 2048 OVO-Bench and ODV-Bench)", low=1,
    )  # fmt: skip
    gate_drop_ratio: float | None = knob(
        3.0, "the recency gate (recency_gate_drop_ratio): at 1 or less a question reads the short "
        "term alone; above 1, or null, the whole memory (3.0 StreamingBench, 0.1 OVO-Bench "
        "real-time, 2.0 backward)", above=0.0,
    )  # fmt: skip
    retrieval_top_k: int = knob(
        10, "with the gate open, the question's late interaction keeps at least this many mid- "
        "and long-term frames (at least 90% of them; all where its scores are alike); 0: every "
        "frame, no embeddings kept in the pack", low=0,
    )  # fmt: skip

    @property
    def retrieves(self) -> bool:
        """Whether a question chooses among the mid- and long-term frames."""
        gate = self.gate_drop_ratio
        return self.retrieval_top_k > 0 and (gate is None or gate > 1.0)


def importance(unit_x: torch.Tensor, questions: torch.Tensor) -> torch.Tensor:
    """[T]: each token's (unit [T, H]) best cosine with any pseudo-question token (unit [Q, H])."""
    return (unit_x @ questions.T).amax(dim=1)


def most_important(kept: torch.Tensor, scores: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[T] bool: what a long-term frame keeps of `kept` by importance: max(4, int(n x r)) tokens,
    r = 0.15 + 0.25 x its mean importance clamped to [0, 1], a quarter of them (at least one) the
    best of each quadrant around the kept tokens' centre, the rest the best left; all of them
    where that is no fewer than it holds. Fixed shapes: nothing is read by the host."""
    rows = torch.arange(len(kept), device=kept.device) // grid[1]
    cols = torch.arange(len(kept), device=kept.device) % grid[1]
    count = kept.sum()
    mean = (scores * kept).sum() / count.clamp_min(1)
    ratio = 0.15 + 0.25 * mean.clamp(0.0, 1.0)
    total = torch.clamp(torch.floor(count * ratio), min=4).long()
    quarter = torch.clamp(total // 4, min=1)

    def middle(axis: torch.Tensor) -> torch.Tensor:
        high = axis.masked_fill(~kept, -1).amax()
        low = axis.masked_fill(~kept, 1 << 30).amin()
        return (low + high).float() / 2.0

    quadrant = (rows.float() > middle(rows)).long() * 2 + (cols.float() > middle(cols)).long()
    chosen = torch.zeros_like(kept)
    for q in range(4):
        among = kept & (quadrant == q)
        chosen = chosen | (among & (ranks(scores, among) < quarter))
    rest = kept & ~chosen
    chosen = chosen | (rest & (ranks(scores, rest) < total - chosen.sum()))
    return torch.where((count <= 4) | (total >= count), kept, chosen)


def over_the_cap(alive: torch.Tensor, scores: torch.Tensor, overflow: torch.Tensor) -> torch.Tensor:
    """[L, T] bool: the `overflow` least important of the long term's alive tokens."""
    place = ranks(-scores.flatten(), alive.flatten())  # the least important first
    return (alive.flatten() & (place < overflow)).view_as(alive)


class SaveMemMemory(TieredMemory):
    def __init__(self, params: SaveMemParams, budget: Budget, context):
        super().__init__(params, budget, context)
        self.keeps_embeddings = params.retrieves  # the question's late interaction reads them
        self.questions: torch.Tensor | None = None  # [Q, H] unit pseudo-question tokens
        self.cuts_sum: torch.Tensor | None = None  # the running sum of frames' mean distances
        self.cuts = 0  # how many frames it sums
        # the long term: alive [L, T], importance [L, T] where the model is; stream indices [L, T]
        self.alive: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.long_index = torch.empty(0, dtype=torch.long)

    def own_saved(self) -> dict[str, torch.Tensor]:
        out = {"cuts": torch.tensor(self.cuts), "long_index": self.long_index}
        if self.cuts_sum is not None:
            out["cuts_sum"] = self.cuts_sum
        if self.alive is not None:
            out |= {"alive": self.alive, "scores": self.scores}
        return out

    def own_restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.cuts, self.long_index = int(saved["cuts"]), saved["long_index"]
        self.cuts_sum = saved.get("cuts_sum")
        self.alive, self.scores = saved.get("alive"), saved.get("scores")

    def after_chunk(self, state: StreamState) -> None:
        if self.questions is None and self.params.pseudo_questions and state.embed_text:
            tokens = torch.cat([state.embed_text(q) for q in self.params.pseudo_questions])
            self.questions = torch.nn.functional.normalize(tokens.float(), p=2, dim=-1)
        super().after_chunk(state)

    def arrived(self, frame: Frame, before: Frame | None, near: torch.Tensor) -> None:
        super().arrived(frame, before, near)
        if self.questions is not None:
            frame.semantic = importance(frame.unit(), self.questions.to(frame.x.device))
        if frame.previous is None:
            return
        mean = frame.previous.float().mean()
        if self.cuts_sum is None:
            frame.scene_change = torch.zeros((), dtype=torch.bool, device=mean.device)
            self.cuts_sum = mean
        else:
            running = self.cuts_sum / self.cuts
            frame.scene_change = (running > 1e-6) & (mean > self.params.scene_change * running)
            self.cuts_sum = self.cuts_sum + mean
        self.cuts += 1

    def mid_term(self, leaving: Frame, following: Frame, near: torch.Tensor) -> torch.Tensor:
        similar = best_neighbour_similarity(leaving.unit(), following.unit(), near)
        keep = differs(similar, leaving.previous, self.params.pair_similarity)
        threshold = self.params.direct_drop_similarity
        if leaving.semantic is not None:
            threshold = threshold + leaving.semantic * self.params.protection
        drop = similar > threshold
        if leaving.scene_change is not None:
            drop = drop & ~leaving.scene_change
        return keep & ~drop

    def long_term(self, old: Frame, grid: tuple[int, int]) -> None:
        part, anchor, dropped = long_term_merge(old.x, old.keep, grid)
        merged = old.keep & ~dropped
        scores = old.semantic
        if scores is not None:
            by_importance = old.keep.sum() >= self.params.semantic_long_term
            kept = torch.where(by_importance, most_important(old.keep, scores, grid), merged)
            anchor = anchor & ~by_importance
        else:
            kept, scores = merged, old.x.float().norm(dim=-1)
        old.merge, old.keep = (part, anchor, old.keep), kept
        self._join_long_term(old, kept, scores)

    def _join_long_term(self, old: Frame, kept: torch.Tensor, scores: torch.Tensor) -> None:
        """The frame joins the long term; past the cap, its least important tokens go."""
        first = self.alive is None
        self.alive = kept[None] if first else torch.cat([self.alive, kept[None]])
        row = scores[None].float()
        self.scores = row if first else torch.cat([self.scores, row])
        self.long_index = torch.cat([self.long_index, old.index[None]])
        held = self.alive.sum()
        for frame in self.mid:
            held = held + frame.keep.sum()
        overflow = (held - self.params.max_memory_tokens).clamp_min(0)
        self.alive = self.alive & ~over_the_cap(self.alive, self.scores, overflow)

    def gone_elsewhere(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.alive is None else (self.alive, self.long_index)

    def settled_elsewhere(self, dead: torch.Tensor) -> None:
        """A long-term frame with nothing alive leaves its rows: the long term stays as large as
        what it holds (an hour at two frames a step would add 1,800 rows, re-ranked at each cap
        check and read back each chunk). The cap's ranking is over alive tokens alone: the same."""
        rows = (~dead).any(dim=1)
        if bool(rows.all()):
            return
        self.long_index = self.long_index[rows]
        at = rows.nonzero()[:, 0].to(self.alive.device, non_blocking=True)
        self.alive, self.scores = self.alive[at], self.scores[at]

    def finish(self, state: StreamState) -> None:
        gate = self.params.gate_drop_ratio
        if gate is None or gate > 1.0:
            return
        newest = torch.cat([frame.index for frame in self.short]) if self.short else None
        if newest is None:
            return
        local = torch.isin(state.cache.index[0], newest).nonzero()[:, 0]
        for layer in range(state.layers):
            state.cache.retain(layer, local)


METHOD = Method(
    name="savemem",
    label="SAVEMem",
    description="FluxMem's tiers kept by pseudo-questions' importance; a recency gate and the "
    "question's late interaction choose at ask",
    paper=Paper(
        "SAVEMem: Semantic-Aware Memory for Streaming Video Understanding",
        2026,
        "https://arxiv.org/abs/2605.07897",
    ),
    params=SaveMemParams,
    budget=None,  # its thresholds and cap size it: --budget does not apply
    streaming=SaveMemMemory,
    context=lambda params: LateInteractionContext(
        params.short_term_frames, params.retrieval_top_k if params.retrieves else 0
    ),
    adaptive=True,
)
