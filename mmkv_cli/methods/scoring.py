"""Scoring shared by several methods: pure functions over tensors, no method imports another's."""

from __future__ import annotations

import math

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.rope import unrotate


def minmax(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - min) / (max - min + eps), as float32."""
    x = x.float()
    return (x - x.min()) / (x.max() - x.min() + eps)


def top_in_order(score: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` best scores, in temporal (ascending index) order."""
    return score.topk(count).indices.sort().values


def ranks(scores: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
    """[n]: each entry's place by score, best first (ties to the earlier entry); entries outside
    `among` after all of them. Counts stay on the device: nothing is read by the host."""
    if among is not None:
        scores = scores.masked_fill(~among, float("-inf"))
    order = torch.sort(-scores, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def accumulate(total: torch.Tensor, sums: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Add a chunk's column sums over a layer's cached visual tokens (cache order; [n], or per
    head [H, n]) to their stream slots ([total] or [H, total]); returns `total`, grown first where
    the stream has outgrown it (a live stream's length is not known ahead)."""
    needed = int(index.max()) + 1 if index.numel() else 0
    if needed > total.shape[-1]:
        more = total.new_zeros(*total.shape[:-1], needed - total.shape[-1])
        total = torch.cat([total, more], dim=-1)
    return total.index_add_(total.dim() - 1, index, sums.float())


def top_per_head(scores: torch.Tensor, count: int) -> list[torch.Tensor]:
    """scores [H, n] -> for each head the indices of its `count` best, in temporal order (every
    head keeps as many: H2O's and MEDA's code)."""
    return list(scores.topk(min(count, scores.shape[1]), dim=1).indices.sort(dim=1).values)


def adaptive_per_head(scores: torch.Tensor, count: int, floor: float) -> list[torch.Tensor]:
    """AdaKV's head budgets: H x `count` entries in all, each head first its own best
    floor(floor x count), the rest the best of what is left over all heads at once (so a head
    whose attention is concentrated gives its share to one whose attention is spread). scores
    [H, n], comparable across heads (each head's rows sum to one) -> per head, indices in
    temporal order."""
    heads, n = scores.shape
    count = min(count, n)
    own = min(count, math.floor(floor * count))
    chosen = torch.zeros(heads, n, dtype=torch.bool)
    if own:
        chosen.scatter_(1, scores.topk(own, dim=1).indices.cpu(), True)
    rest = scores.float().cpu().masked_fill(chosen, float("-inf")).reshape(-1)
    chosen.view(-1)[rest.topk(heads * (count - own)).indices] = True
    return [row.nonzero().squeeze(1) for row in chosen]


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max-pool along the tokens (the last dimension; stride 1, same length): a kept token
    brings its neighbours' weight. Scores per head [H, n] pool each head's row alone."""
    n = scores.shape[-1] if scores.dim() else 0
    if kernel <= 1 or scores.numel() == 0:
        return scores
    pool = torch.nn.functional.max_pool1d
    out = pool(scores.float().reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2)
    return out[:, 0, :n].reshape(scores.shape)


def window_scores(attention: list[torch.Tensor], kernel: int) -> list[torch.Tensor]:
    """SnapKV's score per layer: an observation window's attention to each visual token,
    max-pooled."""
    return [pooled(a, kernel) for a in attention]


def question_window_scores(
    rows: list[torch.Tensor], visual: list[slice], kernel: int
) -> list[torch.Tensor]:
    """At ask the window is the question: its rows' attention summed over each layer's visual
    columns."""
    return [pooled(r[:, v].sum(dim=0), kernel) for r, v in zip(rows, visual)]


def keep_share(scores: list[torch.Tensor], share: float) -> list[torch.Tensor]:
    """Each layer's top floor(share x n) tokens (at least one), in temporal order."""
    return [top_in_order(s, max(1, math.floor(share * s.numel()))) for s in scores]


def retrieval_key(
    keys: list[torch.Tensor], positions: list[torch.Tensor], rope: tuple, space: str = "pre_rope"
) -> torch.Tensor | None:
    """A block's retrieval key: per given layer, the mean of its keys [H_kv, n, D], heads
    concatenated -> [layers, H_kv * D]. pre_rope: each key rotated back to before RoPE by its
    position [P, n] first (position-free); post_rope: the keys as they are (MuKV's code averages
    them as the block was prefilled, at init_len + j). None when a layer holds none of the block's
    tokens. On the keys' device: the caller brings it over with the block."""
    if any(k.shape[1] == 0 for k in keys):
        return None
    if space not in ("pre_rope", "post_rope"):
        raise ValueError(f"unknown retrieval key space '{space}' (pre_rope, post_rope)")
    inv_freq, axes = rope
    return torch.stack(
        [
            (k.float() if space == "post_rope" else unrotate(k.float(), p, inv_freq, axes))
            .mean(dim=1)
            .reshape(-1)
            for k, p in zip(keys, positions)
        ]
    )


def cosine_scores(query: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """query [..., dim], reps [..., blocks, dim] -> [..., blocks] cosine similarity (one layer's
    blocks, or every layer's at once): one matrix product over the norms' product (at least
    1e-8), several times faster than torch's cosine_similarity over an hour's blocks, to within
    1e-7 (docs/measurements.md)."""
    reps, query = reps.float(), query.float()
    norms = torch.linalg.vector_norm(reps, dim=-1) * torch.linalg.vector_norm(
        query, dim=-1, keepdim=True
    )
    return _products(query, reps) / norms.clamp_min(1e-8)


def dot_scores(query: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """query [..., dim], reps [..., blocks, dim] -> [..., blocks] raw dot product (what ReKV's
    code calls its cosine similarity)."""
    return _products(query.float(), reps.float())


def _products(query: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """Each block's dot product with its query, whatever the leading dims."""
    return (reps @ query.unsqueeze(-1)).squeeze(-1)


SIMILARITY = {"cosine": cosine_scores, "dot": dot_scores}
