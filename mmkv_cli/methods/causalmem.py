"""CausalMem (arXiv 2606.25658): a fixed budget of visual tokens, each frame's redundancy measured
against an online semantic basis of what was seen. Following the authors' code (hktk07/CausalMem,
`FOSSCache` in llava/model/llava_arch_v3.py and _v3_time.py, the path their scripts run):

- every frame first updates the basis: the first frame's top right singular vectors; after it,
  each direction's usage (mean |coefficient|) decays into a running score, the frame's tokens the
  basis explains least add their residuals as new orthonormal directions, and the basis keeps its
  k_max most used;
- the frame's tokens join the foreground; over the budget, the foreground keeps the tokens with the
  most residual energy against the basis (`max(100, budget - backgrounds)` of them), and each
  frame's dropped tokens are averaged into one background entry of that frame.

The authors choose among the projector's outputs and prefill what is kept. mmkv's memory streams
through the model, so it chooses by the same embeddings (what the language model took in) and
evicts the KV of what it drops; a frame's background entry is the mean of its dropped tokens'
K and V, held where its first dropped token was (docs/methods.md)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.merging import SlotMeans
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import ranks


@dataclass(frozen=True)
class CausalMemParams(StreamParams):
    k_max: int = knob(
        64, "directions the semantic basis holds at most (FOSS_K_MAX in the authors' scripts)",
        low=1,
    )  # fmt: skip
    decay: float = knob(
        0.9, "a direction's usage score: decay x itself + (1 - decay) x its mean |coefficient|",
        low=0.0, high=1.0,
    )  # fmt: skip
    new_directions: int = knob(
        8, "directions a frame may add: its least explained tokens' residuals (FOSS_MAX_NEW_BASIS)",
        low=0,
    )  # fmt: skip
    time_weight: float = knob(
        0.0, "weight of a token's recency against its residual energy (0 in every script of the "
        "authors; 0.2 is their class's default)", low=0.0, high=1.0,
    )  # fmt: skip
    min_foreground: int = knob(
        100, "tokens the foreground keeps however many backgrounds there are (never above the "
        "budget)", low=1,
    )  # fmt: skip


def first_basis(x: torch.Tensor, k_max: int) -> torch.Tensor:
    """[D, q]: the top right singular vectors of the first frame's tokens x [n, D], q = min(k_max,
    n, D). (The code's randomized svd_lowrank estimates these; the exact ones agree everywhere.)"""
    q = min(k_max, *x.shape)
    return torch.linalg.svd(x, full_matrices=False).Vh[:q].T


def residual(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """[n, D]: what of each token the basis does not explain."""
    return x - (x @ basis) @ basis.T


def update_basis(
    basis: torch.Tensor, usage: torch.Tensor, x: torch.Tensor, params: CausalMemParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The basis [D, k] and its usage scores [k] after a frame's tokens x [n, D]: usage decayed
    toward each direction's mean |coefficient|; the frame's `new_directions` least explained tokens'
    residuals orthonormalised against the basis and added (score 1); then the k_max most used kept
    in their order."""
    coefficients = x @ basis
    left = x - coefficients @ basis.T
    usage = params.decay * usage + (1.0 - params.decay) * coefficients.abs().mean(dim=0)
    count = min(params.new_directions, len(x))
    if count:
        worst = torch.topk(left.norm(dim=-1), count).indices
        fresh = torch.linalg.qr(left[worst].T).Q
        fresh = torch.linalg.qr(fresh - basis @ (basis.T @ fresh)).Q
        basis = torch.cat([basis, fresh], dim=1)
        usage = torch.cat([usage, usage.new_ones(fresh.shape[1])])
    if basis.shape[1] > params.k_max:
        top = torch.sort(torch.topk(usage, params.k_max).indices).values
        basis, usage = basis[:, top], usage[top]
    return basis, usage


def ranking_scores(
    energy: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor, step: int, time_weight: float
) -> torch.Tensor:
    """Each foreground token's score (-inf where not held): its residual energy scaled to [0, 1]
    over the held tokens, weighed against its frame's recency (step + 1) / (now + 1)."""
    low = energy.masked_fill(~valid, float("inf")).min()
    high = energy.masked_fill(~valid, float("-inf")).max()
    scaled = (energy - low) / (high - low).clamp_min(1e-6)
    recency = ((steps + 1).float() / (step + 1)).clamp(0.0, 1.0)
    score = (1.0 - time_weight) * scaled + time_weight * recency
    return score.masked_fill(~valid, float("-inf"))


def keep_foreground(
    score: torch.Tensor, valid: torch.Tensor, backgrounds: torch.Tensor, cap: int, floor: int
) -> torch.Tensor:
    """[n] bool: the foreground after a frame joined it. Over the budget (held tokens plus
    background entries above `cap`), the max(floor, cap - backgrounds) best scored (ties to the
    earlier), else all held. Counts stay on the device: nothing is read by the host."""
    rank = ranks(score)
    allowed = torch.clamp(cap - backgrounds, min=min(floor, cap))
    over = valid.sum() + backgrounds > cap
    return torch.where(over, valid & (rank < allowed), valid)


class CausalMemMemory(KeepAll):
    reads_embeddings = True

    def __init__(self, params: CausalMemParams, budget: Budget, context):
        super().__init__(params, budget, context)
        self.basis: torch.Tensor | None = None  # [D, k] float32, where the model is
        self.usage: torch.Tensor | None = None  # [k]
        self.embeds: torch.Tensor | None = None  # [m, H] the foreground's embeddings, float32
        self.index = torch.empty(0, dtype=torch.long)  # [m] their stream indices
        self.background = torch.empty(0, 3, dtype=torch.long)  # rows (step, stream index, count)
        self.added = 0  # tokens up to this stream index have joined the memory

    def saved(self) -> dict[str, torch.Tensor]:
        if self.basis is None:
            return {"added": torch.tensor(self.added)}
        named = {"basis": self.basis, "usage": self.usage, "embeds": self.embeds}
        named |= {"index": self.index, "background": self.background}
        return {k: v.cpu() for k, v in named.items()} | {"added": torch.tensor(self.added)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.added = int(saved["added"])
        if "basis" in saved:
            self.basis, self.usage, self.embeds = saved["basis"], saved["usage"], saved["embeds"]
            self.index = saved["index"]
            self.background = saved["background"]

    def after_chunk(self, state: StreamState) -> None:
        grid, index = state.chunk_grid, state.chunk_index
        if grid is None:
            return
        held = torch.isin(index, state.cache.index[0]) & (index >= self.added)
        rows = held.flatten().nonzero()[:, 0]  # host bookkeeping: what the cache holds of it
        if not len(rows):
            return
        self.added = int(index.max()) + 1
        new = grid.flatten(0, 1)[rows.to(grid.device, non_blocking=True)].float()
        new_index = index.flatten()[rows]
        new_steps = state.token_step[new_index]
        made = self.basis is None  # the first frame makes the basis rather than update it
        if made:
            first = int((new_steps == new_steps[0]).sum())
            self.basis = first_basis(new[:first], self.params.k_max)
            self.usage = torch.ones(self.basis.shape[1], device=new.device)
            self.embeds = new[:0]
        slab = torch.cat([self.embeds, new])
        steps = state.token_step[torch.cat([self.index, new_index])]
        valid = self._choose(slab, steps, len(self.embeds), state, made)
        self._evict(state, slab, steps, torch.cat([self.index, new_index]), valid)

    def _choose(self, slab, steps, old: int, state: StreamState, made: bool) -> torch.Tensor:
        """Each frame of the chunk in turn: the basis updated, its tokens joined, the foreground
        cut to the budget. The foreground kept [rows] on the host: the chunk's one wait."""
        device = slab.device
        on_device = steps.to(device, non_blocking=True)
        valid = torch.arange(len(slab), device=device) < old
        known = int(steps.max()) + 1
        had = torch.zeros(known, dtype=torch.bool)
        had[self.background[:, 0]] = True
        has_bg = had.to(device, non_blocking=True)
        cap = self.budget.tokens_of(state.total)
        start = old
        for step in torch.unique(steps[old:]).tolist():  # host bookkeeping, in stream order
            stop = start + int((steps[start:] == step).sum())
            x = slab[start:stop]
            if not (made and start == old):
                self.basis, self.usage = update_basis(self.basis, self.usage, x, self.params)
            valid = valid | (on_device == step)
            start = stop
            if stop + known <= cap:  # under the budget whatever was cut: held + backgrounds
                continue
            energy = residual(slab, self.basis).norm(dim=-1)
            score = ranking_scores(energy, valid, on_device, step, self.params.time_weight)
            kept = keep_foreground(score, valid, has_bg.sum(), cap, self.params.min_foreground)
            dropped = (valid & ~kept).float()
            has_bg = has_bg | (torch.zeros(known, device=device).index_add_(0, on_device, dropped)
                               > 0)  # fmt: skip
            valid = kept
        return valid.cpu()

    def _evict(self, state: StreamState, slab, steps, index, valid) -> None:
        """Keep the foreground; fold each frame's dropped tokens into its background entry."""
        gone = (~valid).nonzero()[:, 0]
        self.embeds = slab[valid.nonzero()[:, 0].to(slab.device, non_blocking=True)]
        self.index = index[valid]
        if not len(gone):
            return
        groups, group_of = torch.unique(steps[gone], return_inverse=True)
        counts = torch.bincount(group_of, minlength=len(groups))
        first = torch.full((len(groups),), 1 << 62).scatter_reduce(0, group_of, index[gone], "amin")
        old = dict(zip(*self.background[:, [0, 1]].T.tolist()))  # step -> its entry's index
        weights = dict(zip(*self.background[:, [0, 2]].T.tolist()))
        slots = torch.tensor([old.get(g, f) for g, f in zip(groups.tolist(), first.tolist())])
        before = torch.tensor([weights.get(g, 0) for g in groups.tolist()])
        cached = state.cache.index[0]
        fold = SlotMeans(group_of, torch.searchsorted(cached, index[gone]),
                    torch.searchsorted(cached, slots), before, counts)  # fmt: skip
        for layer in range(state.layers):
            state.cache.replace(layer, *(fold(held) for held in state.cache.visual(layer)))
        rest = self.background[~torch.isin(self.background[:, 0], groups)]
        merged = torch.cat([rest, torch.stack([groups, slots, counts + before], dim=1)])
        self.background = merged[torch.argsort(merged[:, 0])]
        local = torch.isin(cached, torch.cat([self.index, self.background[:, 1]])).nonzero()[:, 0]
        for layer in range(state.layers):
            state.cache.retain(layer, local)


METHOD = Method(
    name="causalmem",
    label="CausalMem",
    description="a fixed budget: tokens an online semantic basis explains least; one mean a frame",
    paper=Paper(
        "Towards a Dynamic and Fixed-budget Memory Bank for Efficient Streaming Video "
        "Understanding (CausalMem)",
        2026,
        "https://arxiv.org/abs/2606.25658",
    ),
    params=CausalMemParams,
    budget=Budget(tokens=12000),  # FOSS_BUDGET: an hour in 12k tokens; --budget-tokens sets yours
    streaming=CausalMemMemory,
)
