"""StreamingTOM's Causal Temporal Reduction: every step keeps a fixed number of tokens before the
language model (196 -> 50 on LLaVA-OV). Following the authors' `streamingtom/modules/ctr.py`: a
token more similar (cosine) than a threshold to its place in the step before is static, the rest
dynamic (the stream's first step is all dynamic); the step's budget is split between the two in
proportion; dynamic tokens are kept by the attention they got in the vision tower, static ones are
clustered (DPC-kNN) and each centre, at its own place, becomes beta x itself + (1 - beta) x the mean
of the static tokens nearest it."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import Paper, knob
from mmkv_cli.reduce.base import Reduced, Reducer, StepTokens, similarity_to_previous


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


def split_budget(
    retain: int, static: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(static, dynamic) tokens each step keeps (static [S]: its static count): in proportion to
    its static share, neither more than there are (the authors' rounding: the static part rounded
    down). Counts stay where they are: no step's count is read by the host."""
    dynamic_count = total - static
    keep_static = retain * static // total
    over = retain - keep_static > dynamic_count
    keep_static = torch.where(over, retain - dynamic_count, keep_static)
    return keep_static, retain - keep_static


def distances(tokens: torch.Tensor) -> torch.Tensor:
    """[S, T, T]: each step's tokens' Euclidean distances over sqrt(width), each pair computed on
    its own (not through a matrix product), so a pair's distance is the same in any company."""
    x = tokens.float()
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / x.shape[-1] ** 0.5


def top_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[S, T] bool: each step's `counts[s]` highest scores (ties to the earlier token)."""
    order = torch.sort(-scores, dim=-1, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    return ranks < counts[:, None]


def density_peaks(
    dist: torch.Tensor, static: torch.Tensor, counts: torch.Tensor, k: int
) -> torch.Tensor:
    """[S, T] bool: `counts[s]` cluster centres among each step's static tokens by DPC-kNN:
    density from the k nearest static neighbours (the token's own 0 among them, as the authors
    count them), times the distance to the nearest denser static token (the farthest pair's for
    the densest). Ties of density go to the earlier token (the authors break them with noise).
    A step with no more static tokens than its count keeps all of them."""
    steps, total = static.shape
    within = static[:, :, None] & static[:, None, :]
    how_many = static.sum(dim=-1)
    every = (counts >= how_many)[:, None]  # steps whose count covers all their static tokens
    near_count = min(k, total - 1)
    if near_count < 1:  # one token a step
        return static & every
    near = torch.topk(dist.masked_fill(~static[:, None, :], float("inf")), near_count, dim=-1,
                      largest=False).values  # fmt: skip
    over = (how_many - 1).clamp(1, k)  # min(k, n - 1) neighbours, at least one
    counted = torch.arange(near_count, device=dist.device) < over[:, None, None]
    density = torch.exp(-torch.where(counted, near.square(), 0.0).sum(dim=-1) / over[:, None])
    index = torch.arange(total, device=dist.device)
    denser = (density[:, None, :] > density[:, :, None]) | (
        (density[:, None, :] == density[:, :, None]) & (index[None, :] < index[:, None])
    )
    farthest = dist.masked_fill(~within, float("-inf")).amax(dim=(-2, -1))
    to_denser = torch.where(denser & static[:, None, :], dist, farthest[:, None, None])
    score = (density * to_denser.amin(dim=-1)).masked_fill(~static, float("-inf"))
    return static & (every | top_mask(score, counts))


def merge_into_centres(
    tokens: torch.Tensor, dist: torch.Tensor, static: torch.Tensor, centres: torch.Tensor, beta
) -> torch.Tensor:
    """[S, T, H]: each centre as beta x itself + (1 - beta) x the mean of the other static tokens
    nearest it (a centre nothing joined, and every other token, stay as they are)."""
    x = tokens.float()
    joining = static & ~centres
    nearest = dist.masked_fill(~centres[:, None, :], float("inf")).argmin(dim=-1)
    sums = torch.zeros_like(x).scatter_add_(
        1, nearest[..., None].expand_as(x), x * joining[..., None]
    )
    counts = torch.zeros_like(joining, dtype=x.dtype).scatter_add_(1, nearest, joining.to(x.dtype))
    means = sums / counts.clamp_min(1)[..., None]
    merged = torch.where((counts > 0)[..., None], beta * x + (1 - beta) * means, x)
    return torch.where(centres[..., None], merged.to(tokens.dtype), tokens)


def retained(params: CTRParams, total: int) -> int:
    """Tokens a step of `total` keeps: 50 of 196 at the authors' share."""
    return max(1, min(total, round(params.retain * total)))


def reduce(params: CTRParams, tokens: StepTokens) -> Reduced:
    """Every step of the chunk at once, on its device, with no count read by the host: the static
    tokens' centres, merged, and the moving ones the tower attended most (the static ones last,
    so the moving ones' order is as among themselves)."""
    grid = tokens.grid
    total = grid.shape[1]
    retain = retained(params, total)
    if retain >= total:
        return Reduced(keep=torch.ones(grid.shape[:2], dtype=torch.bool, device=grid.device),
                       grid=grid)  # fmt: skip
    static = similarity_to_previous(grid, tokens.previous) > params.similarity_threshold
    keep_static, keep_dynamic = split_budget(retain, static.sum(dim=-1), total)
    dist = distances(grid)
    centres = density_peaks(dist, static, keep_static, params.k)
    moving = tokens.importance.float().masked_fill(static, float("-inf"))
    keep = centres | top_mask(moving, keep_dynamic)
    return Reduced(keep=keep, grid=merge_into_centres(grid, dist, static, centres, params.beta))


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
