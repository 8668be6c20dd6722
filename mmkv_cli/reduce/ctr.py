"""StreamingTOM's Causal Temporal Reduction: every step keeps a fixed number of tokens before the
language model (196 -> 50 on LLaVA-OV). Following the authors' `streamingtom/modules/ctr.py`: a
token more similar (cosine) than a threshold to its place in the step before is static, the rest
dynamic (the stream's first step is all dynamic); the step's budget is split between the two in
proportion; dynamic tokens are kept by the attention they got in the vision tower, static ones are
clustered (DPC-kNN) and each centre, at its own place, becomes beta x itself + (1 - beta) x the mean
of the static tokens nearest it."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.lazy import torch
from mmkv_cli.reduce.base import (
    Reduced,
    Reducer,
    StepTokens,
    first_where,
    similarity_to_previous,
    step_by_step,
    top_in_order,
)
from mmkv_cli.spec import Paper, knob


@dataclass(frozen=True)
class CTRParams:
    retain: float = knob(
        50 / 196,
        "share of a step's tokens it keeps (the authors' 50 of LLaVA-OV's 196; at least one)",
        above=0.0,
        high=1.0,
    )
    similarity_threshold: float = knob(
        0.9, "a token more similar than this to its place in the step before is static", low=-1.0
    )
    k: int = knob(7, "neighbours a static token's density is measured over (DPC-kNN)", low=1)
    beta: float = knob(
        0.6, "weight of a cluster's centre against its members' mean", low=0.0, high=1.0
    )


def split_budget(retain: int, static: int, total: int) -> tuple[int, int]:
    """(static, dynamic) tokens a step keeps: in proportion to its static share, neither more than
    there are (the authors' rounding: the static part rounded down)."""
    dynamic_count = total - static
    keep_static = int(retain * static / total)
    keep_dynamic = retain - keep_static
    if keep_static > static:
        keep_static, keep_dynamic = static, retain - static
    if keep_dynamic > dynamic_count:
        keep_dynamic, keep_static = dynamic_count, retain - dynamic_count
    return keep_static, keep_dynamic


def density_peaks(tokens: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """Indices (ascending) of `count` cluster centres of tokens [N, H] by DPC-kNN: density from the
    k nearest neighbours, times the distance to the nearest denser token. Ties of density go to the
    earlier token (the authors break them with noise)."""
    n, width = tokens.shape
    if n <= 1 or count >= n:
        return torch.arange(n, device=tokens.device)
    dist = torch.cdist(tokens.float(), tokens.float()) / width**0.5
    # the k smallest distances, the token's own 0 among them (as the authors count them)
    near = torch.topk(dist, min(k, n - 1), dim=-1, largest=False).values
    density = torch.exp(-(near**2).mean(dim=-1))
    index = torch.arange(n, device=tokens.device)
    denser = (density[None, :] > density[:, None]) | (
        (density[None, :] == density[:, None]) & (index[None, :] < index[:, None])
    )
    to_denser = torch.where(denser, dist, dist.max()).min(dim=-1).values
    return top_in_order(density * to_denser, count)


def merge_into_centres(tokens: torch.Tensor, centres: torch.Tensor, beta: float) -> torch.Tensor:
    """[len(centres), H]: each centre as beta x itself + (1 - beta) x the mean of the other tokens
    nearest it (a centre nothing joined stays as it is)."""
    merged = tokens[centres].float().clone()
    if len(centres) == len(tokens):
        return merged.to(tokens.dtype)
    others = torch.ones(len(tokens), dtype=torch.bool, device=tokens.device)
    others.index_fill_(0, centres, False)  # `others[centres] = False` would send the False over
    rest = tokens[first_where(others, len(tokens) - len(centres))].float()
    nearest = torch.cdist(rest, tokens[centres].float()).argmin(dim=-1)
    sums = torch.zeros_like(merged).index_add_(0, nearest, rest)
    counts = torch.zeros(len(centres), device=tokens.device).index_add_(
        0, nearest, torch.ones(len(nearest), device=tokens.device)
    )
    joined = (counts > 0)[:, None]
    means = sums / counts.clamp_min(1)[:, None]
    merged = torch.where(joined, beta * merged + (1 - beta) * means, merged)
    return merged.to(tokens.dtype)


def retained(params: CTRParams, total: int) -> int:
    """Tokens a step of `total` keeps: 50 of 196 at the authors' share."""
    return max(1, min(total, round(params.retain * total)))


def reduce_step(
    grid: torch.Tensor,
    static: torch.Tensor,
    importance: torch.Tensor,
    params: CTRParams,
    static_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: (keep [T] bool, embeddings [T, H] with the static centres merged). static [T]:
    the tokens like their place in the step before; static_count: how many (read for every step
    of the chunk at once)."""
    total = len(grid)
    keep = torch.zeros(total, dtype=torch.bool, device=grid.device)
    retain = retained(params, total)
    if retain >= total:
        return keep | True, grid
    keep_static, keep_dynamic = split_budget(retain, static_count, total)
    out = grid.clone()
    if keep_static > 0:
        where = first_where(static, static_count)
        centres = density_peaks(grid[where], keep_static, params.k)
        out[where[centres]] = merge_into_centres(grid[where], centres, params.beta)
        keep.index_fill_(0, where[centres], True)
    if keep_dynamic > 0:  # the static ones last: the moving ones' order is as among themselves
        moving = importance.float().masked_fill(static, float("-inf"))
        keep.index_fill_(0, top_in_order(moving, keep_dynamic), True)
    return keep, out


def reduce(params: CTRParams, tokens: StepTokens) -> Reduced:
    static = similarity_to_previous(tokens.grid, tokens.previous) > params.similarity_threshold
    counts = static.sum(dim=-1).tolist()  # every step's in one read: the chunk's one wait
    return step_by_step(
        tokens,
        lambda s: reduce_step(tokens.grid[s], static[s], tokens.importance[s], params, counts[s]),
    )


REDUCER = Reducer(
    name="ctr",
    description="a fixed count of tokens a step: moving ones by tower attention, still ones merged",
    paper=Paper(
        "StreamingTOM: Streaming Token Compression for Efficient Video Understanding",
        2025,
        "https://arxiv.org/abs/2510.18269",
    ),
    params=CTRParams,
    reduce=reduce,
    kept=retained,
    temporal=True,
    tower_attention=True,
)
