"""The token reducer as the encoders run it: a chunk's visual tokens from the backbone (with the
tower's attention when the reducer reads it), its grid tokens cut out step by step and handed to
the reducer with the step before, the kept ones' embeddings written back. Markers between steps
(Qwen3-VL's timestamps) always go on. Reducers run where the embeddings are, in float32 (CTR's
clustering of an hour of 7B-wide frames takes minutes on a host CPU), with stable sorts and ties to
the earlier token, so CPU and CUDA choose alike."""

from __future__ import annotations

import numpy as np
import torch

from mmkv_cli.backbones.base import Backbone, StreamLayout
from mmkv_cli.reduce import StepTokens
from mmkv_cli.reduce.choice import ReducerChoice


def grid_index(layout: StreamLayout, first_step: int, steps: int) -> torch.Tensor:
    """[steps, T]: where each step's grid tokens sit in a chunk starting at `first_step`."""
    lengths = layout.step_lengths[first_step : first_step + steps]
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    offsets = torch.tensor(layout.offsets()[first_step : first_step + steps])
    tokens = layout.grid[0] * layout.grid[1]
    return (starts + offsets)[:, None] + torch.arange(tokens)[None, :]


class ChunkReducer:
    """One encode's reducer and what it carries from chunk to chunk: the last step's grid tokens."""

    def __init__(self, choice: ReducerChoice):
        self.choice = choice
        self.previous: torch.Tensor | None = None  # [T, H] float32, where the embeddings are
        # what the reducer carries from chunk to chunk, and the vision tower's reused layers
        # (STC): replaced each chunk, never written in place (a live stream's copy shares them)
        self.carried: dict[str, torch.Tensor] = {}
        self.tower: dict[str, torch.Tensor] = {}

    def visual(
        self,
        backbone: Backbone,
        frames: np.ndarray,
        steps: list[tuple[float, float]],
        layout: StreamLayout,
        first_step: int,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(the chunk's embeddings [1, n, H] with merged tokens written in, the extra LM inputs,
        keep [n] bool: the tokens to prefill). inputs: the backbone's prepared for the frames."""
        importance = None
        reducer, params = self.choice.reducer, self.choice.params
        if reducer.tower_attention:
            embeds, extra, importance = backbone.visual_chunk_scored(frames, steps, layout, inputs)
        elif reducer.tower_reuse is not None and reducer.tower_reuse(params):
            reuse = (self.tower, params.reuse_every, params.update_share)
            embeds, extra, self.tower = backbone.visual_chunk_reusing(
                frames, steps, layout, inputs, reuse
            )
        else:
            embeds, extra = backbone.visual_chunk(frames, steps, layout, inputs)
        where = grid_index(layout, first_step, len(steps))
        flat = where.flatten().to(embeds.device, non_blocking=True)
        grid = embeds[0, flat].float().view(*where.shape, -1)
        previous = self.previous.to(grid.device) if self.previous is not None else None
        if importance is not None:
            importance = importance.to(grid.device)
        reduced = reducer.reduce(params, StepTokens(grid, previous, importance, self.carried))
        self.previous = grid[-1].clone()  # not a view: the chunk's grid is let go
        self.carried = reduced.carried
        keep = torch.ones(embeds.shape[1], dtype=torch.bool)
        keep[where.flatten()] = reduced.keep.flatten().cpu()
        embeds = embeds.clone()
        embeds[0, flat] = reduced.grid.flatten(0, 1).to(embeds.device, embeds.dtype)
        return embeds, extra, keep

    def saved(self) -> dict[str, torch.Tensor]:
        out = {} if self.previous is None else {"previous": self.previous.cpu()}
        out |= {f"carried.{k}": v.cpu() for k, v in self.carried.items()}
        return out | {f"tower.{k}": v.cpu() for k, v in self.tower.items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.previous = saved.get("previous")
        self.carried = {k[8:]: v for k, v in saved.items() if k.startswith("carried.")}
        self.tower = {k[6:]: v for k, v in saved.items() if k.startswith("tower.")}
