"""InfiniPot-V (Kim et al., NeurIPS 2025): continual, question-free compression under a memory cap.

Frames stream into one running cache. Whenever the next chunk would push it past the cap, every
layer is cut back so that the chunk fits: part of what stays is chosen by Temporal-axis Redundancy
(TaR) - the newest frames are kept whole as the reference, and an older token scores high when its
key differs from the keys at the same spatial place in those frames - and the rest by Value Norm
(VaN): tokens whose values are large. No attention map and no prompt is needed.

As the authors' `process_kv_cache` does, the reference is the newest int(0.25 x held tokens /
tokens a frame) frames' worth of entries, and a token is paired with the reference entry whose
cache index is equal to its own mod the tokens of a frame. Departures: the pack keeps one token set
per layer, so TaR and VaN are averaged over KV heads instead of selecting per head. The code's
optional layer-adaptive pooling of the value norms (off in its scripts) is `pooling:
layer_adaptive`. `reference: previous` scores against the previous frame;
`reference_count: held_steps` and `pairing: spatial` are the paper's reading of "recent frames" and
"the same spatial place".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.kernels.host import host_all
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState


@dataclass(frozen=True)
class InfiniPotParams(StreamParams):
    tar_share: float = knob(
        0.5,
        "share of the kept tokens chosen by TaR (the rest by value norm; tar_ratio)",
        low=0,
        high=1,
    )
    recent_share: float = knob(
        0.25,
        "share of the held frames that are TaR's reference, kept whole (query_ratio)",
        low=0,
        high=1,
    )
    reference: Literal["recent", "previous"] = knob(
        "recent",
        "TaR compares a token with the same place in the recent frames (the authors' code) or in "
        "the previous frame",
    )
    reference_count: Literal["held_tokens", "held_steps"] = knob(
        "held_tokens",
        "the reference: the newest int(recent_share x held tokens / tokens a frame) frames' "
        "worth of entries (the authors' process_kv_cache), or ceil(recent_share x held steps) "
        "whole steps",
    )
    pooling: Literal["none", "layer_adaptive"] = knob(
        "none",
        "value norms as they are, or smoothed by depth quarter before VaN picks (the code's "
        "adaptive_pooling): 7x7x7 across frames and their grids, 5x5 over each frame's grid, 3 "
        "along the cache, none",
    )
    pairing: Literal["cache_slot", "spatial"] = knob(
        "cache_slot",
        "same place: equal index mod tokens a frame in the held cache (the authors' code), or the "
        "same place of the frame grid, wherever evictions left the token (the paper's intent)",
    )
    selection: Literal["per_head", "per_layer"] = knob(
        "per_head",
        "per_head: each KV head keeps its own tokens by its own TaR and value norms (the authors' "
        "process_kv_cache); per_layer: one set a layer, by the heads' mean scores",
    )


# --- scoring: pure functions over tensors ---


def spatial_slots(steps: torch.Tensor) -> torch.Tensor:
    """steps [n] (ascending) -> [n] each token's place within its step, counted from the step's
    end, so a frame grid lines up across steps even after a varying text stamp before it."""
    n = steps.numel()
    last = torch.ones(n, dtype=torch.bool)
    last[:-1] = steps[1:] != steps[:-1]
    end = torch.flip(
        torch.cummin(torch.flip(torch.where(last, torch.arange(n), n), [0]), 0)[0], [0]
    )
    return end - torch.arange(n)


def recent_mask(steps: torch.Tensor, share: float) -> torch.Tensor:
    """[n] True for the tokens of the newest ceil(share x held steps) steps (at least one)."""
    held = torch.unique(steps)
    count = max(1, math.ceil(share * held.numel())) if share > 0 else 0
    return steps >= held[-count] if count else torch.zeros_like(steps, dtype=torch.bool)


def recent_entries(n: int, per_frame: int, share: float) -> torch.Tensor:
    """[n] True for the newest int(share x n / per_frame) x per_frame held entries: the authors'
    reference, counted in frames' worth of cache entries, not in the frames they came from."""
    count = int(share * n / per_frame) * per_frame if per_frame > 0 else 0
    return torch.arange(n) >= n - count if count else torch.zeros(n, dtype=torch.bool)


def tar_scores(
    keys: torch.Tensor,
    frames: torch.Tensor,
    slots: torch.Tensor,
    reference: torch.Tensor | str,
    per_head: bool = False,
) -> torch.Tensor:
    """Temporal-axis redundancy turned into a keep score: keys [H, n, D]; frames [n] (ascending)
    which frame a token counts in and slots [n] its place there (see pairs_by_cache_slot and
    spatial_slots).

    reference: a [n] mask of the reference tokens: a token scores minus the mean, over the
    reference frames that hold its place, of the cosine similarity to the token there, heads
    averaged (per_head: each head's own, [H, n]). "previous": minus the similarity to the same
    place in the previous frame (0 where there is none). Higher means less redundant, more worth
    keeping.
    """
    device = keys.device  # the similarities on the keys' device; the places are host bookkeeping
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    if isinstance(reference, str):  # previous frame: at most one pair a token
        mine, theirs = (t.to(device, non_blocking=True) for t in previous_pairs(frames, slots))
        cos = (unit[:, mine] * unit[:, theirs]).sum(dim=-1)
        scores = torch.zeros(unit.shape[0], frames.numel(), device=device).index_add_(1, mine, -cos)
        return scores if per_head else scores.mean(dim=0)
    # a mean of cosines with the reference tokens at a place is the dot product with the mean of
    # their unit keys: each place's reference keys summed once, not a pair for every token and
    # reference frame (thousands of frames when a frame is a few tokens)
    size = int(slots.max()) + 1 if slots.numel() else 0
    held = reference.nonzero().squeeze(1)
    place, held = (t.to(device, non_blocking=True) for t in (slots, held))
    sums = torch.zeros(unit.shape[0], size, unit.shape[2], device=device)
    sums.index_add_(1, place[held], unit[:, held])
    counted = torch.bincount(slots[reference], minlength=size).clamp_min(1)
    total = -(unit * sums[:, place]).sum(dim=-1)
    total = total if per_head else total.mean(dim=0)
    return total / counted[slots].to(device, non_blocking=True)


def previous_pairs(frames: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, the token at its place in the previous frame) index pairs, each [m]: tokens of the
    first frame, or whose place the previous frame lacks, have none."""
    size = int(slots.max()) + 1 if slots.numel() else 0
    rank = torch.unique(frames, return_inverse=True)[1]
    table = torch.full((int(rank.max()) + 1 if rank.numel() else 0, size), -1)
    table[rank, slots] = torch.arange(frames.numel())
    before = torch.where(rank > 0, table[(rank - 1).clamp_min(0), slots], -1)
    has = before >= 0
    return has.nonzero().squeeze(1), before[has]


def pairs_by_cache_slot(n: int, per_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' pairing: the held visual entries cut into runs of per_frame by cache index,
    (frame [n], slot [n]) = divmod(index, per_frame), whichever frame a token came from. The runs
    are counted back from the newest entry, so the reference (whole runs, the newest) lines up as
    in the code, whose held count is always a multiple of a frame; a partial oldest run is -1."""
    index = torch.arange(n) - n % per_frame
    return torch.div(index, per_frame, rounding_mode="floor"), index % per_frame


def value_norms(values: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """values [H, n, D] -> [n] L2 norm of each token's value, heads averaged (VaN; per_head: each
    head's, [H, n])."""
    norms = values.float().norm(dim=-1)
    return norms if per_head else norms.mean(dim=0)


# (pooling dimensions, kernel) by quarter of the model's depth, shallow first: the code's lists
# (kvcache_utils.py, 81a4dbe: pooling_func_list [3, 2, 1, -1], pool_size_list [7, 5, 3, 1])
ADAPTIVE_POOLING = ((3, 7), (2, 5), (1, 3), (0, 0))


def layer_pooling(layer: int, layers: int) -> tuple[int, int]:
    """(dimensions, kernel) of the value-norm pooling at `layer`: its quarter of the depth, as the
    code counts it (layer // (layers // 4)), the last quarter taking any layers left over."""
    quarter = min(len(ADAPTIVE_POOLING) - 1, layer // max(1, layers // len(ADAPTIVE_POOLING)))
    return ADAPTIVE_POOLING[quarter]


def pooled_norms(
    norms: torch.Tensor, dims: int, kernel: int, per_frame: int, grid: tuple[int, int] | None
) -> torch.Tensor:
    """Value norms [n] of the held entries, averaged over a window, stride 1, zero-padded to the
    same size (padding counted in the average, as torch's pooling does): kernel^3 across frames and
    each frame's grid (dims 3), kernel^2 within each frame's grid (dims 2), or kernel along the
    cache (dims 1). As the code does, a grid window is no larger than the frames held, the grid's
    rows or its columns (odd: one less when even; none under 2). A frame is a run of per_frame
    entries counted back from the newest (the code's frames); the oldest, partial one is padded
    with zeros in front. Steps that are not one whole grid (stamped frames) pool along the cache."""
    n = norms.numel()
    if dims == 0 or n == 0:
        return norms
    rows = grid[0] if grid else 0
    if dims >= 2 and rows and per_frame == grid[0] * grid[1]:
        frames = -(-n // per_frame)
        size = min(kernel, frames, rows, grid[1])
        size -= 1 - size % 2
        if size < 2:
            return norms
        padded = torch.nn.functional.pad(norms.float(), (frames * per_frame - n, 0))
        if dims == 3:
            pooled = torch.nn.functional.avg_pool3d(
                padded.view(1, 1, frames, rows, -1), size, stride=1, padding=size // 2
            )
        else:
            pooled = torch.nn.functional.avg_pool2d(
                padded.view(frames, 1, rows, -1), size, stride=1, padding=size // 2
            )
        return pooled.reshape(-1)[frames * per_frame - n :]
    pooled = torch.nn.functional.avg_pool1d(
        norms.float().view(1, 1, n), kernel, stride=1, padding=kernel // 2
    )
    return pooled.reshape(-1)


def choose(
    tar: torch.Tensor, van: torch.Tensor, reference: torch.Tensor, count: int, tar_share: float
) -> torch.Tensor:
    """Local indices (ascending) of `count` tokens: the reference tokens and the best by TaR up to
    count - round((1 - tar_share) x count), then the best by value norm among the rest."""
    n = tar.numel()
    count = min(count, n)
    tar_budget = count - round((1 - tar_share) * count)  # the code rounds the VaN part
    keep = torch.zeros(n, dtype=torch.bool)
    ref = reference.nonzero().squeeze(1)
    keep[ref[max(0, ref.numel() - tar_budget) :]] = True  # the newest, if there are too many
    spare = tar_budget - int(keep.sum())
    if spare > 0:
        keep[tar.masked_fill(keep, float("-inf")).topk(spare).indices] = True
    rest = count - int(keep.sum())
    if rest > 0:
        keep[van.float().masked_fill(keep, float("-inf")).topk(rest).indices] = True
    return keep.nonzero().squeeze(1)


# --- the memory policy ---


class InfiniPotMemory(KeepAll):
    def __init__(self, params: InfiniPotParams, budget: Budget, context):
        super().__init__(params, budget, context)
        self.streamed = 0  # visual tokens seen at the previous chunk's end

    def saved(self) -> dict[str, torch.Tensor]:
        return {"streamed": torch.tensor(self.streamed)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.streamed = int(saved["streamed"])

    def after_chunk(self, state: StreamState) -> None:
        chunk = state.seen - self.streamed
        self.streamed = state.seen
        if state.seen >= state.total:
            return  # the last chunk: finish() holds the pack to the cap
        # leave room for a chunk like this one, so the running cache stays within the cap
        room = max(1, self.budget.tokens_of(state.total) - chunk)
        if _held(state) > room:
            self._compress(state, room)

    def finish(self, state: StreamState) -> None:
        cap = self.budget.tokens_of(state.total)
        if _held(state) > cap:
            self._compress(state, cap)

    def _compress(self, state: StreamState, count: int) -> None:
        """Every layer held to `count` entries (per head: each KV head to `count` of its own)."""
        p = self.params
        per_head = p.selection == "per_head"
        per_frame = int(torch.bincount(state.token_step).max())  # a step's tokens: a "frame"
        # every stream token's place in its grid (a pass over the whole stream: spatial only)
        places = spatial_slots(state.token_step) if p.pairing == "spatial" else None
        scored, tars, norms = [], [], []
        for layer in range(state.layers):
            # per head: each head's own entries, as many for each ([H, m]); else all, as one
            entries = torch.stack(state.cache.head_entries(layer)) if per_head else None
            m = entries.shape[1] if per_head else state.cache.count(layer)
            if m <= count:
                continue
            keys, values = state.cache.visual(layer)
            if per_head:  # [H, m, D]: head h's own entries
                at = entries.to(keys.device, non_blocking=True)
                rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
                keys, values = keys[rows, at], values[rows, at]
            whose = entries if per_head else torch.arange(m)[None]  # per head, or once
            inputs = [self._tar_inputs(state, layer, row, per_frame, places) for row in whose]
            if all(i is inputs[0] for i in inputs):  # the same for every head: one call
                reference, frames, slots, compared = inputs[0]
                tar = tar_scores(keys, frames, slots, compared, per_head).view(-1, m)
            else:
                tar = torch.cat([
                    tar_scores(keys[h : h + 1], *i[1:], per_head=True) for h, i in enumerate(inputs)
                ])  # fmt: skip
            pooling = (
                layer_pooling(layer, state.layers) if p.pooling == "layer_adaptive" else (0, 0)
            )
            van = value_norms(values, per_head).view(-1, m)
            van = torch.stack([pooled_norms(row, *pooling, per_frame, state.grid) for row in van])
            scored.append((layer, whose, [i[0] for i in inputs]))
            tars.append(tar)
            norms.append(van)
        # every layer's scores over in one copy (one wait); the choice is host bookkeeping
        read = host_all(tars + norms)
        for i, (layer, whose, references) in enumerate(scored):
            tar, van = read[i], read[len(scored) + i]
            kept = [
                row[choose(tar[h], van[h], references[h], count, p.tar_share)]
                for h, row in enumerate(whose)
            ]
            if per_head:
                state.cache.retain_heads(layer, kept)
            else:
                state.cache.retain(layer, kept[0])

    def _tar_inputs(
        self, state: StreamState, layer: int, row: torch.Tensor, per_frame: int, places
    ):
        """TaR's (reference, frames, slots, what it compares with) for the layer's entries `row`:
        the same object for every head where they depend only on how many entries there are."""
        p = self.params
        share = p.recent_share if p.reference == "recent" else 0
        if p.reference_count == "held_tokens" and p.pairing == "cache_slot":
            return _by_count(len(row), per_frame, share, p.reference)
        index = state.cache.index[layer][row]
        steps = state.token_step[index]
        if p.reference_count == "held_tokens":
            reference = recent_entries(len(row), per_frame, share)
        else:
            reference = recent_mask(steps, share)
        if p.pairing == "cache_slot":
            frames, slots = pairs_by_cache_slot(len(row), per_frame)
        else:
            frames, slots = steps, places[index]
        return reference, frames, slots, reference if p.reference == "recent" else "previous"


def _held(state: StreamState) -> int:
    """Visual entries each KV head of the first layer holds (every layer, every head as many)."""
    return len(state.cache.head_entries(0)[0])


@functools.lru_cache(maxsize=8)
def _by_count(n: int, per_frame: int, share: float, reference: str) -> tuple:
    """TaR's inputs for n held entries paired by cache slot: they depend on n alone."""
    recent = recent_entries(n, per_frame, share)
    frames, slots = pairs_by_cache_slot(n, per_frame)
    return recent, frames, slots, recent if reference == "recent" else "previous"


METHOD = Method(
    name="infinipot",
    label="InfiniPotV",
    description="streaming under a memory cap: temporal redundancy and value norms, no question",
    paper=Paper(
        "InfiniPot-V: Memory-Constrained KV Cache Compression for Streaming Video Understanding",
        2025,
        "https://arxiv.org/abs/2506.15745",
    ),
    params=InfiniPotParams,
    budget=Budget(tokens=4096),  # the authors' example: a ~4K-token cache
    streaming=InfiniPotMemory,
)
