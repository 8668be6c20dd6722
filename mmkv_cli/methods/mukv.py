"""MuKV (seed 000): multi-grained blocks, each prefilled on its own and compressed by a dual signal.

Three granularities cut the same visual stream: patch (a quarter of a step's token grid: a
contiguous run as in the authors' code, or a spatial quarter), frame (one temporal step) and
segment (F frames); or, with views: middle_frame, patch and frame blocks come from each segment's
middle step only. Every block is prefilled after the init prompt only, scored by last-layer
attention column sums fused with a key-frequency signal, and keeps floor(rho_g * |block|) tokens in
temporal order. At ask, blocks are retrieved per granularity and reranked (retrieval.py): as the
authors' code does, the question's last-layer key of its last token (prefilled after the init
prompt) against each block's mean kept key as the block was prefilled, both after RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import BlockPlan, Budget, Method, Paper
from mmkv_cli.methods.retrieval import RetrievalContext, RetrievalOptions
from mmkv_cli.methods.scoring import minmax, top_in_order


@dataclass(frozen=True)
class Shares:
    """One number per granularity."""

    patch: float = knob(0.1, "patch blocks", low=0, high=1)
    frame: float = knob(0.1, "frame blocks", low=0, high=1)
    segment: float = knob(0.8, "segment blocks", low=0, high=1)

    def as_dict(self) -> dict[str, float]:
        return {"patch": self.patch, "frame": self.frame, "segment": self.segment}


@dataclass(frozen=True)
class Counts:
    """Blocks retrieved per granularity."""

    patch: int = knob(20, "patch blocks", low=0)
    frame: int = knob(32, "frame blocks", low=0)
    segment: int = knob(12, "segment blocks", low=0)

    def as_dict(self) -> dict[str, int]:
        return {"patch": self.patch, "frame": self.frame, "segment": self.segment}


@dataclass(frozen=True)
class MuKVParams:
    chunk_frames: int = knob(
        16, "frames turned into tokens at once (a multiple of the segment)", low=1
    )
    segment_frames: int = knob(4, "F: frames in a segment block", low=1)
    views: Literal["stream", "middle_frame"] = knob(
        "stream",
        "stream: every view cuts the whole stream (the paper's figures, the authors' code); "
        "middle_frame: patch and frame blocks of each segment's middle frame (the paper's prose)",
    )
    patch_blocks: Literal["raster", "spatial"] = knob(
        "raster",
        "patch blocks: contiguous runs of a quarter of the grid (the authors' code) or its spatial "
        "quarters (the paper's prose)",
    )
    rho: Shares = knob(
        Shares(), "share of a block's tokens kept, per granularity (sum: the budget)"
    )
    alpha: Shares = knob(
        Shares(patch=0.5, frame=0.7, segment=0.8),
        "attention weight in the fused score, per granularity",
    )
    frequency: Literal["fft", "diff"] = knob(
        "fft", "key-frequency signal: fft (the paper) or diff (the reference loader's default)"
    )
    batch_tokens: int = knob(
        4096, "tokens in one prefill batch's cache: rows x (init + block)", low=1
    )
    query: Literal["last_key", "query_mean"] = knob(
        "last_key",
        "question vector: its last token's last-layer key (the authors' question_answering) or "
        "the mean of its last-layer queries (the paper's prose)",
    )
    key_space: Literal["placed", "position_free"] = knob(
        "placed",
        "representatives and question vector as the blocks and the question were prefilled after "
        "the init prompt, keys after RoPE (the authors' code), or rotated back to before RoPE",
    )
    k: Counts = knob(Counts(), "blocks retrieved per granularity")
    rerank: Shares = knob(
        Shares(patch=0.3, frame=0.3, segment=0.0),
        "lambda: weight of agreement with the top segments",
    )
    top_segments: int = knob(5, "segments whose mean representative reranks the others", low=0)
    positions: Literal["keep", "reindex"] = knob(
        "keep", "keep the stored positions at ask, or compact them (keys re-rotated)"
    )
    similarity: Literal["cosine", "dot"] = knob(
        "cosine", "question against representative: cosine (the paper) or dot product"
    )
    layers: Literal["last", "each"] = knob(
        "last",
        "last: the last layer's vectors choose the blocks of every layer (the paper); each: every "
        "layer picks its own, as ReKV's code does (stores a key per layer)",
    )
    dedup: bool = knob(
        False,
        "drop a candidate whose last-layer key is too like a better one's (the code's "
        "_select_tokens_with_dedup; off in the authors' run scripts)",
    )
    dedup_similarity: float = knob(
        0.9, "dedup: cosine above which a candidate is a duplicate", low=-1, high=1
    )
    dedup_candidates: float = knob(1.2, "dedup: candidates, as a multiple of a block's keep", low=1)


# --- scoring: pure functions over tensors ---


def frequency_signal(keys: torch.Tensor, mode: str = "fft") -> torch.Tensor:
    """keys [N, D] (last layer, head-averaged) -> [N] how much each token departs from its
    neighbours.

    fft: keep the upper half of the frequency bins along the tokens, back to tokens, |.| averaged
    over D. diff: ||k_t - k_{t-1}||, the first token 0 (the authors' diff with k_0 prepended).
    """
    keys = keys.float()
    n = keys.shape[0]
    if n < 2:
        return torch.zeros(n, device=keys.device)
    if mode == "fft":
        spectrum = torch.fft.rfft(keys, dim=0)
        spectrum[: spectrum.shape[0] // 2] = 0
        return torch.fft.irfft(spectrum, n=n, dim=0).abs().mean(dim=1)
    if mode == "diff":
        change = (keys[1:] - keys[:-1]).norm(dim=1)
        return torch.cat([change.new_zeros(1), change])
    raise ValueError(f"unknown frequency signal '{mode}' (fft, diff)")


def fused_score(attention: torch.Tensor, frequency: torch.Tensor, alpha: float) -> torch.Tensor:
    return alpha * minmax(attention) + (1 - alpha) * minmax(frequency)


def dedup_top(
    score: torch.Tensor, keys: torch.Tensor, keep: int, similarity: float, widen: float
) -> torch.Tensor:
    """The `keep` best of score [N] with near-duplicates dropped, in temporal order. keys [N, D].

    The int(widen * keep) best are candidates; best first, each one still standing drops every
    later candidate whose key's cosine with its own is above `similarity` (greedy, as the authors'
    code). The best `keep` left stand; when fewer than `keep` are left, the best dropped ones fill
    the block (the code keeps fewer), so its size stays as planned and the device never has to tell
    the host how many survived.
    """
    wide = min(int(keep * widen), score.numel())
    if wide <= keep:
        return top_in_order(score, keep)
    order = score.topk(wide).indices  # best first
    unit = torch.nn.functional.normalize(keys[order].float(), dim=-1)
    later = torch.ones(wide, wide, dtype=torch.bool, device=score.device).triu(1)
    alike = (unit @ unit.T > similarity) & later
    standing = torch.ones(wide, dtype=torch.bool, device=score.device)
    for i in range(wide):  # tensor ops only: no host sync in the block loop
        standing = standing & ~(alike[i] & standing[i])
    rank = (~standing).float() * wide + torch.arange(wide, device=score.device)
    return order[rank.topk(keep, largest=False).indices].sort().values


def keep_count(block_tokens: int, rho: float) -> int:
    """floor(rho x |block|), as the paper and the authors' code keep: a function of the block
    alone, so its kept tokens and its key do not depend on where it sits, and no block rounds the
    budget up. A block of a tiny grid may keep none: it is then neither prefilled nor stored (a
    floor of one token a block kept 1.6x the budget on the demo's 4-token frames)."""
    return min(block_tokens, math.floor(rho * block_tokens + 1e-9))


# --- the block plan: which stream tokens form each block ---


def quarter_grid(rows: int, cols: int, mode: str = "spatial") -> list[torch.Tensor]:
    """Indices into a rows x cols token grid (raster order) of its four patch blocks.

    spatial: the four quadrants (7x7 of 14x14 on LLaVA-OV); raster: four contiguous runs, as the
    authors' code cuts them.
    """
    grid = torch.arange(rows * cols).reshape(rows, cols)
    if mode == "raster":
        return [part for part in torch.tensor_split(grid.reshape(-1), 4) if part.numel()]
    r, c = math.ceil(rows / 2), math.ceil(cols / 2)
    parts = [grid[:r, :c], grid[:r, c:], grid[r:, :c], grid[r:, c:]]
    return [p.reshape(-1) for p in parts if p.numel()]


def detailed_steps(steps: int, segment_steps: int, views: str = "stream") -> list[int]:
    """The steps that get patch and frame blocks. stream: every step, so every token sits in one
    block of each granularity (the paper's figures and the authors' code); middle_frame: only each
    segment's middle step (the paper's prose)."""
    if views == "stream":
        return list(range(steps))
    if views == "middle_frame":
        return [
            first + (min(first + segment_steps, steps) - first) // 2
            for first in range(0, steps, segment_steps)
        ]
    raise ValueError(f"unknown MuKV views '{views}' (stream, middle_frame)")


def plan_blocks(
    step_starts: list[int],
    step_lengths: list[int],
    grid_offsets: list[int],
    grid: tuple[int, int],
    segment_steps: int,
    patch_mode: str = "spatial",
    views: str = "stream",
) -> list[BlockPlan]:
    """Patch, frame and segment blocks over a stream of steps (patch and frame ones on the detailed
    steps).

    A step's marker tokens (Qwen3 timestamps, vision start/end) join its first and last patch block.
    """
    plans = []
    rows, cols = grid
    for step in detailed_steps(len(step_starts), segment_steps, views):
        start, length, offset = step_starts[step], step_lengths[step], grid_offsets[step]
        quarters = quarter_grid(rows, cols, patch_mode)
        for q, part in enumerate(quarters):
            tokens = part + start + offset
            if q == 0:
                tokens = torch.cat([torch.arange(start, start + offset), tokens])
            if q == len(quarters) - 1:
                tokens = torch.cat(
                    [tokens, torch.arange(start + offset + rows * cols, start + length)]
                )
            plans.append(BlockPlan("patch", tokens.sort().values, (step, step + 1)))
        plans.append(BlockPlan("frame", torch.arange(start, start + length), (step, step + 1)))
    for first in range(0, len(step_starts), segment_steps):
        last = min(first + segment_steps, len(step_starts)) - 1
        end = step_starts[last] + step_lengths[last]
        plans.append(BlockPlan("segment", torch.arange(step_starts[first], end), (first, last + 1)))
    return plans


class MuKVMemory:
    """Independent multi-grained blocks (the encoder prefills them in batches: see blockwise.py)."""

    def __init__(self, params: MuKVParams, budget: Budget):
        self.params = params
        self.chunk_frames = params.chunk_frames
        self.batch_tokens = params.batch_tokens
        self.retrieval_layers = params.layers
        self.retrieval_space = "post_rope" if params.key_space == "placed" else "pre_rope"
        # The budget is the pack's share of one stream: the three views' rho are scaled to sum to
        # it.
        self._budget = budget
        self.rho: dict[str, float] | None = (
            None if budget.tokens is not None else self._scaled(budget.share)
        )

    def _scaled(self, share: float) -> dict[str, float]:
        rho = self.params.rho.as_dict()
        scale = share / sum(rho.values())
        return {g: min(1.0, r * scale) for g, r in rho.items()}

    def begin(self, total: int) -> None:
        """A token budget becomes a share once the stream's length is known."""
        if self.rho is None:
            self.rho = self._scaled(self._budget.share_of(total))

    def segment_steps(self, frames_per_step: int) -> int:
        return max(1, self.params.segment_frames // frames_per_step)

    def plan(
        self, step_starts, step_lengths, grid_offsets, grid, frames_per_step
    ) -> list[BlockPlan]:
        """A chunk's blocks, each with the tokens it keeps (keep_count): no view holds more than
        its share, so a pack never holds more than the budget."""
        plans = plan_blocks(
            step_starts,
            step_lengths,
            grid_offsets,
            grid,
            self.segment_steps(frames_per_step),
            self.params.patch_blocks,
            self.params.views,
        )
        for plan in plans:
            plan.keep = keep_count(plan.tokens.numel(), self.rho[plan.granularity])
        return plans

    def choose(
        self, plan: BlockPlan, attention: torch.Tensor, last_keys: torch.Tensor
    ) -> torch.Tensor:
        """Local indices block `plan` keeps. attention [N] column sums; last_keys [H_kv, N, D]."""
        n = attention.shape[0]
        if plan.keep >= n:
            return torch.arange(n, device=attention.device)
        frequency = frequency_signal(last_keys.float().mean(dim=0), self.params.frequency)
        alpha = self.params.alpha.as_dict()[plan.granularity]
        score = fused_score(attention, frequency, alpha)
        if self.params.dedup:
            p = self.params
            keys = last_keys.float().mean(dim=0)
            return dedup_top(score, keys, plan.keep, p.dedup_similarity, p.dedup_candidates)
        return top_in_order(score, plan.keep)


def context(params: MuKVParams) -> RetrievalContext:
    return RetrievalContext(
        RetrievalOptions(
            k=params.k.as_dict(),
            rerank=params.rerank.as_dict(),
            top_segments=params.top_segments,
            query=params.query,
            positions=params.positions,
            similarity=params.similarity,
            layers=params.layers,
        )
    )


METHOD = Method(
    name="mukv",
    label="MuKV",
    description="multi-grained blocks, dual-signal compression, hierarchical retrieval",
    start_here="a saved video, asked about at any grain from a moment to the whole",
    paper=Paper(
        "MuKV: Multi-Grained KV Cache Compression for Long Streaming Video Question-Answering",
        2026,
        "https://github.com/IMBALDY/MuKV",
    ),
    params=MuKVParams,
    # pack tokens / stream tokens: the views' rho sum to 1.0, so a pack holds about the stream
    budget=Budget(share=1.0),
    blockwise=MuKVMemory,
    context=context,
)
