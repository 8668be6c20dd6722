"""VisionZip: a few dominant tokens by the vision tower's own attention, and a few contextual ones
merged from the rest. Following the authors' `visionzip/clip_encoder.py`: the tokens that got the
most attention are kept; of the others, targets are taken at an even stride and every remaining
token joins the target it is most similar to (cosine); a contextual token is its target plus the
mean of the tokens that joined it (the paper's reading, `merge: mean`, averages them instead). Each
step alone: nothing temporal, so images and pages take it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import Paper, knob
from mmkv_cli.reduce.base import (
    Reduced,
    Reducer,
    StepTokens,
    first_where,
    step_by_step,
    top_in_order,
)


@dataclass(frozen=True)
class VisionZipParams:
    dominant: float = knob(
        54 / 576, "share of a step's tokens kept by attention (the authors: 54 of 576)", above=0.0
    )
    contextual: float = knob(
        10 / 576, "share of a step's tokens merged from the rest (the authors: 10 of 576)", low=0.0
    )
    merge: Literal["sum", "mean"] = knob(
        "sum",
        "a contextual token: its target plus the mean of those that joined it (the authors' "
        "code), or the mean of all of them (the paper)",
    )


def counts(params: VisionZipParams, total: int) -> tuple[int, int]:
    """(dominant, contextual) tokens a step of `total` keeps: at least one dominant."""
    dominant = min(total, max(1, round(params.dominant * total)))
    return dominant, min(total - dominant, round(params.contextual * total))


def contextual_tokens(
    rest: torch.Tensor, count: int, merge: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target indices into rest [N, H], their merged embeddings [count, H])."""
    stride = max(1, len(rest) // count)
    targets = torch.arange(0, len(rest), stride, device=rest.device)[:count]
    joining = torch.ones(len(rest), dtype=torch.bool, device=rest.device)
    joining.index_fill_(0, targets, False)
    joins = first_where(joining, len(rest) - len(targets))  # sizes the host knows: no wait
    unit = torch.nn.functional.normalize(rest.float(), dim=-1)
    nearest = (unit[joins] @ unit[targets].T).argmax(dim=-1)
    sums = torch.zeros(len(targets), rest.shape[-1], device=rest.device)
    sums = sums.index_add_(0, nearest, rest[joins].float())
    joined = torch.zeros(len(targets), device=rest.device).index_add_(
        0, nearest, torch.ones(len(nearest), device=rest.device)
    )  # not bincount, which reads the largest index back first
    if merge == "sum":
        merged = rest[targets].float() + sums / joined.clamp_min(1)[:, None]
    else:
        merged = (rest[targets].float() + sums) / (joined + 1)[:, None]
    return targets, merged.to(rest.dtype)


def reduce_step(
    grid: torch.Tensor, importance: torch.Tensor, params: VisionZipParams
) -> tuple[torch.Tensor, torch.Tensor]:
    dominant, contextual = counts(params, len(grid))
    keep = torch.zeros(len(grid), dtype=torch.bool, device=grid.device)
    keep.index_fill_(0, top_in_order(importance, dominant), True)
    out = grid.clone()
    if contextual > 0:
        rest = first_where(~keep, len(grid) - dominant)
        targets, merged = contextual_tokens(grid[rest], contextual, params.merge)
        out[rest[targets]] = merged
        keep.index_fill_(0, rest[targets], True)
    return keep, out


def reduce(params: VisionZipParams, tokens: StepTokens) -> Reduced:
    return step_by_step(tokens, lambda s: reduce_step(tokens.grid[s], tokens.importance[s], params))


REDUCER = Reducer(
    name="visionzip",
    description="dominant tokens by tower attention plus a few merged contextual ones, per step",
    paper=Paper(
        "VisionZip: Longer is Better but Not Necessary in Vision Language Models",
        2025,
        "https://arxiv.org/abs/2412.04467",
    ),
    params=VisionZipParams,
    reduce=reduce,
    temporal=False,
    tower_attention=True,
)
