"""STC (CVPR 2026, arXiv 2512.00891): hierarchical token compression for streaming video, as the
authors' code does it (lern-to-write/STC 9b13ce0, `model/prune.py` and `model/custom_siglip.py`):

- STC-Cacher: on all but every `reuse_every`-th frame the vision tower recomputes, layer by layer,
  only the share of tokens whose keys moved most since the last whole frame; the rest take that
  frame's attention and MLP outputs (backbones/tower_reuse.py; LLaVA-OneVision's SigLIP tower);
- STC-Pruner: after the projector, each frame keeps the tokens least like its own mean and least
  like the stream's memory (the mean of every frame's mean so far), both measured by a sum of
  Gaussian kernels over the half of the channels that vary least across the frame's tokens.

The authors encode a frame at a time; mmkv takes a chunk's steps in order, each as such a frame."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import Paper, knob
from mmkv_cli.reduce.base import Reduced, Reducer, StepTokens

ALPHAS = (0.125, 0.25, 0.5, 1.0, 2.0)  # the kernels' widths, 2^-3 .. 2^1 as the code's


@dataclass(frozen=True)
class STCParams:
    retain: float = knob(
        60 / 196, "share of a frame's tokens it keeps (token_per_frame: 60 of LLaVA-OV's 196)",
        above=0.0, high=1.0,
    )  # fmt: skip
    channel_share: float = knob(
        0.5, "share of channels the scores read: those varying least over the frame's tokens "
        "(keep_ratio)", above=0.0, high=1.0,
    )  # fmt: skip
    reuse_every: int = knob(
        2, "every Nth frame runs the vision tower whole; the others recompute part of each layer "
        "(cache_interval; 1: the whole tower for every frame)", low=1,
    )  # fmt: skip
    update_share: float = knob(
        0.25, "share of a reusing frame's tokens each tower layer recomputes: those whose keys "
        "moved most (update_token_ratio)", above=0.0, high=1.0,
    )  # fmt: skip


def retained(params: STCParams, total: int) -> int:
    """Tokens a frame of `total` keeps: 60 of 196 at the authors' share."""
    return max(1, min(total, round(params.retain * total)))


def kernel_similarity(features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[n]: each feature's sum over the kernel widths of exp(-|f - target|^2 / (2 width))."""
    distance = ((features - target) ** 2).sum(dim=-1)
    return sum(torch.exp(-distance / (2 * width)) for width in ALPHAS)


def quiet_channels(x: torch.Tensor, share: float) -> torch.Tensor:
    """The channels (indices) of x [n, C] whose values vary least over its rows: int(C x share)
    of them, the lowest variance first (ties to the earlier channel)."""
    count = max(1, int(x.shape[1] * share))
    return torch.sort(x.var(dim=0, unbiased=False), stable=True).indices[:count]


def frame_scores(x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    """[n]: a frame's tokens (x [n, k], the chosen channels) scored by likeness to the frame's own
    mean and to the stream's memory [k]; the least alike are kept."""
    unit = torch.nn.functional.normalize(x, dim=-1)
    own = kernel_similarity(unit, unit.mean(dim=0))
    remembered = kernel_similarity(unit, torch.nn.functional.normalize(memory, dim=-1))
    return own + remembered


def reduce(params: STCParams, tokens: StepTokens) -> Reduced:
    """Each step in turn: its channels chosen, its mean added to the memory, its least alike
    tokens kept (counts fixed: nothing is read by the host)."""
    grid = tokens.grid
    steps, total = grid.shape[:2]
    keep_count = retained(params, total)
    summed = tokens.carried.get("memory_sum")
    count = int(tokens.carried.get("memory_count", torch.tensor(0)))
    keeps = []
    for step in range(steps):
        x = grid[step].float()
        chosen = x[:, quiet_channels(x, params.channel_share)]
        mean = chosen.mean(dim=0)
        summed = mean if summed is None else summed.to(mean.device) + mean
        count += 1
        scores = frame_scores(chosen, summed / count)
        kept = torch.sort(scores, stable=True).indices[:keep_count]
        none = torch.zeros(total, dtype=torch.bool, device=grid.device)
        keeps.append(none.index_fill(0, kept, True))
    carried = {"memory_sum": summed, "memory_count": torch.tensor(count)}
    return Reduced(keep=torch.stack(keeps), grid=grid, carried=carried)


REDUCER = Reducer(
    name="stc",
    description="reuse the vision tower across frames, then keep each frame's least typical tokens",
    paper=Paper(
        "Accelerating Streaming Video Large Language Models via Hierarchical Token Compression "
        "(STC)",
        2026,
        "https://arxiv.org/abs/2512.00891",
    ),
    params=STCParams,
    reduce=reduce,
    kept=retained,
    temporal=True,  # a stream's memory and a reference frame: video only
    tower_attention=False,
    tower_reuse=lambda params: params.reuse_every > 1,
)
