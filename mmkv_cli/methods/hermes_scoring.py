"""HERMES' scoring as pure functions over tensors: the layer roles, the forgetting curve, the
pseudo-questions, cross-layer smoothing and the summary fold (the memory policy: hermes.py)."""

from __future__ import annotations

import math

from mmkv_cli.kernels.rope import rotate_keys
from mmkv_cli.lazy import torch
from mmkv_cli.methods.scoring import minmax


def layer_roles(layers: int, shallow: float, deep: float) -> list[tuple[str, float]]:
    """(role, depth fraction p within the middle layers) per layer, split as the authors' code does:
    the first int(shallow L) layers are shallow, deep ones start at int((1 - deep) L), and middle
    layer i (from 0) of n sits at p = i / n."""
    n_shallow = _floor(shallow * layers)
    deep_start = max(n_shallow, _floor((1 - deep) * layers))
    n_middle = deep_start - n_shallow
    roles = []
    for layer in range(layers):
        if layer < n_shallow:
            roles.append(("shallow", 0.0))
        elif layer >= deep_start:
            roles.append(("deep", 1.0))
        else:
            roles.append(("middle", (layer - n_shallow) / n_middle))
    return roles


def _floor(x: float) -> int:
    """int() of a share times a layer count, immune to 0.7 * 10 = 6.9999999."""
    return int(math.floor(x + 1e-9))


def recency_curve(count: int, k: float) -> torch.Tensor:
    """exp(-k d) over `count` tokens in cache order, d = age / (count - 1): 0 for the newest, 1 for
    the oldest."""
    age = (count - 1 - torch.arange(count, dtype=torch.float32)) / max(1, count - 1)
    return torch.exp(-k * age)


def role_questions(local: str, global_: str, turn: tuple[str, str] | None = None) -> dict[str, str]:
    """The pseudo-question each layer role is scored by: shallow the local one (its weight is 0:
    shallow layers keep by recency alone), middle both joined by '; ', deep the global one; each
    after the last question and its answer when `turn` is given."""
    if turn is not None:
        said = f"Question: {turn[0]} Answer: {turn[1]}"
        local = f"Find what is in view about: {said}. {local}"
        global_ = f"Given what was asked: {said}. {global_}"
    return {"shallow": local, "middle": f"{local}; {global_}", "deep": global_}


def layer_score(attention: torch.Tensor, a: float, k: float) -> torch.Tensor:
    """S = (1 - a) minmax(attention) + a minmax(recency)."""
    return (1 - a) * minmax(attention) + a * minmax(recency_curve(attention.numel(), k))


def smooth_deep_to_shallow(
    scores: list[torch.Tensor], kept: list[torch.Tensor], gammas: list[float], total: int
) -> list[torch.Tensor]:
    """S_l <- (1 - g_l) S_l + g_l S_{l+1}, from the deepest layer up, matching tokens by stream
    index.

    Layers may hold different tokens: a token the deeper layer no longer holds keeps its own score.
    """
    out = [s.clone() for s in scores]
    for layer in range(len(scores) - 2, -1, -1):
        deeper = torch.full((total,), float("nan"))
        deeper[kept[layer + 1]] = out[layer + 1]
        pulled = deeper[kept[layer]]
        have = ~pulled.isnan()
        g = gammas[layer]
        out[layer][have] = (1 - g) * out[layer][have] + g * pulled[have]
    return out


def fold_into_summary(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    target: torch.Tensor,
    inv_freq: torch.Tensor,
    axes: torch.Tensor,
    previous: tuple | None = None,
) -> tuple:
    """Evicted keys [H, n, D] rotated to `target` [P] and averaged, values averaged; merged with a
    previous (key [H, 1, D], value [H, 1, D], count) as a running mean. Returns (key, value, count).
    """
    n = keys.shape[1]
    delta = target.view(-1, 1).to(positions) - positions
    moved = rotate_keys(keys.float(), delta, inv_freq, axes)
    k_sum, v_sum = moved.sum(dim=1, keepdim=True), values.float().sum(dim=1, keepdim=True)
    if previous is not None:
        pk, pv, count = previous
        k_sum, v_sum, n = k_sum + pk.float() * count, v_sum + pv.float() * count, n + count
    return k_sum / n, v_sum / n, n
