"""MuKV (seed 000): multi-grained blocks, each prefilled on its own and compressed by a dual signal.

Three granularities cut the same visual stream: patch (a spatial quarter of a step's token grid), frame
(one temporal step) and segment (F frames); or, with views: middle_frame, patch and frame blocks come from
each segment's middle step only. Every block is prefilled after the init prompt only, scored by
last-layer attention column sums fused with a key-frequency signal, and keeps floor(rho_g * |block|)
tokens in temporal order. At ask, blocks are retrieved per granularity and reranked (retrieval.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmkv_cli.errors import UsageError
from mmkv_cli.methods.base import MemoryPolicy
from mmkv_cli.methods.retrieval import RetrievalContext

GRANULARITIES = ("patch", "frame", "segment")
# preset choices, the default first
OPTIONS = {
    "views": ("stream", "middle_frame"),
    "patch_blocks": ("spatial", "raster"),
    "frequency": ("fft", "diff"),
}


# --- scoring: pure functions over tensors ---


def minmax(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return (x - x.min()) / (x.max() - x.min() + eps)


def frequency_signal(keys: torch.Tensor, mode: str = "fft") -> torch.Tensor:
    """keys [N, D] (last layer, head-averaged) -> [N] how much each token departs from its neighbours.

    fft: keep the upper half of the frequency bins along the tokens, back to tokens, |.| averaged over D.
    diff: ||k_t - k_{t-1}|| (the first token scores as its successor's change).
    """
    keys = keys.float()
    n = keys.shape[0]
    if n < 2:
        return torch.zeros(n)
    if mode == "fft":
        spectrum = torch.fft.rfft(keys, dim=0)
        spectrum[: spectrum.shape[0] // 2] = 0
        return torch.fft.irfft(spectrum, n=n, dim=0).abs().mean(dim=1)
    if mode == "diff":
        change = (keys[1:] - keys[:-1]).norm(dim=1)
        return torch.cat([change[:1], change])
    raise ValueError(f"unknown frequency signal '{mode}' (fft, diff)")


def fused_score(attention: torch.Tensor, frequency: torch.Tensor, alpha: float) -> torch.Tensor:
    return alpha * minmax(attention) + (1 - alpha) * minmax(frequency)


def keep_count(block_tokens: int, rho: float) -> int:
    """floor(rho * |block|), at least one token so no block is emptied (tiny grids only)."""
    return max(1, min(block_tokens, math.floor(rho * block_tokens)))


def top_in_order(score: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` best scores, in temporal (ascending index) order."""
    return score.topk(count).indices.sort().values


# --- the block plan: which stream tokens form each block ---


@dataclass
class BlockPlan:
    granularity: str
    tokens: torch.Tensor  # indices into the visual stream, ascending
    steps: tuple[int, int]


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
    """The steps that get patch and frame blocks. stream: every step, so every token sits in one block of
    each granularity (the paper's figures and the authors' code); middle_frame: only each segment's middle
    step (the paper's prose)."""
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
    """Patch, frame and segment blocks over a stream of steps (patch and frame ones on the detailed steps).

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


class MuKVMemory(MemoryPolicy):
    """Independent multi-grained blocks (the encoder prefills them in batches: see blockwise.py)."""

    name = "mukv"
    blockwise = True

    def __init__(self, budget: float, params: dict):
        super().__init__(budget, params)
        for key, allowed in OPTIONS.items():  # a preset typo fails here, before any frame is read
            if params.get(key, allowed[0]) not in allowed:
                raise UsageError(
                    f"MuKV preset: {key} is '{params[key]}', expected one of {', '.join(allowed)}"
                )
        # --budget is the pack's share of one stream: the three views' rho sum to it (1.0 by default).
        rho = {g: float(r) for g, r in params["rho"].items()}
        scale = budget / sum(rho.values())
        self.rho = {g: min(1.0, r * scale) for g, r in rho.items()}

    def segment_steps(self, frames_per_step: int) -> int:
        return max(1, int(self.params["segment_frames"]) // frames_per_step)

    def plan(
        self, step_starts, step_lengths, grid_offsets, grid, frames_per_step
    ) -> list[BlockPlan]:
        return plan_blocks(
            step_starts,
            step_lengths,
            grid_offsets,
            grid,
            self.segment_steps(frames_per_step),
            self.params.get("patch_blocks", "spatial"),
            self.params.get("views", "stream"),
        )

    def choose(
        self, granularity: str, attention: torch.Tensor, last_keys: torch.Tensor
    ) -> torch.Tensor:
        """Local indices a block keeps. attention [N] column sums; last_keys [H_kv, N, D]."""
        p = self.params
        n = attention.shape[0]
        rho = self.rho[granularity]
        if rho >= 1.0:
            return torch.arange(n)
        frequency = frequency_signal(last_keys.float().mean(dim=0), p.get("frequency", "fft"))
        score = fused_score(attention, frequency, float(p["alpha"][granularity]))
        return top_in_order(score, keep_count(n, rho))


MEMORY, CONTEXT = MuKVMemory, RetrievalContext
